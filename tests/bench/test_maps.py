"""Smoke test of the map speed benchmark (no timing assertions)."""

from __future__ import annotations

import importlib.util

from moelab.bench.maps import format_table, run

MOELAB_IMPLS = [
    "torch.softmax",
    "moelab.softmax",
    "moelab.sigmoid",
    "moelab.relu",
    "moelab.sparsemax",
    "moelab.entmax15",
    "moelab.entmax(1.3)",
    "moelab.normmax2",
    "moelab.normmax(3)",
    "moelab.lapsum(k=2)",
]
ENTMAX_IMPLS = [
    "entmax.sparsemax",
    "entmax.sparsemax_bisect",
    "entmax.entmax15",
    "entmax.entmax_bisect(1.5)",
    "entmax.entmax_bisect(1.3)",
    "entmax.normmax_bisect(2)",
    "entmax.normmax_bisect(3)",
]


def test_run_and_format_table() -> None:
    result = run(rows=64, experts=(4, 8), repeats=1, warmup=0, progress=False)
    has_entmax = importlib.util.find_spec("entmax") is not None
    expected = set(MOELAB_IMPLS) | (set(ENTMAX_IMPLS) if has_entmax else set())

    rows = result["rows"]
    got = {(r["impl"], r["shape"], r["pass"]) for r in rows}
    want = {(i, s, p) for i in expected for s in ("64x4", "64x8") for p in ("fwd", "fwdbwd")}
    assert got == want
    assert len(rows) == len(want)
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["impl"] == "torch.softmax")
    if not has_entmax:
        assert any("entmax" in n for n in result["notes"])
    assert isinstance(result["threads"], int)
    assert result["backend"] in ("cpu-kernels", "torch")

    table = format_table(result)
    assert "moelab.sparsemax" in table
    assert "E=8 fwd+bwd" in table


def test_run_without_entmax_package(monkeypatch) -> None:
    import moelab.bench.maps as bench

    monkeypatch.setattr(bench, "_import_entmax", lambda: None)
    result = bench.run(rows=16, experts=(2,), repeats=1, warmup=0, progress=False)
    impls = {r["impl"] for r in result["rows"]}
    assert impls == set(MOELAB_IMPLS) - {"moelab.lapsum(k=2)"}  # lapsum needs E > 2
    assert any("entmax package" in n for n in result["notes"])
    assert any("lapsum" in n for n in result["notes"])
