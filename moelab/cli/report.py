"""``moelab report``: the Markdown + PNG comparison of trained runs."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from moelab.cli.common import (
    HelpFormatter,
    add_json,
    add_max_batches,
    add_step,
    print_out,
    to_json,
)


def _check_runs(runs: Sequence[str]) -> dict[str, Any]:
    """Every run folder exists and holds config.json, tokenizer.json and a checkpoint;
    else one ValueError that names each bad one (before anything is computed). Files
    (saved stats/eval results) are left to build_report, which reads them first.
    Returns the TrainConfig of each run folder."""
    from moelab.diagnostics.evaluate import check_run

    problems, configs = [], {}
    for run in runs:
        if os.path.isfile(run):  # a saved stats/eval result: build_report reads it
            continue
        try:
            configs[run] = check_run(run)
        except (OSError, ValueError) as err:
            problems.append(str(err))
    if problems:
        raise ValueError(
            f"{len(problems)} of the {len(runs)} runs cannot be reported, nothing was "
            f"computed: {'; '.join(problems)}"
        )
    return configs


REPORT_TOP_KS = [1, 2, 4, 8]
"""The K values report sweeps without --top-k (those within each run's experts)."""


def _report_top_ks(top_ks: list[int] | None, configs: dict[str, Any]) -> list[int]:
    """report's --top-k: None sweeps :data:`REPORT_TOP_KS`; given values are checked as
    eval checks them, each in [1, E] for the run folders whose routers sweep K (E: the
    largest count among them; a run with fewer experts leaves out the K above its own)."""
    if top_ks is None:
        return list(REPORT_TOP_KS)
    experts = {}
    for run, config in configs.items():
        mc = config.model_config()
        if mc.moe_indices and mc.router_config().selection_rule.sweep == "top_k":
            experts[run] = mc.n_experts
    most = max(experts.values(), default=None)
    bad = [k for k in top_ks if k < 1 or (most is not None and k > most)]
    if not bad:
        return top_ks
    if most is None:
        raise ValueError(f"--top-k values {bad} are below 1; give K >= 1")
    if len(experts) == 1:
        who = f"{next(iter(experts))} has {most}"
    elif len(set(experts.values())) == 1:
        who = f"the runs have {most}"
    else:
        who = f"the runs have at most {most}"
    raise ValueError(
        f"--top-k values {bad} are outside [1, {most}]: {who} experts per MoE layer; give "
        f"K from 1 to {most}"
    )


def _report(args: argparse.Namespace) -> int:
    from moelab.report import build_report

    top_ks = _report_top_ks(args.top_k, _check_runs(args.runs))
    result = build_report(
        args.runs,
        args.out,
        top_ks,
        max_batches=args.max_batches,
        step=args.step,
        overwrite=args.overwrite,
    )
    doc = {k: result[k] for k in ("report", "files", "latex", "tables")}
    cover = (
        "every validation batch of each run"
        if args.max_batches is None
        else f"at most {args.max_batches} validation batches per run "
        "(--max-batches all for every batch)"
    )
    print_out(to_json(doc) if args.json else f"{result['report']}\nevaluated on {cover}")
    return 0


def register(sub: Any) -> None:
    rep = sub.add_parser(
        "report",
        help="Markdown + PNG comparison of trained runs (and saved HF results)",
        description="Training and validation loss curves, routing statistics, the K budget "
        "sweep, top-2 gap histograms, routing curves and expert loads of each RUN, written "
        "to DIR/report.md, PNG figures and DIR/tables.tex. A RUN may also be a JSON file "
        "saved from `moelab stats --hf M --json` or `moelab eval --hf M --json`: it joins "
        "the routing, per-layer, gap and load tables (stats) or the budget sweep (eval), "
        "labelled by M's folder name (a stats and an eval file of one model make one "
        "entry); sections that need training curves or a checkpoint leave it out. DIR "
        "must be new, empty or the folder of an earlier report, which is refreshed (the "
        "new files replace the old ones only once all are written); --overwrite also "
        "writes into a study's or a run's folder. A folder holding files moelab did not "
        "write is always refused.",
        formatter_class=HelpFormatter,
    )
    rep.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run folders, or JSON files of `moelab stats/eval --hf ... --json`",
    )
    rep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    rep.add_argument(
        "--overwrite",
        action="store_true",
        help="write the report into DIR even when another moelab command made it (a study's "
        "or a run's folder); never into a folder holding files moelab did not write",
    )
    rep.add_argument(
        "--top-k",
        type=int,
        nargs="+",
        default=None,
        help="values of K to sweep on each run folder, each from 1 to its experts (default: "
        f"{' '.join(map(str, REPORT_TOP_KS))}, those within each run's experts; a saved eval "
        "result shows its own)",
    )
    add_step(rep, "every RUN folder")
    add_max_batches(rep)
    add_json(rep, "print one JSON document: the paths and every table's rows as numbers")
    rep.set_defaults(func=_report)
