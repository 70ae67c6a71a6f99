"""The temperature study at the quick scale (through ``moelab study``), its mean ± sd
cells against hand computations on per-seed values measured again, and the numerical
check of the paper's theorem (it holds on the trained routers and catches a wrong
constant)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics

import pytest
import torch

from moelab.cli import main
from moelab.data import batches
from moelab.diagnostics import load_run, stats
from moelab.model.config import param_counts
from moelab.studies import get_study
from moelab.studies._core import arm_config
from moelab.studies.temperature import (
    collect_router_inputs,
    gate,
    lipschitz_check,
    sample_pairs,
)
from tests.train import make_corpus

ARMS = ("dense", "switch", "fixed-0.5", "fixed-2.0", "lipschitz")
MOE_ARMS = ARMS[1:]
MAX_BATCHES = 2  # the quick scale's own


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("temperature")
    corpus = make_corpus(root / "corpus", n_docs=20, sentences=6)
    out = root / "out"
    argv = ["study", "temperature", "--scale", "quick", "--seeds", "2", "--threads", "1"]
    argv += ["--data", str(corpus), "--out", str(out), "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    assert code == 0
    doc = json.loads(buf.getvalue())
    return out, doc


def _table(doc, key):
    (table,) = [t for t in doc["tables"] if t["key"] == key]
    return table


def _val_batches(loaded):
    cfg = loaded.config
    return batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )


def _check_cell(cell, per_seed):
    """A mean ± sd cell against statistics.mean / stdev of values measured apart."""
    assert cell["mean"] == pytest.approx(statistics.mean(per_seed), rel=1e-6)
    assert cell["sd"] == pytest.approx(statistics.stdev(per_seed), rel=1e-5, abs=1e-12)


def test_quick_study_has_the_arms_columns_and_figures(quick):
    out, doc = quick
    assert doc["seeds"] == [0, 1]
    assert [a["name"] for a in doc["arms"]] == list(ARMS)
    table = _table(doc, "temperature-main")
    labels = [r["arm"] for r in table["rows"]]
    assert labels == [
        "Dense",
        "Switch, top-1",
        "Fixed τ = 0.5",
        "Fixed τ = 2.0",
        "Scheduled (L* = 4, τ_min = 0.25)",
    ]
    headers = [c["header"] for c in table["columns"]]
    for want in ("PPL", "load CV", "drop", "τ", "‖W‖₂"):
        assert want in headers
    assert any(h.startswith("max ‖Δg‖") for h in headers)
    # dense has no router: no routing cells
    dense = table["rows"][0]
    assert dense["load_cv"]["mean"] is None and dense["max_ratio"]["mean"] is None
    theorem = _table(doc, "temperature-theorem")
    assert [r["arm"] for r in theorem["rows"]] == labels[1:]
    for name in ("val-ppl", "load-share", "radii", "tau-norm"):
        assert (out / f"temperature-{name}.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "mean ± sd" in report and "Theorem 1" in report


def test_cells_are_mean_and_sd_of_values_measured_again(quick):
    """PPL, load CV and drop per seed measured again with the library's stats (and, for
    the dense arm, a forward pass of our own), then averaged by hand."""
    out, doc = quick
    rows = {r["arm"]: r for r in _table(doc, "temperature-main")["rows"]}
    labels = [a["label"] for a in doc["arms"]]
    for name, label in zip(ARMS, labels, strict=True):
        ppl, cv, drop = [], [], []
        for s in (0, 1):
            run = out / "runs" / name / f"seed{s}"
            if name == "dense":
                loaded = load_run(run)
                total, n = 0.0, 0
                with torch.no_grad():
                    for i, (x, y) in enumerate(_val_batches(loaded)):
                        if i == MAX_BATCHES:
                            break
                        targets = int((y != -100).sum())
                        total += float(loaded.model(x, y).loss) * targets
                        n += targets
                ppl.append(math.exp(total / n))
                continue
            st = stats(run, max_batches=MAX_BATCHES)
            ppl.append(math.exp(st["nll"]))
            cv.append(statistics.mean(lay["nominal_cv"] for lay in st["layers"]))
            drop.append(statistics.mean(lay["dropped_fraction"] for lay in st["layers"]))
        row = rows[label]
        _check_cell(row["ppl"], ppl)
        if name != "dense":
            _check_cell(row["load_cv"], cv)
            _check_cell(row["dropped"], drop)
    # the capacity limit drops slots at the quick scale, so the drop column is exercised
    assert any(rows[label]["dropped"]["mean"] > 0 for label in labels[1:])


def test_theorem_holds_on_the_quick_runs_and_a_wrong_constant_fails(quick):
    out, doc = quick
    rows = {r["arm"]: r for r in _table(doc, "temperature-main")["rows"]}
    for name, arm in zip(ARMS, doc["arms"], strict=True):
        if name == "dense":
            continue
        saved_max = []
        for s in (0, 1):
            run = out / "runs" / name / f"seed{s}"
            saved = json.loads(
                (run / "analysis" / f"temperature-v2-{MAX_BATCHES}.json").read_text()
            )
            saved_max.append(saved["value"]["max_ratio"])
            loaded = load_run(run)
            inputs, _, _ = collect_router_inputs(loaded.model, _val_batches(loaded), MAX_BATCHES)
            for i, (layer, x) in enumerate(zip(loaded.model.moe_layers, inputs, strict=True)):
                w, tau = layer.router.weight, layer.router.temperature.value
                pairs = sample_pairs(x, seed=i)
                res = lipschitz_check(x, w, tau, pairs)
                assert res["violations"] == 0 and 0 < res["max_ratio"] <= 1.0
                assert res["max_ratio"] == pytest.approx(saved["value"]["theorem"][i]["max_ratio"])
                assert res["constant"] == pytest.approx(
                    float(torch.linalg.matrix_norm(w.detach().double(), ord=2)) / (2 * tau)
                )
                # a constant half the largest ratio seen is exceeded on the same pairs
                wrong = lipschitz_check(
                    x, w, tau, pairs, constant=res["constant"] * res["max_ratio"] / 2
                )
                assert wrong["violations"] > 0
                assert wrong["max_ratio"] == pytest.approx(2.0)
        _check_cell(rows[arm["label"]]["max_ratio"], saved_max)


def test_lipschitz_check_against_a_hand_computation():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    tau = 0.7
    pairs = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4]])
    res = lipschitz_check(x, w, tau, pairs)
    sigma = torch.linalg.svdvals(w)[0].item()
    ratios = []
    for a, b in pairs.tolist():
        za, zb = (w @ x[a] / tau).tolist(), (w @ x[b] / tau).tolist()
        ga = [math.exp(v) / sum(math.exp(u) for u in za) for v in za]
        gb = [math.exp(v) / sum(math.exp(u) for u in zb) for v in zb]
        dg = math.sqrt(sum((p - q) ** 2 for p, q in zip(ga, gb, strict=True)))
        dx = math.dist(x[a].tolist(), x[b].tolist())
        ratios.append(dg / (sigma / (2 * tau) * dx))
    assert res["max_ratio"] == pytest.approx(max(ratios), rel=1e-12)
    assert res["median_ratio"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    assert res["constant"] == pytest.approx(sigma / (2 * tau), rel=1e-12)
    assert res["pairs"] == 4 and res["violations"] == 0
    assert torch.allclose(gate(x, w, tau).sum(-1), torch.ones(6, dtype=torch.float64))


def test_the_bound_is_tight_for_two_experts_so_a_smaller_constant_fails():
    """E = 2, W = [[w, 0], [-w, 0]]: near x = 0 the gate's slope is exactly
    ||W||_2 / (2 tau), so the ratio approaches 1 and 0.9 times the constant is exceeded."""
    w, tau, eps = 3.0, 0.5, 1e-4
    weight = torch.tensor([[w, 0.0], [-w, 0.0]], dtype=torch.float64)
    x = torch.tensor([[eps, 0.0], [-eps, 0.0], [5.0, 1.0], [5.0 + eps, 1.0]], dtype=torch.float64)
    pairs = torch.tensor([[0, 1], [2, 3]])
    res = lipschitz_check(x, weight, tau, pairs)
    assert res["violations"] == 0
    assert res["max_ratio"] == pytest.approx(1.0, abs=1e-6)
    wrong = lipschitz_check(x, weight, tau, pairs, constant=0.9 * res["constant"])
    assert wrong["violations"] == 1  # the pair at the tie; the saturated pair is far below


def test_sample_pairs_are_distinct_and_include_nearest_neighbours():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [3.2, 0.0]])
    pairs = sample_pairs(x, n_random=50, n_neighbours=5, seed=0)
    d = (x[pairs[:, 0]] - x[pairs[:, 1]]).norm(dim=-1)
    assert (d > 0).all()  # the identical rows 0 and 1 are never paired
    assert [3, 4] in pairs.tolist() and [4, 3] in pairs.tolist()  # nearest neighbours
    with pytest.raises(ValueError, match="at least 2"):
        sample_pairs(x[:1])
    with pytest.raises(ValueError, match="no pair"):
        lipschitz_check(x, torch.eye(2), 1.0, torch.zeros(0, 2, dtype=torch.long))


@pytest.mark.parametrize("scale", ["quick", "cpu", "paper"])
def test_arms_route_as_the_paper_with_equal_active_parameters(scale, tmp_path):
    study = get_study("temperature")
    common = study.common(scale)
    configs = {a.name: arm_config(common, a, 0, tmp_path / a.name) for a in study.arms(scale, {})}
    assert list(configs) == list(ARMS)
    assert configs["dense"].model_config().moe_indices == []
    want = {
        "switch": (1, "fixed", 1.0),
        "fixed-0.5": (2, "fixed", 0.5),
        "fixed-2.0": (2, "fixed", 2.0),
        "lipschitz": (2, "lipschitz", 1.0),
    }
    for name, (k, schedule, tau) in want.items():
        rc = configs[name].model_config().router_config()
        assert (rc.top_k, rc.schedule, rc.temperature) == (k, schedule, tau)
        assert rc.map == "softmax" and rc.gate_rule == "map" and rc.capacity_factor == 1.25
        assert rc.aux_weight == 0.01
    rc = configs["lipschitz"].model_config().router_config()
    assert (rc.lipschitz_target, rc.tau_min) == (4.0, 0.25)
    active = {n: param_counts(c.model_config())["active"] for n, c in configs.items()}
    # every MoE arm uses the same parameters per token; dense lacks only the routers
    assert len({active[n] for n in MOE_ARMS}) == 1
    router = param_counts(configs["switch"].model_config())["router"]
    assert active["dense"] == active["switch"] - router
