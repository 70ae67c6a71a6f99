"""Smoke test of the selection-rule benchmark (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from moelab.bench import selection
from moelab.cli import main
from moelab.routing import selection as rules


def test_every_rule_is_timed_against_top_k() -> None:
    result = selection.run(rows=64, experts=(8,), top_k=2, repeats=1, warmup=0, progress=False)
    labels = [label for label, _ in selection.arms(8, 2)]
    # every registered rule has an arm
    timed_rules = {keys.get("selection", "topk") for _, keys in selection.arms(8, 2)}
    assert timed_rules == set(rules.available())
    assert [r["impl"] for r in result["rows"] if r["pass"] == "fwd"] == labels
    for row in result["rows"]:
        assert row["ms"] > 0 and row["ratio"] > 0
        if row["impl"] == selection.REFERENCE:
            assert row["ratio"] == 1.0
    text = selection.format_table(result)
    for label in labels:
        assert f"| {label} |" in text
    # the per-step costs beside the table: Sinkhorn's iteration, quantile balancing's solve
    assert any(n.startswith("sinkhorn on 64x8") for n in result["notes"])
    assert any(n.startswith("quantile balancing on 64x8") for n in result["notes"])


def test_cli_bench_selection_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "selection", "--rows", "32", "--experts", "8", "--top-k", "2"]
    assert main([*argv, "--repeats", "1", "--warmup", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["pass"] for r in doc["rows"]} == {"fwd", "fwdbwd"}
    assert doc["threads"] == 1


@pytest.mark.parametrize("argv", [["--experts", "0"], ["--rows", "0"], ["--top-k", "0"]])
def test_bad_sizes_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "selection", *argv, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error: bench selection needs") and err.count("\n") == 1
