"""moelab report: three tiny runs give report.md, every PNG it lists and tables.tex.

The session-scoped fixture ``runs`` (softmax, sparsemax, LapSum with learned allocation)
is shared with the other report tests through ``tests/report/conftest.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moelab.cli import build_parser
from moelab.report import format_routing_table, write_report
from moelab.train import train
from tests.train import make_corpus, tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TABLE_HEADER = "| run | map | alpha | K | val loss | val tokens | discarded mass | contributors |"


def _check_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_write_report(full_report: tuple[dict[str, Any], dict[str, Any]]) -> None:
    doc, _ = full_report  # build_report(runs, out, max_batches=1)
    report = Path(doc["report"])
    assert report.name == "report.md" and report.is_file()
    text = report.read_text(encoding="utf-8")
    assert TABLE_HEADER in text
    assert "softmax" in text and "sparsemax" in text
    names = {Path(f).name for f in doc["files"]}
    assert {"loss_curves.png", "loss_vs_k.png", "training_curves.png"} <= names
    assert {"gaps.png", "load_softmax.png"} <= names
    assert {"radii.png", "temperature.png", "allocation.png", "load_lapsum.png"} <= names
    assert "## Temperature and certified radii" in text
    assert {"active_softmax.png", "active_sparsemax.png", "active_lapsum.png"} <= names
    assert "## Active experts per token" in text
    assert len(doc["tables"]["active_experts"]) == 4  # 1 + 1 + 2 MoE layers
    assert "### lapsum (learned allocation)" in text
    assert "nll_vs_active.png" in names and "Truncating routers have no K" in text
    # the threshold law on the trained sparsemax router: singleton % = gaps >= 1 %
    gap_row = next(
        line for line in text.splitlines() if line.startswith("| sparsemax | sparsemax | 1 |")
    )
    cells = [c.strip() for c in gap_row.strip("|").split("|")]
    assert cells[3] == cells[4] and cells[4] == cells[5]
    tex = Path(doc["latex"]).read_text(encoding="utf-8")
    assert tex.count(r"\begin{tabular}") == 4 and tex.count(r"\bottomrule") == 4
    assert r"E[delta \textbar{} s\textgreater{}=3]" in tex  # escaped header
    routing = tex.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines()
    assert len(routing) == 3 and routing[0].startswith("softmax & softmax & - & 2 & ")
    assert all(line.count(" & ") == 14 and line.endswith(r"\\") for line in routing)
    for f in doc["files"]:
        _check_png(Path(f))
        assert f"]({Path(f).name})" in text  # embedded in report.md
    # the tiny test model has 4 experts: K=8 is left out of the sweep
    assert "NLL K=4" in text and "NLL K=8" not in text
    assert "Per layer: softmax" in text and "Per layer: sparsemax" in text
    rows = {r["label"]: r for r in doc["rows"]}
    assert rows["softmax"]["map"] == "softmax" and rows["sparsemax"]["top_k"] == 2
    assert 0.0 < rows["sparsemax"]["contributors"] <= 2.0
    table = format_routing_table(doc["rows"])
    assert table.splitlines()[0].startswith("run") and len(table.splitlines()) == 4
    # the LapSum layer table shows each layer's learned k_l, which sum to K = 3
    lapsum_rows = [
        line for line in text.split("### lapsum (learned allocation)")[1].splitlines()[4:6]
    ]
    k_l = [float(line.split("|")[3]) for line in lapsum_rows]
    assert sum(k_l) == pytest.approx(3.0, abs=2e-3) and k_l != [1.5, 1.5]


def test_dense_run_and_write_report_path(runs: list[Path], tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus", n_docs=20)
    dense = tmp_path / "dense"
    cfg = tiny_config(corpus, dense, steps=2, eval_batches=1)
    train(
        tiny_config(
            corpus, dense, steps=2, eval_batches=1, model={**cfg.model, "moe_layers": "none"}
        )
    )
    path = write_report([runs[1], dense], tmp_path / "rep", top_ks=(1, 2), max_batches=1)
    assert path == tmp_path / "rep" / "report.md"
    text = path.read_text(encoding="utf-8")
    assert "Dense model" in text
    dense_row = next(line for line in text.splitlines() if line.startswith("| dense |"))
    assert "| - |" in dense_row
    assert not (tmp_path / "rep" / "load_dense.png").exists()
    _check_png(tmp_path / "rep" / "gaps.png")
    _check_png(tmp_path / "rep" / "loss_curves.png")  # the dense run has a loss too


def test_demo_parser_trains_by_default() -> None:
    args = build_parser().parse_args(["demo"])
    assert not args.maps and not args.quick and args.out == "demo"
    args = build_parser().parse_args(["demo", "--quick", "--out", "x"])
    assert args.quick and args.out == "x"
    assert build_parser().parse_args(["demo", "--maps"]).maps
