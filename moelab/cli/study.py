"""``moelab study``: a paper's experiment grid."""

from __future__ import annotations

import argparse
import math
from typing import Any

from moelab.cli.common import (
    STUDY_OVERWRITE_HELP,
    HelpFormatter,
    add_json,
    batch_count,
    emit,
    study_interrupted,
)


def format_study(r: dict) -> str:
    if r.get("scale") == "paper" and not r.get("trained", True):
        lines = [f"wrote the paper-scale configs and commands: {r['report']}"]
        return "\n".join([*lines, *r["commands"]])
    lines = []
    for table in r["tables"][:1]:
        from moelab.studies import StudyTable

        lines += [table["title"], StudyTable.from_json(table).markdown(), ""]
    auto = r.get("seeds_auto")
    if auto:
        lines.append(f"--seeds auto: {auto['seeds']} seeds; stopped because {auto['stopped']}")
        lines += [f"  unresolved: {u['key']}: {u['why']}" for u in auto["unresolved"]]
    lines.append(f"report: {r['report']} ({r['seconds'] / 60:.1f} min)")
    return "\n".join(lines)


def seeds_arg(text: str) -> int | str:
    """--seeds: a whole number >= 1, or "auto"."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 1 or 'auto', got {text!r}"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or 'auto', got {text!r}")
    return n


def budget_arg(text: str) -> float:
    """--budget: minutes > 0."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected minutes > 0, got {text!r}")
    return v


def _study(args: argparse.Namespace) -> int:
    from moelab.studies import run_study
    from moelab.train import TrainingInterrupted

    if args.run and args.scale != "paper":
        raise ValueError("--run applies to --scale paper only (the other scales always train)")
    if args.budget is not None and args.seeds != "auto":
        raise ValueError("--budget applies to --seeds auto only")
    common = dict(
        data=args.data,
        eval_data=args.eval_data,
        threads=args.threads,
        max_batches=args.max_batches,
        options={"dense": args.dense} if args.dense else {},
        progress=not args.json,
        overwrite=args.overwrite,
    )
    out = args.out or f"studies/{args.name}-{args.scale}"
    try:
        if args.seeds == "auto":
            from moelab.studies import run_study_auto
            from moelab.studies.auto import DEFAULT_BUDGET_MINUTES

            if args.run:
                raise ValueError("--seeds auto trains the study: use it at the quick or cpu scale")
            budget = DEFAULT_BUDGET_MINUTES if args.budget is None else args.budget
            result = run_study_auto(
                args.name, out, scale=args.scale, budget_minutes=budget, **common
            )
        else:
            result = run_study(
                args.name, out, scale=args.scale, seeds=args.seeds, run=args.run, **common
            )
    except TrainingInterrupted as stop:  # the arm's checkpoint was written
        return study_interrupted(args, stop)

    return emit(args, result, format_study)


def register(sub: Any) -> None:
    from moelab.studies import STUDIES

    sy = sub.add_parser(
        "study",
        help="a paper's experiment grid: train every arm with N seeds, tables and figures",
        description="Run one paper's study: train every arm (with --seeds N seeds each), "
        "measure the runs as the paper does and write OUT/report.md, PNG figures, "
        "OUT/tables.tex and OUT/results.json; with N >= 2 every number is mean ± sd. "
        "Run folders that exist are reused (finished arms) or resumed (interrupted ones). "
        "OUT must be new, empty or this study's own folder; --overwrite also writes into "
        "another study's or a report's folder; a run folder, a corpus or a folder holding "
        "files moelab did not write is always refused. "
        "Scales: quick (a smoke run), cpu (the tiny preset on the default corpus), paper "
        "(writes the configs and torchrun commands of the paper's scale; --run trains "
        "them). See docs/studies.md.",
        formatter_class=HelpFormatter,
    )
    sy.add_argument("name", choices=list(STUDIES), help="the study")
    sy.add_argument("--scale", choices=["quick", "cpu", "paper"], default="cpu")
    sy.add_argument(
        "--seeds",
        type=seeds_arg,
        default=1,
        metavar="N|auto",
        help="seeds per arm (0 .. N-1); auto: start with 3 and add paired seeds until "
        "every claim is resolved or --budget ends (the seeds each unresolved claim needs, "
        "estimated from its paired interval); results.json and report.md say which "
        "claims remain unresolved and why; run again to resume",
    )
    sy.add_argument(
        "--budget",
        type=budget_arg,
        default=None,
        metavar="MINUTES",
        help="--seeds auto: the time this call may take (default 120); a round starts "
        "only with the seeds the time left pays for, at the last round's cost per seed",
    )
    sy.add_argument("--out", default=None, help="output folder (default: studies/NAME-SCALE)")
    sy.add_argument("--overwrite", action="store_true", help=STUDY_OVERWRITE_HELP)
    sy.add_argument("--data", default=None, help="training corpus (default: the Python docs)")
    sy.add_argument(
        "--eval-data",
        default=None,
        help="a second, out-of-domain corpus for routing statistics (sparse-maps)",
    )
    sy.add_argument(
        "--dense", action="store_true", help="sparse-maps: also train the dense references"
    )
    sy.add_argument("--run", action="store_true", help="--scale paper: also train the arms")
    sy.add_argument(
        "--max-batches",
        type=batch_count,
        default=None,
        metavar="N",
        help="validation batches of the analysis (default: the scale's own)",
    )
    add_json(sy)
    sy.set_defaults(func=_study)
