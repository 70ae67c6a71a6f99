"""Smoke test of the compiled-vs-eager benchmark of the maps' PyTorch path (no timing
assertions; the tracing backend aot_eager, which compiles in seconds)."""

from __future__ import annotations

import pytest

from moelab.bench.maps_compile import GENERAL, IMPLEMENTATIONS, format_table, run


def test_run_and_format_table() -> None:
    result = run(
        rows=32,
        experts=(2, 4),
        repeats=1,
        warmup=0,
        backend="aot_eager",
        names=["moelab.sparsemax", "moelab.lapsum(k=2)"],
        progress=False,
    )
    got = {(r["impl"], r["shape"]) for r in result["rows"]}
    assert got == {
        ("torch.softmax", "32x2"),
        ("moelab.sparsemax", "32x2"),
        ("torch.softmax", "32x4"),
        ("moelab.sparsemax", "32x4"),
        ("moelab.lapsum(k=2)", "32x4"),
    }
    assert not [n for n in result["notes"] if "did not compile" in n]
    for r in result["rows"]:
        assert r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] > 0
    assert result["device"] == "cpu" and result["backend"] == "aot_eager"
    table = format_table(result)
    assert "moelab.lapsum(k=2)" in table and "speedup" in table


def test_names_are_checked() -> None:
    assert "moelab.entmax(1.3)" in GENERAL and "torch.softmax" in IMPLEMENTATIONS
    with pytest.raises(ValueError, match="unknown map names"):
        run(rows=8, experts=(4,), names=["sparsemax"], progress=False)
