"""``moelab demo``: the sparse-maps study at the cpu scale, or the tour of the maps."""

from __future__ import annotations

import argparse
from typing import Any

from moelab.cli.common import STUDY_OVERWRITE_HELP, HelpFormatter, add_json, emit, study_interrupted


def format_demo(r: dict) -> str:
    """The text of moelab demo: the findings, main and routing tables, then the report's
    path."""
    from moelab import studies

    lines = []
    tables = {t["key"]: t for t in r["tables"]}
    for key in ("findings", "main", "routing"):
        if key in tables:
            table = tables[key]
            lines += [table["title"], studies.StudyTable.from_json(table).markdown(), ""]
    lines.append(f"report: {r['report']} ({r['seconds'] / 60:.1f} min)")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    """``moelab demo``: the sparse-maps study at the cpu scale (``--quick``: the quick
    scale; ``--dense``: with the dense references), one seed; ``--maps``: the tour of the
    maps. JSON keys: ``report`` (OUT/report.md), ``files`` (its figures), ``runs`` (the
    run folders), ``rows`` (per arm: the main table and routing statistics, means over
    the seeds), ``findings`` (the paper's claims with their verdicts, as results.json
    holds them), ``tables`` (every table of the study), ``results`` (OUT/results.json)
    and ``seconds``."""
    if args.maps:
        from moelab.studies import tour

        return emit(args, tour.run(rows=args.rows), tour.format_report)
    from pathlib import Path

    from moelab import studies
    from moelab.studies.sparse_maps import headline_rows
    from moelab.train import TrainingInterrupted

    try:
        doc = studies.run_study(
            "sparse-maps",
            args.out,
            scale="quick" if args.quick else "cpu",
            threads=args.threads,
            # NOTE: the demo keeps the study's four map-balanced arms: the
            # softmax-balanced ones would add three runs (about 75% more time)
            options={"softmax_balanced": False, **({"dense": True} if args.dense else {})},
            progress=not args.json,
            overwrite=args.overwrite,
        )
    except TrainingInterrupted as stop:  # the arm's checkpoint was written
        return study_interrupted(args, stop)
    result = {
        "report": doc["report"],
        "files": [str(Path(args.out) / f) for f in doc["figures"]],
        "runs": [run for arm in doc["arms"] for run in arm["runs"]],
        "rows": headline_rows(doc),
        "findings": doc.get("findings", []),
        "tables": doc["tables"],
        "results": str(Path(args.out) / "results.json"),
        "seconds": doc["seconds"],
    }

    return emit(args, result, format_demo)


def register(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="the embedded default: the sparse-maps study (four maps trained, swept over K)",
        description="The sparse-maps study at the cpu scale, one seed (moelab study "
        "sparse-maps --scale cpu --out OUT): train the tiny preset with softmax, entmax 1.5, "
        "sparsemax and normmax 2 (top-2, 400 steps of 8 x 128 tokens, same seed and data) "
        "on the default corpus, measure their routing, evaluate each with K in 1 2 4 8 and "
        "write OUT/report.md with the paper's claims as findings, its tables and figures "
        "(about 3 minutes on 2 quiet CPU cores; --quick: a shrunken model, about 20 "
        "seconds). Runs that exist in OUT are reused. OUT must be new, empty or the demo's "
        "own folder (--overwrite: also another "
        "study's or a report's folder). --maps shows the tour of the maps instead.",
        formatter_class=HelpFormatter,
    )
    demo.add_argument(
        "--quick", action="store_true", help="the study's quick scale, for a first look"
    )
    demo.add_argument(
        "--dense",
        action="store_true",
        help="also train the dense reference (larger active budget; one more run of as many steps)",
    )
    demo.add_argument("--out", default="demo", help="output folder (runs/, report.md)")
    demo.add_argument("--overwrite", action="store_true", help=STUDY_OVERWRITE_HELP)
    demo.add_argument(
        "--maps",
        action="store_true",
        help="instead: a tour of the maps (weights, supports, the threshold law)",
    )
    demo.add_argument(
        "--rows", type=int, default=100_000, help="with --maps: random rows for the law check"
    )
    add_json(demo)
    demo.set_defaults(func=_demo)
