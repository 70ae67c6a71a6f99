"""The command line: every command prints one JSON document with --json."""

from __future__ import annotations

import json

import pytest

from moelab import cli, maps


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "demo", "--maps", "--rows", "4000")
    assert out["backend"] == maps.backend()
    assert len(out["vectors"]) == 3
    for vec in out["vectors"]:
        for m in vec["maps"]:
            # weights are rounded for display; the support counts the exact ones
            assert sum(w > 0 for w in m["weights"]) <= m["support"] <= len(m["weights"])
    by_map = {m["map"]: m for m in out["law"]["maps"]}
    assert by_map["sparsemax"]["threshold"] == 1.0
    assert by_map["entmax a=1.5"]["threshold"] == 2.0
    for m in out["law"]["maps"]:
        assert m["disagreements"] == 0
        assert m["singleton_rate"] == m["frac_gap_ge_threshold"]


def test_demo_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--maps", "--rows", "1000"]) == 0
    text = capsys.readouterr().out
    assert "threshold law" in text and "singleton: gap >= 2" in text


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "bench",
        "maps",
        "--rows",
        "128",
        "--experts",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
    )
    impls = {r["impl"] for r in out["rows"]}
    assert {"torch.softmax", "moelab.sparsemax", "moelab.lapsum(k=2)"} <= impls
    for row in out["rows"]:
        assert set(row) >= {"impl", "shape", "pass", "ms", "ratio"}
        assert row["shape"] == "128x8" and row["pass"] in ("fwd", "fwdbwd")


def test_help_mentions_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "bench" in text and "demo" in text
