"""The training loop: ``train(TrainConfig) -> summary dict``, callable from Python.

One run folder holds everything (RUN = ``config.out``):

    RUN/config.json          the TrainConfig, with the model config resolved (every
                             ModelConfig and RouterConfig field), the thread count used
                             and ``run_info`` (versions, git commit, device, CPU; see
                             moelab.train.provenance; each resumption appends to
                             ``run_info["resumes"]``)
    RUN/tokenizer.json       byte-level BPE trained on the training documents
    RUN/data/{train,val}.*   token shards (moelab.data.shards)
    RUN/metrics.jsonl        one JSON line per logged step (loss, lr, tokens, tokens_per_s
                             of the last logging window and tokens_per_s_avg, time and
                             elapsed_s (moelab.train.progress), routing numbers,
                             dead_experts of the window (moelab.train.dead_experts);
                             val_loss when evaluated)
    RUN/checkpoints/         see moelab.train.checkpoint
    RUN/summary.json         what train() returns (valid JSON: a number that is not
                             finite is written as null)

Each step: loss = next-token cross-entropy + the routers' auxiliary losses; AdamW
(decoupled weight decay on matrices only), linear warm-up then cosine decay to min_lr,
global gradient-norm clipping; then ``router.step(out)`` for every MoE layer
(``moelab.routing.router.step_routers``: temperature schedules, bias balancing, and the
adaptive L1 of ReLU routing from the gates of all layers). bf16 autocast on CUDA only
(the router computes in float32 by itself). The batch of step ``s`` is a function of
(seed, rank, world size, s), so a resumed run continues exactly where the checkpoint
left off.

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
- ``resume=True`` continues from the newest checkpoint ("resuming from step N"); a
  damaged newest checkpoint is skipped for the newest intact one, with a warning;
  ``resume_from=STEP`` picks one. A run with no checkpoint yet starts again from step 0
  (its prepared data are kept). A finished run (checkpoint at ``steps``) is left as it
  is ("run already finished"); a larger ``steps`` extends it (see :func:`lr_at`).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab import maps
from moelab._strict_json import json_safe
from moelab.data import (
    Tokenizer,
    TokenShard,
    batches,
    unigram_entropy,
)
from moelab.model import ModelConfig, Transformer, param_counts
from moelab.routing.allocation import ThresholdCalibrator
from moelab.routing.certification import gate_lipschitz
from moelab.routing.measures import expert_counts, load_cv, token_measures
from moelab.routing.output import RouterOutput
from moelab.routing.router import step_routers

from . import distributed as D
from . import parallel as P
from .checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    checkpoint_folder,
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    nonfinite_tensors,
    read_checkpoint,
    save_checkpoint,
    write_atomic,
)
from .config import TrainConfig
from .dead_experts import ExpertLoad
from .lock import RunLock, RunLocked
from .metrics import append_metrics, read_metrics
from .progress import Progress, RunClock, Throughput
from .records import (
    CALIBRATED,
    calibration_record,
    with_prepared_settings,
)

# NOTE: _RUN_ENTRIES: moelab._folders reads it from here (what a run folder holds)
from .run_folder import _RUN_ENTRIES as _RUN_ENTRIES
from .run_folder import (
    _check_resume_config,
    _clear_run,
    _has_checkpoint,
    _json_bytes,
    _prepare_data,
    _prepare_run_dir,
    _record_config,
    _remove_failed_start,
    _say,
    resume_command,
)
from .signals import TrainingAborted, TrainingInterrupted, _StopRequest
from .threads import oversubscribed, use_threads

__all__ = [
    "TrainingAborted",
    "TrainingDiverged",
    "TrainingInterrupted",
    "calibrate_thresholds",
    "lr_at",
    "resume_command",
    "router_state",
    "routing_numbers",
    "train",
]


class TrainingDiverged(ValueError):
    """The loss or the weights stopped being finite: training stops before writing a
    checkpoint of them (none is ever written). ``step`` is the first step seen with a
    loss (or weights) that is not finite; the message says what is kept and what to
    try."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


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


@torch.no_grad()
def routing_numbers(outs: list[RouterOutput], discarded: bool = True) -> dict[str, float]:
    """Headline routing numbers of one forward pass, averaged over the MoE layers
    (the per-token measures of moelab.routing.measures that moelab.diagnostics
    accumulates, here on one batch):
    ``discarded_mass`` (1 - map mass on the selected experts), ``contributors``
    (selected slots with weight > 0 per token), ``singleton_rate`` (tokens whose
    map support is one expert), ``load_cv`` (std / mean of the computed load per
    expert) and ``active_experts`` (computed slots per token); ``active_experts.i``
    is layer i's. Only log steps pay for it. ``discarded=False`` (a map without a fixed
    total, ``MapInfo.fixed_total``) leaves ``discarded_mass`` out."""
    if not outs:
        return {}
    fields: dict[str, list[torch.Tensor]] = {
        "discarded_mass": [],
        "contributors": [],
        "singleton_rate": [],
        "load_cv": [],
        "active_experts": [],
    }
    for o in outs:
        m = token_measures(o)
        n_experts = o.n_experts  # the real experts (null ones excluded)
        fields["discarded_mass"].append(m.discarded_T.mean())
        fields["contributors"].append(m.contrib_TK.sum(-1).float().mean())
        fields["singleton_rate"].append((m.support_T == 1).float().mean())
        load_E = expert_counts(o.ids_TK, m.computed_TK, n_experts)
        fields["load_cv"].append(load_cv(load_E).nan_to_num(0.0))  # no load: 0
        fields["active_experts"].append(m.computed_TK.sum(-1).float().mean())
    if not discarded:
        del fields["discarded_mass"]
    numbers = {name: float(torch.stack(values).mean()) for name, values in fields.items()}
    for i, value in enumerate(fields["active_experts"]):
        numbers[f"active_experts.{i}"] = float(value)
    return numbers


@torch.no_grad()
def router_state(model: Transformer) -> dict[str, float | list[float]]:
    """Per MoE layer, the state of the routers themselves (the same on every rank):
    ``tau_layers`` (temperature), ``lipschitz_layers`` (the gate's Lipschitz constant
    ``||W||_2 / (2 tau)``, exact spectral norm) and, under learned allocation,
    ``k_layers`` (each layer's LapSum budget k_l). Under ReLU routing's adaptive L1
    (``router.l1_target``) also the model's one ``l1_coef`` (lambda, after this step's
    update) and ``l1_sparsity`` (the zero-gate fraction over all MoE layers and ranks
    that moved it; its target is 1 - l1_target / E)."""
    routers = [layer.router for layer in model.moe_layers]
    if not routers:
        return {}
    state: dict[str, float | list[float]] = {
        "tau_layers": [r.temperature.value for r in routers],
        "lipschitz_layers": [
            float(gate_lipschitz(r.weight.detach(), r.temperature.value)) for r in routers
        ],
    }
    k_L = model.layer_budgets()
    if k_L is not None:
        state["k_layers"] = k_L.detach().float().cpu().tolist()
    if routers[0].l1_coef is not None:  # one lambda, the same in every router
        state["l1_coef"] = float(routers[0].l1_coef)
        state["l1_sparsity"] = float(routers[0].l1_sparsity)
    return state


def _layer_target(model: Transformer, i: int) -> float:
    """How many experts per token layer i's cut on p aims at: its learned k_l, else the
    experts its rule expects a token to reach (lapsum_k, else top_k)."""
    k_L = model.layer_budgets()
    if k_L is not None:
        return float(k_L[i].detach())
    return model.moe_layers[i].router.config.expected_experts


@torch.no_grad()
def calibrate_thresholds(
    model: Transformer, batches_XY: list[tuple[torch.Tensor, torch.Tensor]], autocast: bool = False
) -> list[float]:
    """Set the cut on p (``truncation``) of every router whose selection rule
    ``calibrates`` (selection = "threshold") so that, on ``batches_XY``, about k experts
    per token pass it (:meth:`Router.calibrate`).

    Layer after layer: layer i is calibrated on the map values it sees once the layers
    before it truncate with their new thresholds (its input does not depend on the
    layers after it). Returns the cuts (one per MoE layer; unchanged for rules that do
    not calibrate, such as top-k). Runs in eval mode, so exploration noise is off."""
    layers = model.moe_layers
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for i, layer in enumerate(layers):
            if not layer.router.selection.calibrates:
                continue
            calibrator = ThresholdCalibrator()
            for x_BS, _ in batches_XY:
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    out = model(x_BS.to(device))
                calibrator.observe(out.router_outputs[i].probs_TE)
            layer.router.calibrate(calibrator, _layer_target(model, i))
    finally:
        model.train(was_training)
    return [layer.router.truncation for layer in layers]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------- run folder and resume


def _load(folder: Path, par: P.Parallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint in ``folder`` into the model (as ``par`` holds it), the
    optimiser and the RNGs; return its state.json. A checkpoint whose weights are not
    finite (written by a moelab that did not check) raises CheckpointError."""
    state, tensors, optim_sd = read_checkpoint(folder)
    par.load_full_state(
        optimizer, tensors, state["model_extra_state"], optim_sd, folder / "model.safetensors"
    )
    if not _finite_weights(par):
        raise CheckpointError(
            f"checkpoint {folder} holds weights that are NaN or infinite (the run had "
            "diverged when a moelab that did not check wrote it)"
        )
    return state


def _local_finite(par: P.Parallel) -> bool:
    """Whether this rank's parameters (its shards under FSDP) are all finite."""
    local = {
        name: p.detach().to_local() if hasattr(p, "to_local") else p.detach()  # a DTensor's shard
        for name, p in par.model.named_parameters()
    }
    return not nonfinite_tensors(local)


def _finite_weights(par: P.Parallel) -> bool:
    """Whether every rank's parameters are finite (collective under torchrun)."""
    return not D.max_over_ranks(0 if _local_finite(par) else 1, par.info)


def _save(
    par: P.Parallel,
    run: Path,
    step: int,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    extra: dict[str, Any],
) -> None:
    """The checkpoint of ``step``: the whole state gathered to rank 0 (collective under
    FSDP: every rank calls this), which writes it. A write that fails (a full disk)
    raises CheckpointWriteError, which says how to resume once it is fixed."""
    model_sd, optim_sd = par.full_state(optimizer)
    if par.info.is_main:
        assert model_sd is not None and optim_sd is not None
        try:
            save_checkpoint(run, step, model_sd, optim_sd, config.to_dict(), extra=extra)
        except CheckpointWriteError as err:
            raise CheckpointWriteError(
                f"{err}; free space (or fix the cause), then resume with: {resume_command(config)}"
            ) from err


def _restore(
    run: Path,
    par: P.Parallel,
    optimizer: torch.optim.Optimizer,
    resume_from: int | None,
    info: D.DistInfo,
) -> dict[str, Any] | None:
    """Load the checkpoint a resumed run continues from (model, optimiser, RNGs) and
    return its state.json; None when the run has no checkpoint yet.

    ``resume_from``: that step's checkpoint. Otherwise the newest (``latest``); when it
    is damaged (truncated, altered, another architecture) or its weights are not
    finite, the newest older one that is intact and finite, with a warning. A step
    folder without a manifest (a write that was interrupted) is no checkpoint at all:
    a run whose only checkpoint write was cut short starts again from step 0."""
    for folder in incomplete_checkpoints(run):
        _say(
            info,
            f"note: {folder} has no manifest (its write was interrupted), so it is no "
            "checkpoint; it is left as it is",
        )
    if resume_from is not None:
        folder = checkpoint_folder(run, resume_from)
        have = list_checkpoints(run)
        if folder not in have:
            steps = ", ".join(str(int(p.name[5:])) for p in have) or "none"
            raise ValueError(
                f"{run} has no checkpoint of step {resume_from} (steps it has: {steps})"
            )
        return _load(folder, par, optimizer)
    newest = latest_checkpoint(run)
    older = [p for p in reversed(list_checkpoints(run)) if newest is None or p.name < newest.name]
    failures: list[str] = []
    for folder in ([newest] if newest is not None else []) + older:
        try:
            state = _load(folder, par, optimizer)
        except CheckpointError as err:
            failures.append(str(err))
            continue
        if failures:
            _say(
                info,
                "warning: skipped "
                + (
                    "a damaged checkpoint"
                    if len(failures) == 1
                    else f"{len(failures)} damaged checkpoints"
                )
                + f" ({'; '.join(failures)}); resuming from {folder.name}, the newest intact one",
            )
        return state
    if failures:
        raise CheckpointError(
            f"no intact checkpoint in {run}: {'; '.join(failures)}; start over with "
            "overwrite=True (--overwrite)"
        )
    return None


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


@torch.no_grad()
def _evaluate(
    model: torch.nn.Module,
    val: TokenShard,
    config: TrainConfig,
    info: D.DistInfo,
    per_rank: int,
    load: ExpertLoad | None = None,
) -> float:
    """Mean validation loss over the first ``eval_batches`` batches of the validation
    split in file order (fewer when the split is shorter: no batch is read twice), over
    all ranks; :func:`_val_batches` is their count. ``load`` counts the experts' tokens."""
    bare = D.unwrap(model)
    bare.eval()
    devices = [info.device.index or 0] if info.device.type == "cuda" else []
    # NOTE: fork the RNG so that evaluating never changes the training stream (an
    # interrupted and resumed run evaluates at different points than a straight one).
    with torch.random.fork_rng(devices=devices):
        total, n = 0.0, 0
        for x_BS, y_BS in _val_iter(val, per_rank, config, info):
            with torch.autocast("cuda", torch.bfloat16, enabled=info.device.type == "cuda"):
                out = bare(x_BS.to(info.device), y_BS.to(info.device), collect=load is not None)
            if load is not None:
                load.add(out.router_outputs)
            total += float(out.loss)
            n += 1
    bare.train()
    return D.all_reduce_mean({"v": total / n}, info)["v"]


def _val_iter(
    val: TokenShard, per_rank: int, config: TrainConfig, info: D.DistInfo
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The validation batches training evaluates on: one pass in file order, cut at
    ``eval_batches`` (every rank gets the same count)."""
    it = batches(
        val,
        per_rank,
        config.seq_len,
        config.seed,
        info.rank,
        info.world_size,
        shuffle=False,
        epochs=1,
    )
    return itertools.islice(it, config.eval_batches)


def _val_batches(val: TokenShard, per_rank: int, config: TrainConfig, info: D.DistInfo) -> int:
    """How many batches (per rank) training's validation loss covers."""
    return sum(1 for _ in _val_iter(val, per_rank, config, info))


def _append_metrics(run: Path, row: dict[str, Any]) -> None:
    append_metrics(run, row)


def _trim_metrics(run: Path, step: int, info: D.DistInfo) -> None:
    """Drop lines logged after the checkpoint a resumed run continues from (and a last
    line cut off by an interrupted write, with a warning)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return
    rows = read_metrics(path, lambda line: _say(info, line))
    keep = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step)
    write_atomic(path, keep.encode())


# ------------------------------------------------------------------------ interrupts


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
    config = with_prepared_settings(config, lambda line: _say(info, line))
    # NOTE: checked before the data work, which would count in the load average
    short = oversubscribed(threads, D.local_world_size()) if info.device.type == "cpu" else None
    if short is not None:
        _say(
            info,
            f"warning: {threads} threads but {short} free core(s) (other work keeps the "
            f"rest busy): pass threads={short} (--threads {short}); oversubscribed cores "
            "can make every step many times slower",
        )
    _prepare_run_dir(run, resume, overwrite)
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
                lock.acquire(lambda line: _say(info, line))
            except RunLocked as err:
                refused = err
        if D.max_over_ranks(int(refused is not None), info):
            raise refused or RunLocked(f"{run} is in use by another trainer")
        if resume:
            config = _check_resume_config(config, run, threads, info)
        D.barrier(info)
        if info.is_main:
            if overwrite:
                _clear_run(run)
            _prepare_data(config, run)
        D.barrier(info)
        return _train_prepared(
            config, info, threads, resume, stop_after, resume_from, run, clock, per_rank, reached
        )
    except BaseException:
        owned = lock.held
        lock.release()
        if info.is_main and owned and fresh and not reached[0] and not _has_checkpoint(run):
            _remove_failed_start(run, existed)
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

    tok = Tokenizer.load(run / "tokenizer.json")
    train_shard, val_shard = open_checked(run / "data", tok)  # every check; sha256 once

    _seed_all(config.seed)
    mc = config.model_config(vocab_size=tok.vocab_size)
    model = Transformer(mc).to(info.device)
    # NOTE: the parallel mode (DDP, FSDP, compiled blocks, ...) is chosen here, once;
    # the optimiser follows, since FSDP replaces the parameters by their shards
    par = P.setup(model, config, info)
    optimizer = _optimizer(model, config)
    state = _restore(run, par, optimizer, resume_from, info) if resume else None
    start = 0 if state is None else int(state["step"])
    if start >= config.steps:
        return _finished(config, run, state, val_shard, mc, par, threads)
    # NOTE: a checkpoint written before moelab recorded its time says nothing: 0
    clock.before = float((state or {}).get("extra", {}).get("elapsed_s") or 0.0)
    end = config.steps if stop_after is None else min(stop_after, config.steps)
    if end <= start:
        raise ValueError(f"stop_after = {stop_after} must exceed the checkpoint's step {start}")
    if resume:
        _say(info, f"resuming from step {start}" if state else "no checkpoint yet: from step 0")
    cuts = None
    if state is None:
        _fit_token_counts(model, train_shard)
        cuts = _calibrate(model, config, train_shard, per_rank, info)
    D.barrier(info)
    if info.is_main:
        calibrated = calibration_record(model, config) if cuts is not None else None
        _record_config(config, run, tok.vocab_size, threads, start, info, calibrated)
        if state is None:  # a new run, or one that failed before its first checkpoint
            for name in ("metrics.jsonl", "summary.json"):
                (run / name).unlink(missing_ok=True)
            if cuts is not None:
                _append_metrics(run, {"step": 0, "calibrated_thresholds": cuts, **clock.stamp()})
        else:
            _trim_metrics(run, start, info)
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
    )
    D.barrier(info)
    summary = _summary(config, run, end, result, val_shard, mc, par, threads)
    if info.is_main:
        write_atomic(run / "summary.json", _json_bytes(summary))
    return summary


def _fit_token_counts(model: Transformer, train_shard: TokenShard) -> None:
    """Before the first step: the routers whose rule builds state from the training
    data's token frequencies (``needs_token_counts``: hash routing's balanced table)
    get the training shard's count of each token id (every rank alike, no communication;
    a resumed run reads the state back from the checkpoint)."""
    rules = [
        layer.router.selection
        for layer in model.moe_layers
        if layer.router.selection.needs_token_counts
    ]
    if not rules:
        return
    counts_V = np.zeros(train_shard.vocab_size, dtype=np.int64)
    for start in range(0, len(train_shard), 1 << 24):  # NOTE: chunks bound the int64 copy
        chunk = train_shard.tokens[start : start + (1 << 24)]
        counts_V += np.bincount(chunk, minlength=train_shard.vocab_size)
    for rule in rules:
        rule.balance(torch.from_numpy(counts_V))


def _calibrate(
    model: Transformer,
    config: TrainConfig,
    train_shard: TokenShard,
    per_rank: int,
    info: D.DistInfo,
) -> list[float] | None:
    """Before the first step: the cuts of routers whose rule calibrates (calibrate_batches);
    returns every MoE layer's cut (:func:`calibrate_thresholds`), None when nothing
    calibrates."""
    if not config.calibrate_batches or not any(
        layer.router.selection.calibrates for layer in model.moe_layers
    ):
        return None
    # NOTE: every rank calibrates on the same tokens, the first global batches of a
    # single process, in chunks of the per-rank size: the thresholds agree across
    # ranks without communication and match a single-process run. A resumed run
    # reads them back from the checkpoint (the routers' extra state).
    first = batches(train_shard, config.batch_size, config.seq_len, config.seed, 0, 1)
    calib = [
        (x_CS, y_CS)
        for x_BS, y_BS in (next(first) for _ in range(config.calibrate_batches))
        for x_CS, y_CS in zip(x_BS.split(per_rank), y_BS.split(per_rank), strict=True)
    ]
    return calibrate_thresholds(model, calib, info.device.type == "cuda")


def _diverged(config: TrainConfig, run: Path, step: int, what: str, lr: float) -> TrainingDiverged:
    newest = latest_checkpoint(run)
    kept = (
        f"the newest checkpoint, step {int(newest.name[5:])}, is finite and kept"
        if newest is not None
        else "there is no checkpoint"
    )
    clip = f"grad_clip = {config.grad_clip:g}" if config.grad_clip > 0 else "grad_clip off"
    return TrainingDiverged(
        f"training diverged: {what} at step {step}, so no checkpoint of it is written; {kept}. "
        f"Try a lower learning rate (lr = {config.lr:g}, {lr:g} at that step: --set lr=...) "
        f"or a tighter gradient clip ({clip}: --set grad_clip=...) and start over "
        "(--overwrite)",
        step,
    )


def _check_finite(
    par: P.Parallel, bad_step: torch.Tensor, step: int, config: TrainConfig, run: Path, lr: float
) -> None:
    """Raise TrainingDiverged when any rank saw a loss that is not finite (``bad_step``:
    the first such step, 0 for none) or holds weights that are not after ``step``
    (collective under torchrun: every rank raises alike)."""
    info = par.info
    local_bad = int(bad_step)
    weights_bad = not _local_finite(par)
    if not D.max_over_ranks(int(bool(local_bad) or weights_bad), info):
        return
    big = 1 << 62
    first = -D.max_over_ranks(-(local_bad or big), info)
    if first < big:
        raise _diverged(config, run, first, "the loss is not finite", lr)
    raise _diverged(config, run, step, "the weights hold NaN or inf", lr)


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
) -> dict[str, Any]:
    """Steps ``start`` to ``end`` (exclusive): the training loop itself. Returns the
    last logged numbers: {"loss", "val_loss", "tokens_per_s", "tokens_per_s_avg",
    "wall_s", "routing"}; ``clock`` times the metrics rows (moelab.train.progress);
    ``reached[0]`` counts the steps completed (for the caller's clean-up).

    The loss of every step is checked on the device (no synchronisation) and, with the
    weights, read at each logged step and before each checkpoint: a loss or weights
    that are not finite raise :class:`TrainingDiverged` and no checkpoint of them is
    written. The same signal twice raises :class:`TrainingAborted`."""
    reached = [0] if reached is None else reached
    stop = _StopRequest(repeat_after=2.0 if par.info.enabled else 0.0)
    info, model, ddp = par.info, par.model, par.module
    assert isinstance(model, Transformer)
    it = batches(
        train_shard,
        per_rank,
        config.seq_len,
        config.seed,
        info.rank,
        info.world_size,
        start_step=start,
    )
    autocast = info.device.type == "cuda"
    tokens_per_step = config.batch_size * config.seq_len
    # a discarded mass only where the map's values have a fixed total (not sigmoid, relu)
    has_mass_share = maps.info(model.config.router_config().map).fixed_total
    share = D.local_world_size()
    bar = Progress(config.steps, start, enabled=config.progress and info.is_main)
    speed = Throughput(start, tokens_per_step)
    loss_value, val_loss = float("nan"), float("nan")
    rates = {"tokens_per_s": 0.0, "tokens_per_s_avg": 0.0}
    routing: dict[str, float] = {}
    n_moe = len(model.moe_layers)
    window, final = ExpertLoad(), ExpertLoad()  # dead experts: the logging window, the end
    dead_final: list[int] = []
    # the first step whose loss was not finite (0: none), kept on the device: no sync
    bad_step = torch.zeros((), dtype=torch.int64, device=info.device)
    try:
        with bar, stop:
            for step in range(start, end):
                lr = lr_at(step, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x_BS, y_BS = next(it)
                x_BS, y_BS = x_BS.to(info.device), y_BS.to(info.device)
                try:
                    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                        out = ddp(x_BS, y_BS)
                except ValueError:
                    # NOTE: a map refuses NaN scores, which weights that are not finite give
                    if _finite_weights(par):
                        raise
                    raise _diverged(config, run, step, "the weights hold NaN or inf", lr) from None
                assert out.loss is not None and out.aux_loss is not None
                loss = out.loss + out.aux_loss
                finite = torch.isfinite(loss.detach())
                bad_step = torch.where((bad_step == 0) & ~finite, step + 1, bad_step)
                loss.backward()
                window.add(out.router_outputs)
                if config.grad_clip > 0:
                    par.clip_grad_norm_(config.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with par.routers_gathered():
                    step_routers([layer.router for layer in model.moe_layers], out.router_outputs)

                done = step + 1
                reached[0] = done - start
                last = done == end
                evaluate = (config.eval_every and done % config.eval_every == 0) or last
                saved = (config.checkpoint_every and done % config.checkpoint_every == 0) or last
                logged = done % config.log_every == 0 or last
                if logged or saved:
                    _check_finite(par, bad_step, done, config, run, lr)
                if logged:
                    routing_now = routing_numbers(out.router_outputs, has_mass_share)
                    local = {"loss": float(out.loss.detach()), **routing_now}
                    reduced = D.all_reduce_mean(local, info)
                    loss_value = reduced.pop("loss")
                    per_layer = [reduced.pop(f"active_experts.{i}") for i in range(n_moe)]
                    routing = reduced
                    rates = speed.rates(done)
                    row: dict[str, Any] = {
                        "step": done,
                        "loss": loss_value,
                        "lr": lr,
                        "tokens": done * tokens_per_step,
                        **rates,
                        **clock.stamp(),
                        **routing,
                    }
                    if n_moe:
                        row["active_layers"] = per_layer
                        row["dead_layers"] = window.dead(info)
                        row["dead_experts"] = sum(row["dead_layers"])
                        with par.routers_gathered():
                            row.update(router_state(model))
                    if evaluate:
                        load = final if last else None
                        val_loss = row["val_loss"] = _evaluate(
                            ddp, val_shard, config, info, per_rank, load
                        )
                        dead_final = final.dead(info) if last else dead_final
                    if info.is_main:
                        _append_metrics(run, row)
                    postfix = {
                        "loss": f"{loss_value:.3f}",
                        "tok_s": f"{rates['tokens_per_s']:,.0f}",
                        "active": f"{routing.get('active_experts', float('nan')):.2f}",
                    }
                    if row.get("dead_experts"):
                        postfix["dead"] = str(row["dead_experts"])
                    if evaluate:
                        postfix["val_loss"] = f"{val_loss:.3f}"
                    if info.device.type == "cpu" and config.progress:
                        short = oversubscribed(threads, share, speed.seconds())
                        if short is not None:
                            postfix["threads"] = f"{threads}>{short} free cores"
                    bar.logged(done, postfix, clock.elapsed())
                elif evaluate:
                    val_loss = _evaluate(ddp, val_shard, config, info, per_rank)
                    if info.is_main:
                        _append_metrics(run, {"step": done, "val_loss": val_loss, **clock.stamp()})
                extra = {"data_step": done, "loss": loss_value, "val_loss": val_loss}
                extra["elapsed_s"] = clock.elapsed()
                if last and n_moe:
                    extra["dead_layers"] = dead_final
                if saved:
                    _save(par, run, done, optimizer, config, extra)
                bar.advance(done, clock.elapsed())
                if done % config.log_every == 0:
                    speed.next_window(done)
                # NOTE: the stop decision is collective (the largest signal number of any
                # rank, one small all-reduce per step), so every rank stops after the same
                # step and takes part in the one checkpoint
                signum = 0 if last else D.max_over_ranks(stop.signum, info)
                if signum:
                    if not saved:
                        _check_finite(par, bad_step, done, config, run, lr)
                        _save(par, run, done, optimizer, config, extra)
                    D.barrier(info)
                    raise TrainingInterrupted(
                        done, checkpoint_folder(run, done), signum, resume_command(config)
                    )
    except KeyboardInterrupt as err:
        if isinstance(err, TrainingInterrupted) or not stop.signum:
            raise
        newest = latest_checkpoint(run) if par.info.is_main else None
        raise TrainingAborted(
            start + reached[0], newest, stop.signum, resume_command(config)
        ) from None
    return {
        "loss": loss_value,
        "val_loss": val_loss,
        **rates,
        "wall_s": clock.elapsed(),
        "dead_layers": dead_final,
        "routing": routing,
    }


def _summary(
    config: TrainConfig,
    run: Path,
    steps: int,
    result: dict[str, Any],
    val_shard: TokenShard,
    mc: ModelConfig,
    par: P.Parallel,
    threads: int,
) -> dict[str, Any]:
    """What train() returns and writes to summary.json (not finite numbers as None)."""
    info, model = par.info, par.model
    assert isinstance(model, Transformer)
    with par.routers_gathered():
        state = router_state(model)
    rc = mc.router_config()
    per_rank = config.batch_size // info.world_size
    calibrated = calibration_record(model, config)
    if calibrated is not None:
        state = {CALIBRATED: calibrated, **state}
    if result.get("dead_layers"):  # the final evaluation's (a run with MoE layers)
        dead = result["dead_layers"]
        state = {"dead_experts": sum(dead), "dead_layers": dead, **state}
    return json_safe(
        {
            "run": str(run),
            "steps": steps,
            "train_loss": result["loss"],
            "val_loss": result["val_loss"],
            "tokens": steps * config.batch_size * config.seq_len,
            # the last logging window's rate; the average since the first step of this
            # part of the run; the run's wall time over all its parts
            "tokens_per_s": result["tokens_per_s"],
            "tokens_per_s_avg": result.get("tokens_per_s_avg", float("nan")),
            "wall_s": result.get("wall_s", float("nan")),
            "unigram_entropy": unigram_entropy(val_shard),
            # what val_loss covers: the first val_batches global batches, in file order
            "val_batches": (n_val := _val_batches(val_shard, per_rank, config, info)),
            "val_tokens": n_val * config.batch_size * config.seq_len,
            "world_size": info.world_size,
            "device": str(info.device),
            "threads": threads,
            "params": param_counts(mc),
            "model": {"map": rc.map, "top_k": rc.top_k},
            **result["routing"],
            **state,
        }
    )


def _finished(
    config: TrainConfig,
    run: Path,
    state: dict[str, Any] | None,
    val_shard: TokenShard,
    mc: ModelConfig,
    par: P.Parallel,
    threads: int,
) -> dict[str, Any]:
    """Resuming a run whose checkpoint is at (or past) ``config.steps``: nothing to
    train, nothing written. Returns its summary.json; one that is missing or holds
    numbers that are not finite (written by an older moelab) is rebuilt from the final
    checkpoint (``model`` holds its weights) and the last line of metrics.jsonl."""
    assert state is not None
    info = par.info
    step = int(state["step"])
    if step > config.steps:
        raise ValueError(
            f"{run} is at step {step}, past steps = {config.steps}; pass steps >= {step} "
            "(--steps) to continue it"
        )
    _say(info, f"run already finished at step {step}; pass a larger --steps to extend it")
    path = run / "summary.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        saved = None
    if isinstance(saved, dict) and saved == json_safe(saved) and saved.get("steps") == step:
        return saved
    rows = read_metrics(run / "metrics.jsonl", lambda line: _say(info, line))
    row = next((r for r in reversed(rows) if r["step"] == step and "loss" in r), {})
    extra = state.get("extra", {})
    result = {
        "loss": extra.get("loss", row.get("loss", float("nan"))),
        "val_loss": extra.get("val_loss", row.get("val_loss", float("nan"))),
        "tokens_per_s": row.get("tokens_per_s", float("nan")),
        "tokens_per_s_avg": row.get("tokens_per_s_avg", float("nan")),
        "wall_s": extra.get("elapsed_s", row.get("elapsed_s", float("nan"))),
        "dead_layers": extra.get("dead_layers", []),
        "routing": {k: row[k] for k in _ROUTING_KEYS if k in row},
    }
    summary = _summary(config, run, step, result, val_shard, mc, par, threads)
    D.barrier(info)
    if info.is_main:
        write_atomic(path, _json_bytes(summary))
    return summary


_ROUTING_KEYS = ("discarded_mass", "contributors", "singleton_rate", "load_cv", "active_experts")
"""The keys of :func:`routing_numbers` that the summary carries."""
