"""Report figures for learned allocation, router temperature and certified radii:
synthetic metrics give readable PNGs; runs without the data give None and no file;
missing keys, None/NaN values, evaluation-only rows and all-zero radii do not crash."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import pytest

from moelab.report.plots import (
    plot_allocation,
    plot_nll_vs_active,
    plot_panels,
    plot_radii,
    temperature_panels,
)

N_LAYERS = 3


def _rows(n: int = 12, *, allocation: bool = True, router: bool = True) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for s in range(1, n + 1):
        row: dict[str, Any] = {"step": s, "tokens": 512 * s, "loss": 3.0 / s}
        if allocation:
            row["k_layers"] = [2.0 + 0.1 * i * math.log(s) for i in range(N_LAYERS)]
            row["active_layers"] = [1.8 + 0.1 * i * math.log(s) for i in range(N_LAYERS)]
        if router:
            row["tau_layers"] = [1.0 / (1 + 0.05 * s * (i + 1)) for i in range(N_LAYERS)]
            row["lipschitz_layers"] = [0.5 * s * (i + 1) for i in range(N_LAYERS)]
        rows.append(row)
        if s % 4 == 0:
            rows.append({"step": s, "val_loss": 2.5})  # evaluation-only row
    return rows


def _messy_rows() -> list[dict[str, Any]]:
    """Rows with None/NaN values, a missing active_layers and evaluation-only rows."""
    rows = _rows()
    rows[0]["k_layers"] = [None, float("nan"), 2.0]
    rows[1]["active_layers"] = [float("nan"), None, None]
    del rows[2]["active_layers"]
    rows[3]["tau_layers"] = [None, None, None]
    rows[4]["lipschitz_layers"] = [float("nan"), 1.0, None]
    rows.insert(0, {"step": 0, "val_loss": 4.0})
    return rows


def _check_png(path: Path | None) -> None:
    assert path is not None and path.is_file()
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100


# --- plot_allocation ------------------------------------------------------------------


def test_allocation_writes_png(tmp_path: Path) -> None:
    runs = [{"label": "lapsum", "metrics": _rows()}, {"label": "lapsum-2", "metrics": _rows(8)}]
    out = plot_allocation(runs, tmp_path / "allocation.png")
    assert out == tmp_path / "allocation.png"
    _check_png(out)


def test_allocation_without_data_returns_none(tmp_path: Path) -> None:
    path = tmp_path / "allocation.png"
    runs = [
        {"label": "topk", "metrics": _rows(allocation=False)},
        {"label": "empty", "metrics": []},
        {"label": "eval-only", "metrics": [{"step": 1, "val_loss": 3.0}]},
        {"label": "no-metrics"},
    ]
    assert plot_allocation(runs, path) is None
    assert plot_allocation([], path) is None
    assert not path.exists()


def test_allocation_messy_and_mixed(tmp_path: Path) -> None:
    runs = [
        {"label": "lapsum", "metrics": _messy_rows()},
        {"label": "topk", "metrics": _rows(allocation=False)},
    ]
    _check_png(plot_allocation(runs, tmp_path / "allocation.png"))
    # k_l present, active experts never logged, and a run whose values are all None
    nones = [{"step": s, "tokens": 100 * s, "k_layers": [None, None]} for s in range(1, 4)]
    runs = [
        {"label": "k-only", "metrics": [{**m, "active_layers": None} for m in _rows()]},
        {"label": "all-none", "metrics": nones},
    ]
    _check_png(plot_allocation(runs, tmp_path / "allocation2.png"))


def test_allocation_many_runs_grid(tmp_path: Path) -> None:
    runs = [{"label": f"run{i}", "metrics": _rows(6)} for i in range(4)]
    _check_png(plot_allocation(runs, tmp_path / "allocation.png"))


# --- temperature panels ---------------------------------------------------------------


def _temperature(runs: list[dict[str, Any]], path: Path) -> Path | None:
    return plot_panels(temperature_panels(runs), path)


def test_temperature_writes_png(tmp_path: Path) -> None:
    runs = [{"label": "a", "metrics": _rows()}, {"label": "b", "metrics": _rows(6)}]
    out = _temperature(runs, tmp_path / "temperature.png")
    assert out == tmp_path / "temperature.png"
    _check_png(out)
    tau, lip = temperature_panels(runs)
    # the panels hold the mean over layers of what was logged, the band its min and max
    rows = [m for m in runs[0]["metrics"] if "tau_layers" in m]
    assert tau.series[0].x == [m["tokens"] for m in rows]
    assert tau.series[0].y == pytest.approx([sum(m["tau_layers"]) / N_LAYERS for m in rows])
    assert tau.series[0].lo is None and lip.series[0].lo == [
        min(m["lipschitz_layers"]) for m in rows
    ]
    assert lip.logy and not tau.logy


def test_temperature_without_data_returns_none(tmp_path: Path) -> None:
    path = tmp_path / "temperature.png"
    runs = [
        {"label": "plain", "metrics": _rows(router=False)},
        {"label": "eval-only", "metrics": [{"step": 1, "val_loss": 3.0}]},
        {"label": "no-metrics"},
    ]
    assert temperature_panels(runs) == []
    assert _temperature(runs, path) is None
    assert not path.exists()


def test_temperature_messy_and_mixed(tmp_path: Path) -> None:
    runs = [
        {"label": "lapsum", "metrics": _messy_rows()},
        {"label": "plain", "metrics": _rows(router=False)},
    ]
    _check_png(_temperature(runs, tmp_path / "temperature.png"))
    # only tau logged (one panel); Lipschitz values with zeros (no log y)
    tau_only = [{k: v for k, v in m.items() if k != "lipschitz_layers"} for m in _rows()]
    zeros = [{**m, "lipschitz_layers": [0.0, 1.0, 2.0]} for m in _rows()]
    runs = [{"label": "tau-only", "metrics": tau_only}, {"label": "zeros", "metrics": zeros}]
    panels = temperature_panels(runs)
    assert [len(p.series) for p in panels] == [2, 1] and not panels[1].logy
    _check_png(_temperature(runs, tmp_path / "temperature2.png"))
    assert len(temperature_panels(runs[:1])) == 1
    _check_png(_temperature(runs[:1], tmp_path / "temperature3.png"))


# --- plot_radii -----------------------------------------------------------------------


def _radii(seed: int, n: int = 2000, zeros: int = 100) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.lognormal(-3.0, 1.0, n), np.zeros(zeros)])


def test_radii_writes_png(tmp_path: Path) -> None:
    runs = [
        {"label": "softmax", "metrics": [], "radii": _radii(0)},
        {"label": "lapsum", "metrics": [], "radii": _radii(1, zeros=0) * 3},
    ]
    out = plot_radii(runs, tmp_path / "radii.png")
    assert out == tmp_path / "radii.png"
    _check_png(out)


def test_radii_without_data_returns_none(tmp_path: Path) -> None:
    path = tmp_path / "radii.png"
    runs = [
        {"label": "absent", "metrics": []},
        {"label": "none", "metrics": [], "radii": None},
        {"label": "empty", "metrics": [], "radii": np.array([])},
    ]
    assert plot_radii(runs, path) is None
    assert plot_radii([], path) is None
    assert not path.exists()


def test_radii_all_zero_and_mixed(tmp_path: Path) -> None:
    runs = [
        {"label": "ties", "metrics": [], "radii": np.zeros(50)},
        {"label": "absent", "metrics": []},
        {"label": "ok", "metrics": [], "radii": _radii(2, n=500, zeros=600)},  # median 0
        {"label": "nan", "metrics": [], "radii": np.array([np.nan, 0.1, 0.2])},
        {"label": "one", "metrics": [], "radii": np.array([0.05])},
    ]
    _check_png(plot_radii(runs, tmp_path / "radii.png"))
    _check_png(plot_radii(runs[:1], tmp_path / "radii_zero.png"))
    _check_png(plot_radii(runs[-1:], tmp_path / "radii_one.png"))


# --- plot_nll_vs_active ---------------------------------------------------------------


def test_nll_vs_active_draws_both_sweeps(tmp_path: Path) -> None:
    k_sweep = {
        "trained_top_k": 2,
        "results": [
            {"top_k": k, "nll": 3.0 + 0.1 / k, "active_experts": float(k)} for k in (1, 2, 4)
        ],
    }
    scale_sweep = {
        "results": [
            {"threshold_scale": sc, "nll": 3.0 + 0.02 * sc, "active_experts": 3.0 / (1 + sc)}
            for sc in (0.5, 1.0, 2.0)
        ]
    }
    runs = [
        {"label": "topk", "sweep": k_sweep},
        {"label": "lapsum", "truncation": scale_sweep},
        {"label": "dense"},
    ]
    _check_png(plot_nll_vs_active(runs, tmp_path / "budget.png"))
    assert plot_nll_vs_active([{"label": "dense"}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_allocation_panel_for_a_fixed_k_truncating_run(tmp_path: Path) -> None:
    fixed = {"label": "softmoe-star", "metrics": _rows(allocation=False), "truncating": True}
    for row in fixed["metrics"]:
        if "tokens" in row:
            row["active_layers"] = [2.1, 1.9, 2.4]
    fixed["budget_k"] = 2.0
    _check_png(plot_allocation([fixed], tmp_path / "fixed.png"))
    # without the truncating mark, active experts alone draw nothing
    plain = {**fixed, "truncating": False}
    assert plot_allocation([plain], tmp_path / "plain.png") is None
