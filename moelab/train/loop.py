"""The training loop: ``train(TrainConfig) -> summary dict``, callable from Python.

Everything a run writes goes into its run folder (RUN = ``config.out``), in the format
of :mod:`moelab.runs` (what it holds: :mod:`moelab.runs.layout`); ``train()`` returns
what it writes to ``RUN/summary.json``.

Each step: loss = next-token cross-entropy + the routers' auxiliary losses; AdamW
(decoupled weight decay on matrices only), linear warm-up then cosine decay to min_lr,
global gradient-norm clipping; then ``router.step(out)`` for every MoE layer
(``moelab.routing.router.step_routers``: temperature schedules, bias balancing, and the
adaptive L1 of ReLU routing from the gates of all layers). bf16 autocast on CUDA only
(the router computes in float32 by itself). The batch of step ``s`` is a function of
(seed, rank, world size, s), so a resumed run continues exactly where the checkpoint
left off.

The parts, each deciding its own timing (as torchtitan's trainer splits them):
moelab.train.run_folder (the checks before a run writes, the prepared data, config.json,
the summary), moelab.train.calibration (before the first step of a new run),
moelab.train.validation (``Validation.due(step)``), moelab.train.metrics
(``Metrics.should_log(step)``, the row, ``write_row``: the one place rows are written),
moelab.train.checkpointing (``Checkpointing.should_save(step)``, the restore of a
resumed run), moelab.train.signals (the handlers; what a stop raises) and
moelab.train.divergence (when a run has diverged, and what it says then). This module
keeps the step loop (:func:`_run_steps`).

Stopping and continuing:

- SIGINT (Ctrl-C) or SIGTERM during the steps: the step under way completes, a
  checkpoint of it is written (atomically, as every checkpoint) and train() raises
  :class:`TrainingInterrupted`, which carries the step, the checkpoint and the command
  that resumes the run (``moelab train`` exits with 128 + the signal's number: 130 for
  SIGINT, 143 for SIGTERM). A second signal of the same kind stops at once, without a
  checkpoint (under torchrun: one sent more than 2 s after the first). Under torchrun
  a signal to any one rank stops them all: after each step the ranks all-reduce the
  largest signal received, so every rank stops after the same step, takes part in
  the one checkpoint (gathered under FSDP) and raises TrainingInterrupted.
- A checkpoint keeps, besides the state, what the next metrics rows need (the
  logging window so far, the warnings said, the row of its step): a resumed run's
  rows equal those of the run without the stop but for the wall-clock fields.
- ``resume=True`` continues from the newest checkpoint ("resuming from step N"); a
  damaged newest checkpoint is skipped for the newest intact one, with a warning;
  ``resume_from=STEP`` picks one. A run with no checkpoint yet starts again from step 0
  (its prepared data are kept). A finished run (checkpoint at ``steps``) is left as it
  is ("run already finished"); a larger ``steps`` extends it (see :func:`lr_at`).

Shape suffixes: B, S, E, L (moelab.shapes).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab._io import write_json
from moelab.data import Tokenizer, TokenShard, batches
from moelab.model import Transformer
from moelab.routing.router import step_routers
from moelab.runs.checkpoints import checkpoint_folder, has_checkpoint, latest_checkpoint
from moelab.runs.layout import DATA, SUMMARY, TOKENIZER
from moelab.runs.metrics import METRICS, read_rows, restore_row

from . import distributed as D
from . import metrics as M
from . import parallel as P
from .calibration import calibrate_before_training, calibrate_thresholds, fit_token_counts
from .checkpointing import Checkpointing, finite_weights, restore_checkpoint
from .config import TrainConfig
from .divergence import (
    TrainingDiverged,
    above_limit,
    check_finite,
    diverged,
    loss_limit,
    too_high,
)
from .health import Watch
from .lock import RunLock, RunLocked
from .metrics import router_state, routing_numbers
from .progress import Progress, RunClock
from .records import calibration_record, with_prepared_settings
from .run_folder import (
    build_summary,
    check_resume_config,
    clear_run,
    finished_summary,
    prepare_data,
    prepare_run_dir,
    record_config,
    remove_failed_start,
    resume_command,
    say_main,
    trim_metrics,
)
from .signals import StopRequest, TrainingAborted, TrainingInterrupted
from .sinks import Sinks, open_sinks
from .sinks import check_available as check_sinks
from .threads import oversubscribed, use_threads
from .validation import Validation

__all__ = [
    "TrainingAborted",
    "TrainingDiverged",
    "TrainingInterrupted",
    "build_optimizer",
    "calibrate_thresholds",
    "loss_limit",
    "lr_at",
    "resume_command",
    "router_state",
    "routing_numbers",
    "train",
]


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at the last step, ``steps - 1``.

    The schedule is a function of ``config.steps``, so a run extended on resume (a
    larger ``steps``) continues on the schedule of the new total from its checkpoint
    on: it decays more slowly, and a run that had finished restarts from
    ``lr_at(old_steps, new)`` above min_lr. Its steps before the checkpoint ran on the
    old schedule, so the extended run equals a run started with the new total exactly
    when both schedules agree on them: when the checkpoint's step is at most
    ``warmup_steps + 1`` (warm-up and the first decay step, at lr, do not depend on
    the total), or ``min_lr == lr``. Otherwise its weights differ from such a run's."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps - 1, 1)
    t = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * t))


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over matrices (weight decay) and the other parameters (none); under learned
    allocation with ``model.k_lr_scale != 1`` the allocator's eta gets a third group
    whose lr is that multiple of the schedule's (``lr_scale``, read by the step)."""
    scale = float(getattr(getattr(model, "config", None), "k_lr_scale", 1.0))
    allocator = getattr(model, "allocator", None)
    separate = allocator is not None and scale != 1.0
    own = {id(p) for p in allocator.parameters()} if separate else set()
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in own]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if own:
        eta = [p for p in allocator.parameters() if p.requires_grad]  # type: ignore[union-attr]
        groups.append({"params": eta, "weight_decay": 0.0, "lr_scale": scale})
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, fused=_fused_adamw(params) or None
    )


def _fused_adamw(params: list[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel can step ``params``: plain float32/bf16/fp16 tensors
    (not FSDP's sharded DTensors) on the CPU or CUDA. It is 3-5x faster than the
    per-parameter loop on the CPU (``moelab bench train``: the optimizer share) and
    computes the same update."""
    plain = all(type(p) is torch.nn.Parameter for p in params)
    devices = {p.device.type for p in params}
    return plain and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


# ---------------------------------------------------------------------------- train


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    resume_from: int | None = None,
) -> dict[str, Any]:
    """Train the model ``config`` describes and return a summary.

    Args:
        config: the run (see TrainConfig); ``config.out`` is the run folder.
        resume: continue from the newest intact checkpoint in the run folder (from step
            0 when it has none yet); a finished run is returned as it is, unless
            ``config.steps`` is larger: then it is extended (see :func:`lr_at`).
        overwrite: delete an existing run folder first.
        stop_after: stop after this many steps (checkpointing), as if interrupted; the
            learning-rate schedule still spans ``config.steps``.
        resume_from: resume from the checkpoint of this step instead (implies resume).

    Returns:
        {"run", "steps", "train_loss", "val_loss", "tokens", "tokens_per_s",
        "tokens_per_s_avg", "wall_s",
        "unigram_entropy" (nats per token, of the val shard), "active_experts", "params",
        "model", "threads", "dead_experts" and "dead_layers" (real experts that computed
        no token in the final evaluation: moelab.train.dead_experts), ...}, as written to
        summary.json (a number that is not finite is None). Under torchrun every rank
        returns it; only rank 0 writes files.

    Raises:
        TrainingInterrupted: SIGINT or SIGTERM arrived; a checkpoint of the step it
            completed was written first.
        FileExistsError, FileNotFoundError, ValueError: the run folder or the settings
            do not allow the request (the message says what to change).
        CheckpointError: no intact checkpoint to resume from.

    torch's intra-op thread count is set to ``config.threads`` (None: the free cores,
    shared between the ranks of this machine) for the run and restored afterwards.
    """
    resume = resume or resume_from is not None
    info = D.init_distributed(config.device)
    old_threads = torch.get_num_threads()
    try:
        threads = use_threads(config.threads, share=D.local_world_size())
        return _train(config, info, threads, resume, overwrite, stop_after, resume_from)
    finally:
        torch.set_num_threads(old_threads)
        D.shutdown(info)


def _train(
    config: TrainConfig,
    info: D.DistInfo,
    threads: int,
    resume: bool,
    overwrite: bool,
    stop_after: int | None,
    resume_from: int | None,
) -> dict[str, Any]:
    run = Path(config.out)
    clock = RunClock()
    if config.batch_size % info.world_size:
        raise ValueError(
            f"batch_size = {config.batch_size} is not divisible by the {info.world_size} "
            "ranks; the global batch is split evenly between them"
        )
    per_rank = config.batch_size // info.world_size
    check_sinks(config.log)  # a missing extra fails before the run folder is touched
    config = with_prepared_settings(config, lambda line: say_main(info, line))
    # NOTE: checked before the data work, which would count in the load average
    short = oversubscribed(threads, D.local_world_size()) if info.device.type == "cpu" else None
    if short is not None:
        say_main(
            info,
            f"warning: {threads} threads but {short} free core(s) (other work keeps the "
            f"rest busy): pass threads={short} (--threads {short}); oversubscribed cores "
            "can make every step many times slower",
        )
    prepare_run_dir(run, resume, overwrite)
    existed = run.exists()
    # NOTE: nothing of the user's to keep: a start that fails before step 1 removes it all
    fresh = overwrite or not existed or not any(p.name[0] != "." for p in run.iterdir())
    lock = RunLock(run)
    reached = [0]  # the steps _run_steps completed
    try:
        refused: RunLocked | None = None
        if info.is_main:
            run.mkdir(parents=True, exist_ok=True)
            try:
                lock.acquire(lambda line: say_main(info, line))
            except RunLocked as err:
                refused = err
        if D.max_over_ranks(int(refused is not None), info):
            raise refused or RunLocked(f"{run} is in use by another trainer")
        if resume:
            config = check_resume_config(config, run, threads, info)
        D.barrier(info)
        if info.is_main:
            if overwrite:
                clear_run(run)
            prepare_data(config, run)
        D.barrier(info)
        return _train_prepared(
            config, info, threads, resume, stop_after, resume_from, run, clock, per_rank, reached
        )
    except BaseException:
        owned = lock.held
        lock.release()
        if info.is_main and owned and fresh and not reached[0] and not has_checkpoint(run):
            remove_failed_start(run, existed)
        raise
    finally:
        lock.release()


def _train_prepared(
    config: TrainConfig,
    info: D.DistInfo,
    threads: int,
    resume: bool,
    stop_after: int | None,
    resume_from: int | None,
    run: Path,
    clock: RunClock,
    per_rank: int,
    reached: list[int],
) -> dict[str, Any]:
    """The run, once its folder is locked and its data prepared."""
    from moelab.data import open_checked

    tok = Tokenizer.load(run / TOKENIZER)
    train_shard, val_shard = open_checked(run / DATA, tok)  # every check; sha256 once

    _seed_all(config.seed)
    mc = config.model_config(vocab_size=tok.vocab_size)
    model = Transformer(mc).to(info.device)
    # NOTE: the parallel mode (DDP, FSDP, compiled blocks, ...) is chosen here, once;
    # the optimiser follows, since FSDP replaces the parameters by their shards
    par = P.setup(model, config, info)
    optimizer = build_optimizer(model, config)
    state = restore_checkpoint(run, par, optimizer, resume_from, info) if resume else None
    start = 0 if state is None else int(state["step"])
    if start >= config.steps:
        return finished_summary(config, run, state, val_shard, mc, par, threads)
    # NOTE: a checkpoint written before moelab recorded its time says nothing: 0
    clock.before = float((state or {}).get("extra", {}).get("elapsed_s") or 0.0)
    end = config.steps if stop_after is None else min(stop_after, config.steps)
    if end <= start:
        raise ValueError(f"stop_after = {stop_after} must exceed the checkpoint's step {start}")
    if resume:
        say_main(info, f"resuming from step {start}" if state else "no checkpoint yet: from step 0")
    cuts = None
    if state is None:
        fit_token_counts(model, train_shard)
        cuts = calibrate_before_training(model, config, train_shard, per_rank, info)
    D.barrier(info)
    if info.is_main:
        calibrated = calibration_record(model, config) if cuts is not None else None
        record_config(config, run, tok.vocab_size, threads, start, info, calibrated)
        if state is None:  # a new run, or one that failed before its first checkpoint
            for name in (METRICS, SUMMARY):
                (run / name).unlink(missing_ok=True)
            if cuts is not None:
                M.write_row(run, {"step": 0, "calibrated_thresholds": cuts, **clock.stamp()})
        else:
            trim_metrics(run, start, info)
            restore_row(run, state.get("extra", {}).get("row"), lambda line: say_main(info, line))
    result = _run_steps(
        config,
        run,
        par,
        optimizer,
        train_shard,
        val_shard,
        per_rank,
        threads,
        start,
        end,
        clock,
        reached,
        None if state is None else state.get("extra"),
    )
    D.barrier(info)
    summary = build_summary(config, run, end, result, val_shard, mc, par, threads)
    if info.is_main:
        write_json(run / SUMMARY, summary)
    return summary


def _run_steps(
    config: TrainConfig,
    run: Path,
    par: P.Parallel,
    optimizer: torch.optim.Optimizer,
    train_shard: TokenShard,
    val_shard: TokenShard,
    per_rank: int,
    threads: int,
    start: int,
    end: int,
    clock: RunClock,
    reached: list[int] | None = None,
    resumed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Steps ``start`` to ``end`` (exclusive): the training loop itself. Returns the
    last logged numbers: {"loss", "val_loss", "tokens_per_s", "tokens_per_s_avg",
    "wall_s", "routing"}; ``clock`` times the metrics rows (moelab.train.progress);
    ``reached[0]`` counts the steps completed (for the caller's clean-up).

    A run that diverges raises :class:`TrainingDiverged` before any checkpoint of it
    (:mod:`moelab.train.divergence`: the checks and where they are made); the same
    signal twice raises :class:`TrainingAborted`.

    ``resumed``: the ``extra`` of the checkpoint a resumed run continues from; its
    logging window and the warnings already said go on from there, so the rows equal
    those of the run without the stop (but for the wall-clock fields)."""
    reached = [0] if reached is None else reached
    stop = StopRequest(repeat_after=2.0 if par.info.enabled else 0.0)
    info, ddp = par.info, par.module
    it = batches(
        train_shard,
        per_rank,
        config.seq_len,
        config.seed,
        info.rank,
        info.world_size,
        start_step=start,
    )
    bar = Progress(config.steps, start, enabled=config.progress and info.is_main)
    # NOTE: before the metrics: their throughput then times the steps, not the sinks' start
    say = bar.say if info.is_main else (lambda line: None)
    sinks = _open_sinks(config, run, start, info, say)
    metrics = M.Metrics(run, config, par, start, end, clock, threads)
    validation = Validation(ddp, val_shard, config, info, per_rank, end)
    saving = Checkpointing(par, run, optimizer, config, end)
    watch = Watch(par.model.config.n_experts, config.dead_fraction)
    vocab = par.model.config.vocab_size
    if resumed:  # the logging window and the warnings said go on as without the stop
        metrics.restore_window(resumed.get("window"))
        watch.restore(resumed.get("watch"))

    def checkpoint(done: int, out: Any, lr: float, row: dict[str, Any] | None) -> None:
        """The checkpoint of ``done``, its loss checked here when no row checked it."""
        if row is None or "loss" not in row:
            loss = D.all_reduce_mean({"loss": float(out.loss.detach())}, info)["loss"]
            what = too_high("loss", loss, done, vocab)
            if what is not None:
                raise diverged(config, run, done, what, lr, vocab)
        saving.save(done, _checkpoint_extra(done, done == end, metrics, validation, watch, row))

    # the first step whose loss was not finite (0: none), kept on the device: no sync
    bad_step = torch.zeros((), dtype=torch.int64, device=info.device)
    try:
        with bar, stop:
            for step in range(start, end):
                lr = lr_at(step, config)
                out, bad_step, norm = _train_step(
                    par, optimizer, it, step, lr, bad_step, metrics, run
                )
                done = step + 1
                reached[0] = done - start
                last = done == end
                saved, logged = saving.should_save(done), metrics.should_log(done)
                if logged or saved:
                    check_finite(par, bad_step, done, config, run, lr)
                row = _step_row(done, logged, lr, out, norm, metrics, validation, watch, say)
                high = _log(row, done, logged, metrics, sinks, bar, vocab)
                if high is not None:  # the row has said it: the run stops
                    raise diverged(config, run, done, high, lr, vocab)
                if validation.due(done):
                    sinks.heatmaps(done)
                if saved:
                    checkpoint(done, out, lr, row)
                bar.advance(done, clock.elapsed())
                metrics.next_window(done)
                # NOTE: the stop decision is collective (the largest signal number of any
                # rank, one small all-reduce per step), so every rank stops after the same
                # step and takes part in the one checkpoint
                signum = 0 if last else D.max_over_ranks(stop.signum, info)
                if signum:
                    if not saved:
                        check_finite(par, bad_step, done, config, run, lr)
                        checkpoint(done, out, lr, row)
                    D.barrier(par.info)
                    raise TrainingInterrupted(
                        done, checkpoint_folder(run, done), signum, resume_command(config)
                    )
    except TrainingDiverged as err:  # the stop is an event of the sinks too
        sinks.event(err.step, f"error: {err}")
        raise
    except KeyboardInterrupt as err:
        if isinstance(err, TrainingInterrupted) or not stop.signum:
            raise
        newest = latest_checkpoint(run) if par.info.is_main else None
        raise TrainingAborted(
            start + reached[0], newest, stop.signum, resume_command(config)
        ) from None
    finally:
        sinks.close()
    return _result(metrics, validation, clock)


def _step_row(
    done: int,
    logged: bool,
    lr: float,
    out: Any,
    norm: torch.Tensor | None,
    metrics: M.Metrics,
    validation: Validation,
    watch: Watch,
    say: Any,
) -> dict[str, Any] | None:
    """The row written after step ``done``: the logged row (with the validation loss
    when one is due, and the watch's warnings), a row of the validation loss alone, or
    None (collective under torchrun)."""
    if logged:
        row = metrics.row(done, lr, out, None if norm is None else float(norm))
        if validation.due(done):
            row.update(_val_numbers(validation.run(done)))
        _warn(row, watch.check(row, metrics.window_since, metrics.dead_LE), say)
        return row
    if validation.due(done):
        return {"step": done, **_val_numbers(validation.run(done)), **metrics.clock.stamp()}
    return None


def _val_numbers(val_loss: float) -> dict[str, float]:
    """``val_loss`` and ``val_ppl`` (``exp(val_loss)``; inf past float range)."""
    try:
        ppl = math.exp(val_loss)
    except OverflowError:
        ppl = math.inf
    return {"val_loss": val_loss, "val_ppl": ppl}


def _open_sinks(config: TrainConfig, run: Path, start: int, info: D.DistInfo, say: Any) -> Sinks:
    """The live sinks of ``config.log`` (rank 0; an empty Sinks elsewhere), with the
    run's earlier rows when it resumes (the heatmaps' history)."""
    rows = read_rows(run / METRICS) if start and config.log and info.is_main else ()
    return open_sinks(config.log, run, config.to_dict(), start, info.is_main, say, rows)


def _warn(row: dict[str, Any], lines: list[str], say: Any) -> None:
    """The warning lines of ``row``: said, and kept in the row as ``warnings``."""
    if lines:
        row["warnings"] = lines
        for line in lines:
            say(line)


def _log(
    row: dict[str, Any] | None,
    done: int,
    logged: bool,
    metrics: M.Metrics,
    sinks: Sinks,
    bar: Progress,
    vocab_size: int,
) -> str | None:
    """Write ``row`` (None: no row after step ``done``) and show a logged one; what the
    diverged message says when its loss or validation loss is above the limit (the row
    carries the warning: :func:`~moelab.train.divergence.above_limit`), else None."""
    if row is None:
        return None
    high = above_limit(row, vocab_size)
    _write(metrics, sinks, row)
    if logged:
        bar.logged(done, metrics.postfix(row), metrics.clock.elapsed())
    return high


def _write(metrics: M.Metrics, sinks: Sinks, row: dict[str, Any]) -> None:
    """One row to metrics.jsonl (rank 0), then to the live sinks."""
    metrics.write(row)
    sinks.write(row)


def _train_step(
    par: P.Parallel,
    optimizer: torch.optim.Optimizer,
    it: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    lr: float,
    bad_step: torch.Tensor,
    metrics: M.Metrics,
    run: Path,
) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """One optimiser step at learning rate ``lr`` on the next batch of ``it``; returns
    the forward pass's output, ``bad_step`` updated on the device (``step + 1`` when
    it is the first step whose loss is not finite) and the gradients' global norm
    before clipping (None when clipping is off and the step is not logged)."""
    info, model, ddp, config = par.info, par.model, par.module, metrics.config
    assert isinstance(model, Transformer)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    x_BS, y_BS = next(it)
    x_BS, y_BS = x_BS.to(info.device), y_BS.to(info.device)
    try:
        with torch.autocast("cuda", torch.bfloat16, enabled=info.device.type == "cuda"):
            out = ddp(x_BS, y_BS)
    except ValueError as err:
        # NOTE: a map refuses NaN scores, which weights that are not finite give, and
        # finite weights grown so large that the activations overflow (lr = 1e5): the
        # first forward of this process runs on the weights it started from, so only a
        # later failure is the training's (its message is kept)
        if finite_weights(par):
            if step == metrics.start:
                raise
            what = f"the forward pass of step {step + 1} failed ({err})"
        else:
            what = f"the weights hold NaN or inf at step {step}"
        raise diverged(config, run, step, what, lr, model.config.vocab_size) from None
    assert out.loss is not None and out.aux_loss is not None
    loss = out.loss + out.aux_loss
    finite = torch.isfinite(loss.detach())
    bad_step = torch.where((bad_step == 0) & ~finite, step + 1, bad_step)
    loss.backward()
    metrics.window.add(out.router_outputs)
    norm = None
    if config.grad_clip > 0:
        norm = par.clip_grad_norm_(config.grad_clip)
    elif metrics.should_log(step + 1):  # the norm for the row; nothing is scaled
        norm = par.clip_grad_norm_(math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with par.routers_gathered():
        step_routers([layer.router for layer in model.moe_layers], out.router_outputs)
    return out, bad_step, norm


def _checkpoint_extra(
    done: int,
    last: bool,
    metrics: M.Metrics,
    validation: Validation,
    watch: Watch,
    row: dict[str, Any] | None,
) -> dict[str, Any]:
    """What a checkpoint of step ``done`` records besides the state (its state.json's
    ``extra``): the data step, the last losses, the run's time and, after the last step
    of a run with MoE layers, the final evaluation's dead experts; and what a resumed
    run needs to log as this run would have: the logging window so far, the watch's
    state and ``row``, the row written at ``done`` (None: none)."""
    extra = {"data_step": done, "loss": metrics.loss, "val_loss": validation.loss}
    extra["elapsed_s"] = metrics.clock.elapsed()
    if last and metrics.n_moe:
        extra["dead_layers"] = validation.dead_final
    return {**extra, "window": metrics.window_state(), "watch": watch.state(), "row": row}


def _result(metrics: M.Metrics, validation: Validation, clock: RunClock) -> dict[str, Any]:
    """What :func:`_run_steps` returns: the last logged numbers."""
    return {
        "loss": metrics.loss,
        "val_loss": validation.loss,
        **metrics.rates,
        "wall_s": clock.elapsed(),
        "dead_layers": validation.dead_final,
        "routing": metrics.routing,
    }
