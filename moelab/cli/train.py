"""``moelab train``: train a model and write a run folder."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moelab.cli.common import (
    DEFAULT_MAX_BATCHES,
    HelpFormatter,
    add_json,
    emit,
    fmt_value,
    module_source,
    preset_names,
    to_json,
)


def format_train(r: dict) -> str:
    """The text of moelab train: the run's summary, a line per figure."""
    from moelab.train.progress import format_duration

    return "\n".join(
        [
            f"run              {r['run']}",
            f"steps            {r['steps']} ({r['tokens']:,} tokens)",
            f"train loss       {fmt_value(r['train_loss'])}",
            f"val loss         {fmt_value(r['val_loss'])} (first {r['val_batches']} batches of "
            f"the validation split, {r['val_tokens']:,} tokens; --set eval_batches=N); "
            f"moelab eval and stats cover {DEFAULT_MAX_BATCHES} unless --max-batches",
            f"unigram entropy  {r['unigram_entropy']:.4f} nats",
            f"tokens/s         {r['tokens_per_s']:,.0f} (the last logging window)"
            + (
                f", {avg:,.0f} on average (warm-up and compilation included)"
                if isinstance(avg := r.get("tokens_per_s_avg"), float)
                else ""
            ),
        ]
        + (
            [f"wall time        {format_duration(wall)} ({wall:,.1f} s)"]
            if isinstance(wall := r.get("wall_s"), float)
            else []
        )
        + [
            f"active experts   {r.get('active_experts', float('nan')):.3f}",
        ]
        + (
            [f"learned k_l      {', '.join(f'{k:.3f}' for k in r['k_layers'])}"]
            if "k_layers" in r
            else []
        )
        + (
            [
                f"calibrated cut   {', '.join(f'{t:.4f}' for t in cal['truncation_layers'])}"
                f" (per MoE layer; router.truncation = {cal['requested_truncation']:g} "
                f"replaced, on {cal['batches']} batches)"
            ]
            if (cal := r.get("calibrated"))
            else []
        )
        + (
            [
                f"dead experts     {r['dead_experts']} (per MoE layer: "
                f"{', '.join(str(n) for n in r['dead_layers'])}; no token in the final "
                "evaluation)"
            ]
            if r.get("dead_experts")
            else []
        )
    )


def _train(args: argparse.Namespace) -> int:
    from moelab.train import TrainingInterrupted, apply_overrides, train
    from moelab.train.records import refuse_prepared_overrides

    base = {
        "preset": args.preset,
        "map": args.map,
        "alpha": args.alpha,
        "top_k": args.top_k,
        "steps": args.steps,
        "out": args.out,
        "data": args.data,
        "progress": not args.json,
        "threads": args.threads,
        "parallel": args.parallel,
        "ep": args.ep,
        "compile": args.compile,
        "checkpoint_activations": args.checkpoint_activations,
        "log": args.log,
    }
    # validated once the --set overrides are in (e.g. --map lapsum needs router.lapsum_k);
    # a bad key or value fails here, before the corpus is read or the run folder made
    config = apply_overrides(base, args.set)
    refuse_prepared_overrides(config, args.set)  # prepared data fix vocab_size, val_fraction
    resume = args.resume or args.resume_from is not None
    if not resume:
        from moelab.data import is_prepared, iter_documents
        from moelab.data.corpus import check_trainable_file

        if not is_prepared(config.data):  # a `moelab data prepare` folder is read as it is
            iter_documents(config.data)  # a missing corpus fails before the run folder exists
            check_trainable_file(config.data)  # one file of one paragraph: say how to split
    try:
        result = train(
            config, resume=resume, overwrite=args.overwrite, resume_from=args.resume_from
        )
    except TrainingInterrupted as stop:  # a checkpoint was written (or, with the signal
        # twice, the newest one is kept: TrainingAborted); exit 130 / 143
        print(f"moelab train: {stop}", file=sys.stderr)
        if args.json:
            doc = {"interrupted": stop.signal, "step": stop.step, "resume": stop.command}
            ckpt = str(stop.checkpoint) if stop.checkpoint is not None else None
            print(to_json({**doc, "checkpoint": ckpt}))
        return stop.exit_code
    # what the val loss covers: train() says so (val_batches, val_tokens); a finished
    # run's summary.json written by an older moelab lacks them
    result.setdefault("val_batches", config.eval_batches)
    result.setdefault("val_tokens", config.eval_batches * config.batch_size * config.seq_len)

    return emit(args, result, format_train)


_SHOWN = ("preset", "map", "alpha", "top_k", "steps", "out", "data", "progress", "model")
_SHOWN += ("parallel", "ep", "compile", "checkpoint_activations", "log")
"""TrainConfig fields with an option of their own (not in the epilog's list)."""


def _train_defaults() -> str:
    """The epilog's "key=default" list of the TrainConfig fields without an option of
    their own, read from the source of moelab/train/config.py (its class body's literal
    defaults, in field order), so that ``moelab train --help`` does not import torch;
    tests check it against ``dataclasses.fields(TrainConfig)``."""
    import ast

    tree = module_source("moelab.train.config")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    pairs = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.value is None or node.target.id in _SHOWN:
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:  # field(default_factory=...): no default to show
            continue
        pairs.append(f"{node.target.id}={value!r}")
    return ", ".join(pairs)


def register(sub: Any) -> None:
    tr = sub.add_parser(
        "train",
        help="train an MoE language model and write a run folder",
        description="Train a preset model with the given router on a corpus (the Python "
        "documentation by default): the run folder gets the tokenizer, token shards, "
        "metrics.jsonl, checkpoints and summary.json. Any TrainConfig or model field can be "
        "set with --set key=value (e.g. --set lr=1e-3 --set router.renorm=true "
        "--set n_layers=2). LapSum with learned allocation across layers: --map lapsum "
        "--set model.k_total=4 --set router.selection=threshold (thresholds calibrated on "
        "the first batches).",
        epilog="other settings and their defaults (change with --set): " + _train_defaults(),
        formatter_class=HelpFormatter,
    )
    tr.add_argument("--preset", default="tiny", choices=preset_names(), help="model preset")
    tr.add_argument("--map", default=None, help="router map (None: the preset's)")
    tr.add_argument("--alpha", type=float, default=None, help="alpha of entmax / normmax")
    tr.add_argument("--top-k", type=int, default=None, help="experts per token (None: preset's)")
    tr.add_argument("--steps", type=int, default=200, help="optimiser steps")
    tr.add_argument("--out", required=True, help="run folder")
    tr.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (dotted keys: lr, n_layers, router.map, ...); the value "
        "is read as the field's type: bools true/false, yes/no, on/off, 1/0; none/null where "
        "a field may be None; lists as [a, b] or a,b",
    )
    tr.add_argument(
        "--data",
        default=None,
        help="corpus: a folder of .txt/.md/.rst files (one document each), one such file "
        "(its paragraphs, split at blank lines, are the documents), a saved `datasets` "
        "folder, or a folder of `moelab data prepare` (its tokenizer and shards are used as "
        "they are) (None: the Python docs)",
    )
    tr.add_argument(
        "--parallel",
        default=None,
        choices=("ddp", "fsdp"),
        help="under torchrun: ddp (every rank holds the model) or fsdp (FSDP2, parameters, "
        "gradients and optimizer state sharded per block); one process runs the bare model "
        "(None: ddp, or fsdp with --ep N > 1)",
    )
    tr.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert parallelism: split each MoE layer's experts over groups of N ranks "
        "(with FSDP, which it takes without --parallel; N divides the ranks and n_experts)",
    )
    tr.add_argument(
        "--log",
        default="",
        metavar="SINKS",
        help="live sinks beside metrics.jsonl (always written), comma-separated: tensorboard "
        "(RUN/tensorboard/, watch with: tensorboard --logdir RUN), wandb (Weights & Biases, "
        "offline in RUN/wandb/ unless WANDB_MODE says otherwise; send with wandb sync); "
        "needs pip install 'moelab[track]' (docs/training.md, 'Watching a run')",
    )
    tr.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    tr.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block's activations in the backward pass (less memory)",
    )
    mode = tr.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="continue from the run's newest checkpoint"
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing run folder first (only a moelab run folder: one holding "
        "files moelab did not write is refused)",
    )
    tr.add_argument(
        "--resume-from",
        type=int,
        default=None,
        metavar="STEP",
        help="resume from the checkpoint of STEP instead of the newest (e.g. to skip a "
        "damaged one; --resume already falls back to the newest intact one)",
    )
    add_json(tr)
    tr.set_defaults(func=_train)
