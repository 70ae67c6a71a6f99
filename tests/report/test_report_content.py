"""What the report's figures and tables hold, checked against their sources: the loss
curves against metrics.jsonl, the gap histograms against the gaps (and the tail beyond
the plotted range against a hand count), flat panels left out, no negative zero in any
table, titles that name no marks, and ``report --json`` against summary.json and
``evaluate``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moelab._format import fmt, json_value
from moelab.cli import main
from moelab.diagnostics import evaluate, stats
from moelab.report import build_report, collect_run, plots
from moelab.report import report as report_module
from moelab.report import sections as sections_module
from tests.report.conftest import capture_figures

Figures = dict[str, dict[str, Any]]


def _axes(figures: Figures, name: str) -> list[dict[str, Any]]:
    return figures[name]["axes"]


def _metrics(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# --- 1. loss curves -------------------------------------------------------------------


def test_loss_curves_draw_the_metrics_values(
    runs: list[Path], full_report: tuple[dict[str, Any], Figures]
) -> None:
    doc, figures = full_report
    text = Path(doc["report"]).read_text(encoding="utf-8")
    # the loss figure is the first figure and the first section of report.md
    assert re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)[0] == "loss_curves.png"
    assert text.index("## Training and validation loss") < text.index("## Routing statistics")
    assert Path(doc["files"][0]).name == "loss_curves.png"
    (ax,) = _axes(figures, "loss_curves.png")
    lines = {line["label"]: line for line in ax["lines"]}
    tokenless_val_rows = 0
    for run in runs:
        config = json.loads((run / "config.json").read_text(encoding="utf-8"))
        per_step = config["batch_size"] * config["seq_len"]
        rows = _metrics(run)
        train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
        val = [
            (r.get("tokens", r["step"] * per_step), r["val_loss"]) for r in rows if "val_loss" in r
        ]
        tokenless_val_rows += sum("val_loss" in r and "tokens" not in r for r in rows)
        for name, expected in (("train", train), ("val", val)):
            line = lines[f"{run.name}: {name}"]
            assert line["x"] == [float(t) for t, _ in expected]
            assert line["y"] == pytest.approx([v for _, v in expected], rel=1e-12)
        assert lines[f"{run.name}: val"]["ls"] == "--" and lines[f"{run.name}: train"]["ls"] == "-"
    # the sparsemax fixture evaluates at steps 3 and 9, between logged steps
    assert tokenless_val_rows == 2


def test_loss_curves_place_rows_and_skip_bad_values() -> None:
    rows = [
        {"step": 0, "calibrated_thresholds": [1.0]},
        {"step": 0, "val_loss": 9.0},  # before training: 0 tokens, not on a log axis
        {"step": 2, "tokens": 64, "loss": 5.0},
        {"step": 3, "val_loss": 4.5},
        {"step": 4, "tokens": 128, "loss": float("nan"), "val_loss": 4.0},
        {"step": 5, "loss": None},
    ]
    curves = plots.loss_curves(rows, 32)
    assert curves == {"train": ([64.0], [5.0]), "val": ([96.0, 128.0], [4.5, 4.0])}
    # without a token count per step, a row without tokens cannot be placed
    assert plots.loss_curves(rows, None)["val"] == ([128.0], [4.0])
    assert plots.loss_panel([{"label": "a", "metrics": rows[:2]}]) is None


# --- 2. gap histograms ----------------------------------------------------------------


def _gap_run(label: str, layers: list[np.ndarray], blocks: list[int], threshold: float | None):
    return {
        "label": label,
        "gap_layers": layers,
        "gap_blocks": blocks,
        "n_blocks": 4,
        "threshold": threshold,
    }


def test_gap_tail_is_counted_in_the_legend_not_stacked(tmp_path: Path) -> None:
    # run a: 198 gaps of 0.5 and 2 of 10 (threshold 1); run b: 200 gaps of 0.2. The 99th
    # percentile of all 400 gaps is 0.5, below 1.1 x the threshold 1: the range is [0, 1.1]
    # rounded up to 1.2, and exactly 2 of a's 200 gaps (1.0%) lie beyond it.
    a = np.array([0.5] * 198 + [10.0, 10.0])
    b = np.full(200, 0.2)
    hist = plots.gap_histograms(
        [_gap_run("a", [a], [1], 1.0), {"label": "dense"}, _gap_run("b", [b], [1], None)]
    )
    assert hist is not None and hist["hi"] == 1.2
    (panel,) = hist["panels"]
    sa, sb = panel["series"]
    assert sa["tail_frac"] == 2 / 200 and sb["tail_frac"] == 0.0
    assert sa["above_threshold_frac"] == 2 / 200
    assert sa["legend"] == "a (1.0% \u2265 1; 1.0% > 1.2)" and sb["legend"] == "b (0.0% > 1.2)"
    # the tail is not in the last bin: the bins hold exactly the gaps within the range
    assert sa["percent"][-1] == 0.0 and sum(sa["percent"]) == pytest.approx(99.0)
    assert sum(sb["percent"]) == pytest.approx(100.0)
    assert panel["thresholds"] == [(1.0, ["a"])]
    # the figure draws exactly this data, with its legend
    with capture_figures() as figures:
        plots.plot_gap_histograms(hist, tmp_path / "gaps.png")
    (ax,) = _axes(figures, "gaps.png")
    assert [s["values"] for s in ax["stairs"]] == [sa["percent"], sb["percent"]]
    assert ax["legend"] == [sa["legend"], sb["legend"], "threshold 1: a"]
    assert (tmp_path / "gaps.png").is_file()


def test_gap_panels_per_layer_or_by_depth() -> None:
    rng = np.random.default_rng(0)

    def g() -> np.ndarray:
        return rng.exponential(0.5, 100)

    same = [_gap_run(x, [g(), g()], [1, 3], None) for x in ("a", "b")]
    hist = plots.gap_histograms(same)
    assert hist is not None
    assert [p["title"] for p in hist["panels"]] == [
        "MoE layer 0 (block 1)",
        "MoE layer 1 (block 3)",
    ]
    assert all(s["n"] == 100 for p in hist["panels"] for s in p["series"])
    # one run with one MoE layer in block 1, one with MoE layers in all four blocks
    mixed = [
        _gap_run("one", [g()], [1], None),
        _gap_run("all", [g() for _ in range(4)], [0, 1, 2, 3], None),
    ]
    hist = plots.gap_histograms(mixed)
    assert hist is not None
    titles = [p["title"] for p in hist["panels"]]
    assert titles == [f"MoE layers at depth {25 * i}-{25 * (i + 1)}%" for i in range(4)]
    members = [[(s["label"], s["blocks"]) for s in p["series"]] for p in hist["panels"]]
    assert members == [[("all", [0])], [("one", [1]), ("all", [1])], [("all", [2])], [("all", [3])]]
    assert hist["panels"][1]["series"][0]["legend"].startswith("one, block 1 (")
    # more MoE layers than panels: groups of layers by depth
    many = [_gap_run("m", [g() for _ in range(8)], list(range(8)), None)]
    many[0]["n_blocks"] = 8
    hist = plots.gap_histograms(many)
    assert hist is not None
    assert [s["blocks"] for p in hist["panels"] for s in p["series"]] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert plots.gap_histograms([{"label": "dense"}]) is None


def test_report_gaps_are_those_of_the_stats_pass(
    runs: list[Path], full_report: tuple[dict[str, Any], Figures]
) -> None:
    lapsum = runs[2]
    d = collect_run(lapsum, top_ks=(), max_batches=1, threshold_scales=())
    assert d["gap_blocks"] == [0, 1] and len(d["gap_layers"]) == 2
    # every MoE layer sees every validation token of the batch (4 x 32)
    assert [len(g) for g in d["gap_layers"]] == [128, 128]
    pooled = stats(lapsum, max_batches=1, gaps=True)["gaps"]
    np.testing.assert_array_equal(np.sort(np.concatenate(d["gap_layers"])), np.sort(pooled))
    # in the report: two depth panels, each run's histogram plus its tail is all its gaps
    _, figures = full_report
    axes = _axes(figures, "gaps.png")
    assert [ax["title"] for ax in axes] == [
        "MoE layers at depth 0-50%",
        "MoE layers at depth 50-100%",
    ]
    assert axes[0]["stairs"][0]["label"].startswith("lapsum, block 0 (")
    for ax in axes:
        for s in ax["stairs"]:
            tail = float(re.search(r"([\d.]+)% > ", s["label"]).group(1))
            assert sum(s["values"]) + tail == pytest.approx(100.0, abs=0.06)
    assert "threshold 1: sparsemax" in axes[1]["legend"]


# --- 3. flat panels, negative zero, titles --------------------------------------------


@pytest.fixture(scope="module")
def fixed_tau_report(runs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The report of the softmax and sparsemax runs (both at a fixed tau = 1, one MoE
    layer, top-2), with tiny negative values put into its tables."""
    collect = report_module.collect_run

    def with_negatives(*args: Any, **kwargs: Any) -> dict[str, Any]:
        d = collect(*args, **kwargs)
        d["row"]["discarded_mass"] = -3e-7  # .4f
        d["row"]["gap_p50"] = -1e-5  # .3f
        d["row"]["tau"] = -0.0  # .3g
        d["layers"][0]["contrib_sd"] = -2e-9  # .4f, per-layer table
        d["sweep"]["nll_increase"] = -4e-6  # +.4f
        return d

    with pytest.MonkeyPatch.context() as mp, capture_figures() as figures:
        mp.setattr(report_module, "collect_run", with_negatives)
        out = tmp_path_factory.mktemp("fixed") / "rep"
        doc = build_report(runs[:2], out, top_ks=(1, 2), max_batches=1)
    yield doc, figures


def _cells(text: str) -> list[str]:
    """Every cell of the Markdown and LaTeX tables in ``text``."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells += [c.strip() for c in line.strip("|").split("|")]
        elif " & " in line:
            cells += [c.strip() for c in line.removesuffix(r"\\").split(" & ")]
    return cells


def _is_negative_zero(cell: str) -> bool:
    try:
        return cell.startswith("-") and float(cell) == 0.0
    except ValueError:
        return False


def test_no_negative_zero_in_tables(fixed_tau_report: Any) -> None:
    doc, _ = fixed_tau_report
    md = Path(doc["report"]).read_text(encoding="utf-8")
    tex = Path(doc["latex"]).read_text(encoding="utf-8")
    for text in (md, tex):
        cells = _cells(text)
        assert len(cells) > 100
        assert not [c for c in cells if _is_negative_zero(c)]
        assert "-0.0000" not in text
    # the values are there, as zeros, in both formats
    assert "| softmax | softmax | - | 2 | " in md and "| 0.0000 | 2.000 |" in md
    assert "+0.0000" in md and "+0.0000" in tex
    # the JSON tables keep the unrounded value
    assert doc["tables"]["routing"][0]["discarded mass"] == -3e-7
    assert [fmt(v, s) for v, s in ((-3e-7, ".4f"), (-4e-6, "+.4f"), (-0.0, ".3g"))] == [
        "0.0000",
        "+0.0000",
        "0",
    ]
    assert fmt(-0.25, ".1f") == "-0.2" and fmt(-1e-20, "g") == "-1e-20"


def test_flat_panels_are_left_out_and_stated(fixed_tau_report: Any) -> None:
    doc, figures = fixed_tau_report
    md = Path(doc["report"]).read_text(encoding="utf-8")
    # both runs hold tau = 1: no temperature panel, a sentence instead
    titles = [ax["title"] for ax in _axes(figures, "temperature.png")]
    assert titles == ["Gate Lipschitz constant ||W||_2 / (2 tau)"]
    assert "The router temperature tau is 1 for every run at every logged step" in md
    # top-2 routing: 2 active experts at every step of both runs
    titles = [ax["title"] for ax in _axes(figures, "training_curves.png")]
    assert titles == ["Discarded mass during training"]
    assert "The number of active experts per token is 2 for every run" in md
    # one MoE layer per run: no band to draw, and none mentioned
    assert all(ax["bands"] == 0 for ax in _axes(figures, "temperature.png"))
    assert "band" not in md and "band" not in " ".join(
        _axes(figures, "temperature.png")[0]["legend"]
    )
    # every drawn line varies (a constant series is a flat line)
    for name in ("temperature.png", "training_curves.png"):
        for ax in _axes(figures, name):
            assert any(max(line["y"]) > min(line["y"]) for line in ax["lines"])


def test_flat_panel_rule() -> None:
    flat = plots.Series("a", [1.0, 2.0], [1.0, 1.0 + 1e-9])
    assert flat.flat and not plots.Series("b", [1.0, 2.0], [1.0, 1.1]).flat
    band = plots.Series("c", [1.0, 2.0], [1.0, 1.0], lo=[0.5, 0.5], hi=[1.5, 1.5])
    assert not band.flat and band.has_band
    panel = plots.Panel("t", "y", "the thing", [flat, plots.Series("d", [1.0], [2.0])])
    assert panel.flat and panel.constants() == {"a": 1.0, "d": 2.0}
    assert sections_module._panel_note(panel) == (
        "The thing stays constant in every run (1 (a), 2 (d)), so its panel is left out."
    )


MARK_WORDS = re.compile(r"\b(rings?|circles?|squares?|dash\w*|dot\w*|solid|bands?|lines?)\b")


def test_titles_name_no_marks_and_legends_match_marks(
    full_report: tuple[dict[str, Any], Figures], fixed_tau_report: Any
) -> None:
    for _, figures in (full_report, fixed_tau_report):
        for name, fig in figures.items():
            titles = [fig["suptitle"], *(ax["title"] for ax in fig["axes"])]
            for title in titles:
                assert not MARK_WORDS.search(title.lower()), (name, title)
    # rings and squares appear in a legend exactly when drawn
    for _, figures in (full_report, fixed_tau_report):
        for name in ("loss_vs_k.png", "nll_vs_active.png"):
            (ax,) = _axes(figures, name)
            rings = [ln for ln in ax["lines"] if ln["ms"] >= 11 and ln["mfc"] == "none" and ln["x"]]
            squares = [ln for ln in ax["lines"] if ln["marker"] == "s" and ln["x"]]
            assert bool(rings) == any(t.startswith("trained") for t in ax["legend"])
            assert bool(squares) == any("threshold scale" in t for t in ax["legend"])
    # a band (min to max over layers) is named in the legend and report.md when drawn
    for doc, figures in (full_report, fixed_tau_report):
        md = Path(doc["report"]).read_text(encoding="utf-8")
        axes = _axes(figures, "temperature.png")
        drawn = any(ax["bands"] for ax in axes)
        assert drawn == ("band" in md) == any("band" in t for ax in axes for t in ax["legend"])
    assert any(ax["bands"] for ax in _axes(full_report[1], "temperature.png"))
    # the full report has a truncating run (squares); the fixed-tau one does not
    (ax,) = _axes(full_report[1], "nll_vs_active.png")
    assert "lapsum (threshold scale)" in ax["legend"]
    (ax,) = _axes(fixed_tau_report[1], "nll_vs_active.png")
    assert ax["legend"] == ["softmax (K)", "sparsemax (K)", "trained budget"]


# --- 4. report --json -----------------------------------------------------------------


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_report_json_has_the_tables(
    runs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collect = report_module.collect_run

    def with_non_finite(*args: Any, **kwargs: Any) -> dict[str, Any]:
        d = collect(*args, **kwargs)
        if d["sweep"]:
            d["sweep"]["nll_increase"] = float("inf")
        d["row"]["contrib_sd"] = float("nan")
        return d

    monkeypatch.setattr(report_module, "collect_run", with_non_finite)
    out = tmp_path / "cli"
    sparsemax, lapsum = runs[1], runs[2]
    argv = ["report", str(sparsemax), str(lapsum), "--out", str(out), "--max-batches", "1"]
    assert main([*argv, "--top-k", "1", "2", "--json"]) == 0
    doc = _strict(capsys.readouterr().out)
    assert set(doc) == {"report", "files", "latex", "tables"}
    assert Path(doc["report"]) == out / "report.md" and Path(doc["latex"]).is_file()
    assert all(Path(f).is_file() for f in doc["files"])
    tables = doc["tables"]
    assert set(tables) == {
        "routing",
        "layers",
        "budget_sweep",
        "truncation_sweep",
        "gaps",
        "certification",
        "lapsum",
        "active_experts",
    }
    md = Path(doc["report"]).read_text(encoding="utf-8")
    # the keys are the column headers of report.md's tables
    header = next(line for line in md.splitlines() if line.startswith("| run | map | alpha"))
    assert list(tables["routing"][0]) == [
        h.strip().replace("\\|", "|") for h in header.strip("|").split(" | ")
    ]
    routing = {r["run"]: r for r in tables["routing"]}
    for run in (sparsemax, lapsum):
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
        assert routing[run.name]["val loss"] == summary["val_loss"]
        assert routing[run.name]["contrib SD"] is None  # NaN
    assert routing["lapsum"]["K"] is None and routing["sparsemax"]["K"] == 2
    # the budget sweep's numbers are evaluate's, unrounded
    sweep = {r["run"]: r for r in tables["budget_sweep"]}
    reference = evaluate(sparsemax, [1, 2], max_batches=1)["results"]
    assert [sweep["sparsemax"][f"NLL K={x['top_k']}"] for x in reference] == [
        x["nll"] for x in reference
    ]
    assert sweep["sparsemax"]["increase trained K -> max K"] is None  # inf
    assert sweep["lapsum"]["trained K"] is None
    assert [r["layer"] for r in tables["lapsum"]] == [0, 1]
    assert sum(r["k_l"] for r in tables["lapsum"]) == pytest.approx(3.0, abs=2e-3)
    assert [(r["run"], r["layer"]) for r in tables["layers"]] == [
        ("sparsemax", 0),
        ("lapsum", 0),
        ("lapsum", 1),
    ]
    gaps = {r["run"]: r for r in tables["gaps"]}
    assert gaps["sparsemax"]["singleton %"] == gaps["sparsemax"]["gaps >= threshold %"]
    assert math.isfinite(tables["certification"][0]["radius p50"])


def test_json_value_is_strict() -> None:
    doc = {
        "nan": np.float32("nan"),
        "array": np.arange(3),
        "tensor": torch.tensor(2.5),
        "list": [np.inf, -math.inf, 1, "x", None],
        "int": np.int64(3),
    }
    text = json.dumps(json_value(doc), allow_nan=False)
    assert _strict(text) == {
        "nan": None,
        "array": [0, 1, 2],
        "tensor": 2.5,
        "list": [None, None, 1, "x", None],
        "int": 3,
    }
