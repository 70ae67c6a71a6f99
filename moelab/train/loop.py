"""The training loop: ``train(TrainConfig) -> summary dict``, callable from Python.

One run folder holds everything (RUN = ``config.out``):

    RUN/config.json          the TrainConfig
    RUN/tokenizer.json       byte-level BPE trained on the training documents
    RUN/data/{train,val}.*   token shards (moelab.data.shards)
    RUN/metrics.jsonl        one JSON line per logged step (loss, lr, tokens, tokens_per_s,
                             routing numbers; val_loss when evaluated)
    RUN/checkpoints/         see moelab.train.checkpoint
    RUN/summary.json         what train() returns

Each step: loss = next-token cross-entropy + the routers' auxiliary losses; AdamW
(decoupled weight decay on matrices only), linear warm-up then cosine decay to min_lr,
global gradient-norm clipping; then ``router.step(out)`` for every MoE layer (temperature
schedules, bias balancing). bf16 autocast on CUDA only (the router computes in float32
by itself). The batch of step ``s`` is a function of (seed, rank, world size, s), so a
resumed run continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moelab.data import (
    Tokenizer,
    TokenShard,
    batches,
    load_corpus,
    split_documents,
    train_tokenizer,
    unigram_entropy,
    write_shards,
)
from moelab.model import Transformer, param_counts
from moelab.routing.allocation import ThresholdCalibrator
from moelab.routing.certification import gate_lipschitz
from moelab.routing.measures import expert_load, token_measures
from moelab.routing.output import RouterOutput

from . import distributed as D
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, write_atomic
from .config import TrainConfig

__all__ = ["calibrate_thresholds", "lr_at", "router_state", "routing_numbers", "train"]


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps - 1, 1)
    t = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def routing_numbers(outs: list[RouterOutput]) -> dict[str, float]:
    """Headline routing numbers of one forward pass, averaged over the MoE layers
    (the per-token measures of moelab.routing.measures that moelab.diagnostics
    accumulates, here on one batch):
    ``discarded_mass`` (1 - map mass on the selected experts), ``contributors``
    (selected slots with weight > 0 per token), ``singleton_rate`` (tokens whose
    map support is one expert), ``load_cv`` (std / mean of the computed load per
    expert) and ``active_experts`` (computed slots per token); ``active_experts.i``
    is layer i's. Only log steps pay for it."""
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
        n_experts = o.probs_TE.shape[-1]
        fields["discarded_mass"].append(m.discarded_T.mean())
        fields["contributors"].append(m.contrib_TK.sum(-1).float().mean())
        fields["singleton_rate"].append((m.support_T == 1).float().mean())
        load_E = expert_load(o.ids_TK, m.computed_TK, n_experts).float()
        fields["load_cv"].append(load_E.std(unbiased=False) / load_E.mean().clamp_min(1e-12))
        fields["active_experts"].append(m.computed_TK.sum(-1).float().mean())
    numbers = {name: float(torch.stack(values).mean()) for name, values in fields.items()}
    for i, value in enumerate(fields["active_experts"]):
        numbers[f"active_experts.{i}"] = float(value)
    return numbers


@torch.no_grad()
def router_state(model: Transformer) -> dict[str, list[float]]:
    """Per MoE layer, the state of the routers themselves (the same on every rank):
    ``tau_layers`` (temperature), ``lipschitz_layers`` (the gate's Lipschitz constant
    ``||W||_2 / (2 tau)``, exact spectral norm) and, under learned allocation,
    ``k_layers`` (each layer's LapSum budget k_l)."""
    routers = [layer.router for layer in model.moe_layers]
    if not routers:
        return {}
    state: dict[str, list[float]] = {
        "tau_layers": [r.temperature.value for r in routers],
        "lipschitz_layers": [
            float(gate_lipschitz(r.weight.detach(), r.temperature.value)) for r in routers
        ],
    }
    k_L = model.layer_budgets()
    if k_L is not None:
        state["k_layers"] = k_L.detach().float().cpu().tolist()
    return state


def _layer_target(model: Transformer, i: int) -> float:
    """How many experts per token layer i's truncation threshold aims at."""
    k_L = model.layer_budgets()
    if k_L is not None:
        return float(k_L[i].detach())
    rc = model.moe_layers[i].router.config
    return float(rc.lapsum_k if rc.lapsum_k is not None else rc.top_k)


@torch.no_grad()
def calibrate_thresholds(
    model: Transformer, batches_XY: list[tuple[torch.Tensor, torch.Tensor]], autocast: bool = False
) -> list[float]:
    """Set the threshold of every truncating router (selection = "threshold") so that,
    on ``batches_XY``, about k experts per token pass it (:meth:`Router.calibrate`).

    Layer after layer: layer i is calibrated on the map values it sees once the layers
    before it truncate with their new thresholds (its input does not depend on the
    layers after it). Returns the thresholds (one per MoE layer; unchanged for top-k
    routers). Runs in eval mode, so exploration noise is off."""
    layers = model.moe_layers
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for i, layer in enumerate(layers):
            if layer.router.config.selection != "threshold":
                continue
            calibrator = ThresholdCalibrator()
            for x_BS, _ in batches_XY:
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    out = model(x_BS.to(device))
                calibrator.observe(out.router_outputs[i].probs_TE)
            layer.router.calibrate(calibrator, _layer_target(model, i))
    finally:
        model.train(was_training)
    return [layer.router.threshold for layer in layers]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _prepare_run_dir(run: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an existing run unless told how (checked on every rank, before
    any rank writes)."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other; pick one")
    exists = run.exists() and any(run.iterdir())
    if resume and latest_checkpoint(run) is None:
        raise FileNotFoundError(
            f"cannot resume: {run} holds no checkpoint; drop resume (--resume) to start a new run"
        )
    if exists and not (resume or overwrite):
        raise FileExistsError(
            f"run folder {run} already exists; pass resume=True (--resume) to continue it "
            "or overwrite=True (--overwrite) to delete it and start over"
        )


_RESUME_FREE = ("progress", "device", "out")
"""Settings a resumed run may change (``out`` may name the same folder another way);
every other one must match the run's config.json."""


def _check_resume_config(config: TrainConfig, run: Path) -> None:
    """A resumed run continues the run it finds: refuse settings that differ from the
    saved ones (a different schedule, model or data would silently mix two runs)."""
    path = run / "config.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    given = config.to_dict()
    diff = [
        f"{key}: {saved.get(key)!r} in the run, {given.get(key)!r} given"
        # NOTE: only the saved keys: a run written before a setting existed ran without it
        for key in sorted(saved)
        if key not in _RESUME_FREE and saved[key] != given.get(key)
    ]
    if diff:
        raise ValueError(
            f"cannot resume {run} with other settings ({'; '.join(diff)}); pass the "
            "settings of its config.json, or start a new run"
        )


def _prepare_data(config: TrainConfig, run: Path) -> None:
    """Tokenizer (trained on the training documents only) and the train/val shards."""
    if (run / "tokenizer.json").is_file() and (run / "data" / "val.json").is_file():
        return
    docs = load_corpus(config.data)
    if len(docs) < 2:
        raise ValueError(f"the corpus has {len(docs)} document(s); need at least 2")
    train_ids, _ = split_documents(len(docs), config.val_fraction, config.seed)
    tok = train_tokenizer((docs[i] for i in train_ids), config.vocab_size)
    source = str(config.data) if config.data is not None else "default"
    write_shards(
        docs, tok, run / "data", val_fraction=config.val_fraction, seed=config.seed, source=source
    )
    # NOTE: written last: its presence marks the data as complete
    write_atomic(run / "tokenizer.json", tok.to_json().encode())


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
) -> float:
    """Mean validation loss over ``eval_batches`` batches (file order), over all ranks."""
    bare = D.unwrap(model)
    bare.eval()
    devices = [info.device.index or 0] if info.device.type == "cuda" else []
    # NOTE: fork the RNG so that evaluating never changes the training stream (an
    # interrupted and resumed run evaluates at different points than a straight one).
    with torch.random.fork_rng(devices=devices):
        it = batches(
            val, per_rank, config.seq_len, config.seed, info.rank, info.world_size, shuffle=False
        )
        total = 0.0
        for _ in range(config.eval_batches):
            x_BS, y_BS = next(it)
            with torch.autocast("cuda", torch.bfloat16, enabled=info.device.type == "cuda"):
                out = bare(x_BS.to(info.device), y_BS.to(info.device), collect=False)
            total += float(out.loss)
    bare.train()
    return D.all_reduce_mean({"v": total / config.eval_batches}, info)["v"]


def _append_metrics(run: Path, row: dict[str, Any]) -> None:
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _trim_metrics(run: Path, step: int) -> None:
    """Drop lines logged after the checkpoint a resumed run continues from."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keep = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step)
    write_atomic(path, keep.encode())


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train the model ``config`` describes and return a summary.

    Args:
        config: the run (see TrainConfig); ``config.out`` is the run folder.
        resume: continue from the newest checkpoint in the run folder.
        overwrite: delete an existing run folder first.
        stop_after: stop after this many steps (checkpointing), as if interrupted; the
            learning-rate schedule still spans ``config.steps``.

    Returns:
        {"run", "steps", "train_loss", "val_loss", "tokens", "tokens_per_s",
        "unigram_entropy" (nats per token, of the val shard), "active_experts", "params",
        "model"}. Under torchrun every rank returns it; only rank 0 writes files.
    """
    info = D.init_distributed(config.device)
    try:
        return _train(config, info, resume, overwrite, stop_after)
    finally:
        D.shutdown(info)


def _train(
    config: TrainConfig,
    info: D.DistInfo,
    resume: bool,
    overwrite: bool,
    stop_after: int | None,
) -> dict[str, Any]:
    run = Path(config.out)
    if config.batch_size % info.world_size:
        raise ValueError(
            f"batch_size = {config.batch_size} is not divisible by the {info.world_size} "
            "ranks; the global batch is split evenly between them"
        )
    per_rank = config.batch_size // info.world_size
    _prepare_run_dir(run, resume, overwrite)
    if resume:
        _check_resume_config(config, run)
    D.barrier(info)
    if info.is_main:
        if overwrite and run.exists():
            shutil.rmtree(run)
        run.mkdir(parents=True, exist_ok=True)
        _prepare_data(config, run)
        if not resume:
            write_atomic(
                run / "config.json", (json.dumps(config.to_dict(), indent=2) + "\n").encode()
            )
    D.barrier(info)
    tok = Tokenizer.load(run / "tokenizer.json")
    train_shard = TokenShard.open(run / "data" / "train.bin")
    val_shard = TokenShard.open(run / "data" / "val.bin")

    _seed_all(config.seed)
    mc = config.model_config(vocab_size=tok.vocab_size)
    model = Transformer(mc).to(info.device)
    optimizer = _optimizer(model, config)
    start = 0
    if resume:
        ckpt = latest_checkpoint(run)
        assert ckpt is not None
        state = load_checkpoint(ckpt, model, optimizer)
        start = int(state["step"])
        if info.is_main:
            _trim_metrics(run, start)
    if (
        not resume
        and config.calibrate_batches
        and any(layer.router.config.selection == "threshold" for layer in model.moe_layers)
    ):
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
        thresholds = calibrate_thresholds(model, calib, info.device.type == "cuda")
        if info.is_main:
            _append_metrics(run, {"step": 0, "calibrated_thresholds": thresholds})
    ddp = D.wrap(model, info)
    it = batches(
        train_shard,
        per_rank,
        config.seq_len,
        config.seed,
        info.rank,
        info.world_size,
        start_step=start,
    )
    end = config.steps if stop_after is None else min(stop_after, config.steps)
    autocast = info.device.type == "cuda"
    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(
        total=config.steps,
        initial=start,
        disable=not (config.progress and info.is_main),
        file=sys.stderr,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    loss_value, val_loss, tok_s = float("nan"), float("nan"), 0.0
    routing: dict[str, float] = {}
    for step in range(start, end):
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x_BS, y_BS = next(it)
        x_BS, y_BS = x_BS.to(info.device), y_BS.to(info.device)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = ddp(x_BS, y_BS)
        assert out.loss is not None and out.aux_loss is not None
        loss = out.loss + out.aux_loss
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for layer, router_out in zip(model.moe_layers, out.router_outputs, strict=True):
            layer.router.step(router_out)

        done = step + 1
        last = done == end
        if done % config.log_every == 0 or last:
            local = {"loss": float(out.loss.detach()), **routing_numbers(out.router_outputs)}
            reduced = D.all_reduce_mean(local, info)
            loss_value = reduced.pop("loss")
            n_moe = len(model.moe_layers)
            per_layer = [reduced.pop(f"active_experts.{i}") for i in range(n_moe)]
            routing = reduced
            tok_s = (done - start) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
            row: dict[str, Any] = {
                "step": done,
                "loss": loss_value,
                "lr": lr,
                "tokens": done * tokens_per_step,
                "tokens_per_s": tok_s,
                **routing,
            }
            if n_moe:
                row["active_layers"] = per_layer
                row.update(router_state(model))
            if (config.eval_every and done % config.eval_every == 0) or last:
                val_loss = _evaluate(ddp, val_shard, config, info, per_rank)
                row["val_loss"] = val_loss
            if info.is_main:
                _append_metrics(run, row)
            bar.set_postfix(
                loss=f"{loss_value:.3f}",
                tok_s=f"{tok_s:,.0f}",
                active=f"{routing.get('active_experts', float('nan')):.2f}",
                refresh=False,
            )
        elif config.eval_every and done % config.eval_every == 0:
            val_loss = _evaluate(ddp, val_shard, config, info, per_rank)
            if info.is_main:
                _append_metrics(run, {"step": done, "val_loss": val_loss})
        if info.is_main and (
            (config.checkpoint_every and done % config.checkpoint_every == 0) or last
        ):
            save_checkpoint(
                run,
                done,
                model,
                optimizer,
                config.to_dict(),
                extra={"data_step": done, "loss": loss_value, "val_loss": val_loss},
            )
        bar.update(1)
    bar.close()
    D.barrier(info)
    summary = {
        "run": str(run),
        "steps": end,
        "train_loss": loss_value,
        "val_loss": val_loss,
        "tokens": end * tokens_per_step,
        "tokens_per_s": tok_s,
        "unigram_entropy": unigram_entropy(val_shard),
        "world_size": info.world_size,
        "device": str(info.device),
        "params": param_counts(mc),
        "model": {"map": mc.router_config().map, "top_k": mc.router_config().top_k},
        **routing,
        **router_state(model),
    }
    if info.is_main:
        write_atomic(run / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    return summary
