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
from moelab.runs import read_metrics
from moelab.studies import get_study
from moelab.studies.core import arm_config
from moelab.studies.temperature import (
    CLAIMS,
    HELD_CLAIM,
    SCHEDULE,
    START_TAU,
    THEOREM_CLAIM,
    TemperatureStudy,
    checks,
    collect_router_inputs,
    findings,
    gate,
    lipschitz_check,
    sample_pairs,
    schedule_trace,
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
        "Scheduled (L* = 0.3, τ_min = 0.25)",
    ]
    headers = [c["header"] for c in table["columns"]]
    for want in ("PPL", "load CV", "drop (tokens)", "drop (slots)", "τ", "‖W‖₂"):
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
        ppl, cv, drop, drop_tokens = [], [], [], []
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
            drop_tokens.append(statistics.mean(lay["dropped_tokens"] for lay in st["layers"]))
        row = rows[label]
        _check_cell(row["ppl"], ppl)
        if name != "dense":
            _check_cell(row["load_cv"], cv)
            _check_cell(row["dropped"], drop)
            _check_cell(row["dropped_tokens"], drop_tokens)
            if name == "switch":  # top-1: a dropped slot is a dropped token
                assert drop_tokens == pytest.approx(drop, abs=1e-15)
            else:  # top-2: a token is dropped only when both slots are
                assert all(t <= d * 2 for t, d in zip(drop_tokens, drop, strict=True))
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
                (run / "analysis" / f"temperature-v3-{MAX_BATCHES}.json").read_text()
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
        "lipschitz": (2, "lipschitz", START_TAU[scale]),
    }
    for name, (k, schedule, tau) in want.items():
        rc = configs[name].model_config().router_config()
        assert (rc.top_k, rc.schedule, rc.temperature) == (k, schedule, tau)
        assert rc.map == "softmax" and rc.gate_rule == "map" and rc.capacity_factor == 1.25
        assert rc.aux_weight == 0.01
        # the paper's eq. 6 (quick: every slot, grid.common's NOTE)
        assert rc.aux_count == ("all" if scale == "quick" else "top1")
    rc = configs["lipschitz"].model_config().router_config()
    want_schedule = {"quick": (0.3, 0.25), "cpu": (0.1, 0.5), "paper": (4.0, 0.25)}
    assert (rc.lipschitz_target, rc.tau_min) == want_schedule[scale] == SCHEDULE[scale]
    active = {n: param_counts(c.model_config())["active"] for n, c in configs.items()}
    # every MoE arm uses the same parameters per token; dense lacks only the routers
    assert len({active[n] for n in MOE_ARMS}) == 1
    router = param_counts(configs["switch"].model_config())["router"]
    assert active["dense"] == active["switch"] - router


# ------------------------------------------------------------------------- findings

L_STAR, TAU_MIN_QUICK = SCHEDULE["quick"]


def test_lipschitz_tau_moves_at_the_quick_scale(quick):
    """The schedule acts at the quick scale: on every seed the lipschitz arm's tau starts
    at tau_min, leaves it, and then equals ||W||_2 / (2 L*) (metrics.jsonl); the check
    line gives the mean step where it left."""
    out, _ = quick
    left = []
    for s in (0, 1):
        rows = read_metrics(out / "runs" / "lipschitz" / f"seed{s}")
        rows = [r for r in rows if "tau_layers" in r]
        taus = [r["tau_layers"][0] for r in rows]
        assert taus[0] == pytest.approx(TAU_MIN_QUICK)
        assert len(set(taus)) > 1 and max(taus) > TAU_MIN_QUICK + 1e-3
        first = next(r for r in rows if r["tau_layers"][0] > TAU_MIN_QUICK + 1e-6)
        left.append(first["step"])
        last = rows[-1]
        assert last["lipschitz_layers"][0] == pytest.approx(L_STAR, rel=1e-2)
    report = (out / "report.md").read_text()
    want = f"τ left τ_min = {TAU_MIN_QUICK:g} at step {sum(left) / len(left):.0f}"
    assert want in report and "warning" not in report.split("## Findings")[1].split("**")[0]
    # a fixed arm's tau never moves
    rows = read_metrics(out / "runs" / "fixed-0.5" / "seed0")
    assert {r["tau_layers"][0] for r in rows if "tau_layers" in r} == {0.5}


def test_findings_open_the_report_with_every_claim_and_a_verdict(quick):
    out, doc = quick
    study = TemperatureStudy()
    assert doc["reference"] == "switch" == study.reference
    keys = [f["key"] for f in doc["findings"]]
    assert keys == [THEOREM_CLAIM, HELD_CLAIM, *(c.key for c in CLAIMS)] == list(study.claims)
    for f in doc["findings"]:
        assert f["verdict"] in {"holds", "contradicted", "not resolved"}, f["key"]
        assert f["effect"]["n"] == 2
    report = (out / "report.md").read_text()
    assert report.index("## Findings") < report.index("## Perplexity, load")
    table = _table(doc, "findings")
    assert [r["verdict"] for r in table["rows"]] == [f["verdict"] for f in doc["findings"]]
    got = {f["key"]: f for f in doc["findings"]}
    assert got[THEOREM_CLAIM]["verdict"] == "holds" and got[HELD_CLAIM]["verdict"] == "holds"


def test_findings_effects_are_hand_computed_from_the_tables(quick):
    """Each paired finding's per-seed effect is its arm's per-seed cell minus the other
    arm's, from the tables in results.json; the identities from the theorem table and the
    saved per-layer theorem records."""
    out, doc = quick
    labels = {a["name"]: a["label"] for a in doc["arms"]}
    main = {r["arm"]: r for r in _table(doc, "temperature-main")["rows"]}
    theorem = {r["arm"]: r for r in _table(doc, "temperature-theorem")["rows"]}
    got = {f["key"]: f for f in doc["findings"]}
    for c in CLAIMS:
        table = theorem if c.column in ("radius", "lipschitz") else main
        a = table[labels[c.arm]][c.column]["values"]
        b = table[labels[c.against]][c.column]["values"]
        want = [x - y for x, y in zip(a, b, strict=True)]
        assert got[c.key]["effect"]["values"] == pytest.approx(want, abs=1e-12), c.key
    # Theorem 1: the largest ratio over the MoE arms, minus 1, seed by seed
    worst = [max(main[labels[n]]["max_ratio"]["values"][s] for n in MOE_ARMS) - 1 for s in (0, 1)]
    assert got[THEOREM_CLAIM]["effect"]["values"] == pytest.approx(worst)
    # the schedule's L / L* - 1 from the exact norm and tau of the trained routers
    held = []
    for s in (0, 1):
        loaded = load_run(out / "runs" / "lipschitz" / f"seed{s}")
        (router,) = [layer.router for layer in loaded.model.moe_layers]
        tau = router.temperature.value
        assert tau > TAU_MIN_QUICK
        norm = float(torch.linalg.matrix_norm(router.weight.detach().double(), ord=2))
        held.append(norm / (2 * tau) / L_STAR - 1)
    assert got[HELD_CLAIM]["effect"]["values"] == pytest.approx(held, rel=1e-5, abs=1e-9)
    assert all(abs(v) < 0.01 for v in held)


def test_findings_and_checks_follow_made_up_numbers():
    """findings() and checks() on made-up numbers: a router off L* contradicts the
    schedule's identity, one at tau_min leaves it unmeasured; a clear gap decides a
    paired claim; a run whose tau never moved gets a warning."""
    names = ("dense", *MOE_ARMS)
    rows = {
        n: {
            "ppl": [10.0, 11.0, 12.0],
            "dropped": [0.02, 0.03, 0.025],
            "dropped_tokens": [0.01, 0.02, 0.015],
            "lipschitz": [None] * 3 if n == "dense" else [0.5, 0.6, 0.55],
            "load_cv": [0.3, 0.4, 0.35],
            "radius": [0.1, 0.2, 0.15],
            "max_ratio": [None] * 3 if n == "dense" else [0.5, 0.6, 0.7],
        }
        for n in names
    }
    rows["lipschitz"]["ppl"] = [9.0, 10.1, 10.9]  # ~1 lower, every seed
    rows["dense"]["ppl"] = [10.0, 11.0, 12.0]  # identical: a difference of exactly 0
    on = [{"constant": 0.7, "tau": 0.3}, {"constant": 0.7035, "tau": 0.26}]
    got = {f.key: f for f in findings(rows, [on] * 3, 0.7, 0.25)}
    assert got[THEOREM_CLAIM].verdict == "holds"
    assert got[THEOREM_CLAIM].effect.values == pytest.approx((-0.5, -0.4, -0.3))
    assert got[HELD_CLAIM].verdict == "holds"
    assert got[HELD_CLAIM].effect.values == pytest.approx((0.005,) * 3)
    assert got["schedule-lowers-ppl"].verdict == "holds"
    assert got["moe-beats-dense"].verdict == "not resolved"
    off = [{"constant": 0.8, "tau": 0.3}, {"constant": 9.0, "tau": 0.25}]  # at tau_min
    assert {f.key: f for f in findings(rows, [off] * 3, 0.7, 0.25)}[
        HELD_CLAIM
    ].verdict == "contradicted"
    at_min = [{"constant": 9.0, "tau": 0.25}]
    assert {f.key: f for f in findings(rows, [at_min] * 3, 0.7, 0.25)}[
        HELD_CLAIM
    ].verdict == "not measured"
    rows["fixed-0.5"]["max_ratio"] = [1.2, 0.6, 0.7]
    assert {f.key: f for f in findings(rows, [on] * 3, 0.7, 0.25)}[
        THEOREM_CLAIM
    ].verdict == "not resolved"

    def metrics(taus):
        return [
            {"step": 10 * (i + 1), "tau_layers": [t], "lipschitz_layers": [0.5]}
            for i, t in enumerate(taus)
        ]

    moved = schedule_trace(metrics([0.25, 0.25, 0.3, 0.35]), 0.25)
    held = schedule_trace(metrics([0.25] * 4), 0.25)
    assert moved["left"] == 30 and moved["share"] == 0.5 and held["left"] is None
    assert moved["weight_norm"][-1] == [pytest.approx(0.35)]
    lines = checks([moved, schedule_trace(metrics([0.25, 0.3, 0.3, 0.3]), 0.25)], 0.25, 0.7)
    assert lines[0].startswith("τ left τ_min = 0.25 at step 25 ")
    assert not any(line.startswith("warning") for line in lines)
    lines = checks([held, held], 0.25, 0.7)
    assert lines[0].startswith("warning: the schedule held τ at τ_min = 0.25 for the whole run")
    lines = checks([moved, held], 0.25, 0.7)
    assert lines[0].startswith("τ left τ_min = 0.25 at step 30 ")
    assert lines[1].startswith("warning: on seed(s) 1 the schedule held τ at τ_min")


def test_cpu_schedule_from_the_measured_norms():
    """L* below both fixed arms' measured L, tau_min whose crossing lies below the initial
    norm (active from the first update), tau_0 = initial norm / (2 L*): by hand."""
    from moelab.studies.temperature.grid import FIXED_L_CPU, cpu_schedule

    init = 0.02 * (math.sqrt(128) + math.sqrt(8))  # 0.2828
    # 0.65 * min(0.535, 0.159) = 0.10335 -> down to a multiple of 0.025: 0.1
    assert cpu_schedule() == (0.1, 0.5, round(init / 0.2, 2)) == (0.1, 0.5, 1.41)
    assert cpu_schedule() == (*SCHEDULE["cpu"], START_TAU["cpu"])
    assert SCHEDULE["cpu"][0] < min(FIXED_L_CPU.values())
    assert 2 * 0.1 * 0.5 < init
    with pytest.raises(ValueError, match="not below the initial norm"):
        cpu_schedule(init_norm=0.1)
    with pytest.raises(ValueError, match="no L"):
        cpu_schedule({"fixed-2.0": 0.03})


def test_schedule_below_fixed_lipschitz_each_way():
    """The finding that the schedule holds L below the fixed arms': holds on planted runs
    where the lipschitz arm's L is below on every seed, contradicted where it is above."""
    names = ("dense", *MOE_ARMS)
    rows = {
        n: {
            c: [None] * 3 if n == "dense" and c != "ppl" else [0.1, 0.2, 0.15]
            for c in ("ppl", "dropped", "dropped_tokens", "load_cv", "radius", "max_ratio")
        }
        for n in names
    }
    rows["dense"]["ppl"] = [1.0, 2.0, 3.0]
    for n in MOE_ARMS:
        rows[n]["max_ratio"] = [0.5, 0.5, 0.5]
    rows["dense"]["lipschitz"] = [None] * 3
    rows["switch"]["lipschitz"] = [0.25, 0.24, 0.26]
    rows["fixed-0.5"]["lipschitz"] = [0.53, 0.55, 0.52]
    rows["fixed-2.0"]["lipschitz"] = [0.16, 0.15, 0.17]
    on = [{"constant": 0.125, "tau": 1.5}]
    rows["lipschitz"]["lipschitz"] = [0.125, 0.1251, 0.1249]  # held at L* = 0.125
    got = {f.key: f for f in findings(rows, [on] * 3, 0.125, 0.5)}
    for arm, diff in (("fixed-0.5", (-0.405, -0.4249, -0.3951)), ("fixed-2.0", None)):
        f = got[f"schedule-below-{arm}-lipschitz"]
        assert f.verdict == "holds", arm
        if diff:
            assert f.effect.values == pytest.approx(diff)
    rows["lipschitz"]["lipschitz"] = [0.7, 0.7, 0.7]  # the old cpu L* = 0.7: above both
    got = {f.key: f for f in findings(rows, [on] * 3, 0.125, 0.5)}
    for arm in ("fixed-0.5", "fixed-2.0"):
        assert got[f"schedule-below-{arm}-lipschitz"].verdict == "contradicted", arm


def test_every_paired_record_matches_the_values_results_json_holds(quick):
    """moelab.studies.audit.audit: every paired difference (tables and findings) names
    its table, column and two arms and equals their per-seed values' difference; every
    arm's per-seed cell of a table with the reference's row has its paired difference."""
    from moelab.studies.audit import audit

    out, doc = quick
    assert audit(doc) == []
    assert audit(json.loads((out / "results.json").read_text())) == []
