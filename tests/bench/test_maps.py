"""Smoke test of the map speed benchmark (no timing assertions)."""

from __future__ import annotations

import importlib.util

from moelab.bench.maps import format_table, run

MOELAB_IMPLS = [
    "torch.softmax",
    "moelab.softmax",
    "moelab.sigmoid",
    "moelab.relu",
    "moelab.sqrtsoftplus",
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


def test_result_says_where_it_ran() -> None:
    from moelab import maps

    result = run(rows=32, experts=(8, 128), repeats=1, warmup=0, progress=False)
    machine = result["machine"]
    assert machine["cpu"]
    assert set(machine["paths"]) == {"8", "128"}
    table = format_table(result)
    assert f"cpu: {machine['cpu']}" in table
    if maps.backend() == "cpu-kernels":
        assert machine["isa"] and machine["march"]
        assert f"-march={machine['march']}, {machine['isa']} code" in table
        assert "E=128: sparsemax row" in table
    else:
        assert "kernels: not in use" in table


def test_march_of_another_build_runs_in_a_subprocess(monkeypatch) -> None:
    import moelab.bench.maps as bench
    from moelab import maps

    given: list[dict] = []
    monkeypatch.setattr(maps, "kernel_target", lambda march: False)
    monkeypatch.setattr(bench, "_run_in_subprocess", lambda g: given.append(g) or {"rows": []})
    assert bench.run(rows=16, experts=(4,), progress=False, march="x86-64-v3") == {"rows": []}
    assert given[0]["march"] == "x86-64-v3" and given[0]["experts"] == [4]


def test_march_the_kernels_do_not_run_for_is_refused(monkeypatch) -> None:
    import pytest

    import moelab.bench.maps as bench
    from moelab import maps

    monkeypatch.setattr(maps, "kernel_target", lambda march: True)
    monkeypatch.setattr(maps, "kernel_build_info", lambda: {"march": None})
    with pytest.raises(ValueError, match="not in use for -march=x86-64-v3"):
        bench.run(rows=16, experts=(4,), progress=False, march="x86-64-v3")


def test_progress_without_a_terminal_is_plain_lines(capsys) -> None:
    # stderr captured (not a terminal): one line per map and E, no \r redraws
    run(rows=16, experts=(4,), repeats=1, warmup=0, progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bench maps: [")]
    assert "\r" not in err
    assert lines[0].startswith("bench maps: [1/") and "E=4 torch.softmax" in lines[0]
    total = int(lines[0].split("/")[1].split("]")[0])
    assert len(lines) == total and lines[-1].startswith(f"bench maps: [{total}/{total}]")
