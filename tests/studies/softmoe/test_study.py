"""The softmoe study at the quick scale: its arms train, its tables hold the arms and the
columns of the paper's Tables 1, 5, 6, 7 and 8, and every mean ± sd cell equals a hand
computation on per-seed values read back from the run folders (metrics.jsonl,
summary.json, a fresh moelab.diagnostics pass)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from moelab.cli import main
from moelab.diagnostics import evaluate_truncation, load_run
from moelab.studies import run_study
from moelab.studies.softmoe import (
    FIXED_TAUS,
    INFER_SCALES,
    JITTER,
    SoftMoEStudy,
    k_layer_series,
    load_relative_variance,
    train_ae,
)
from tests.train import make_corpus

MAIN = [
    "sparse-k1",
    "sparse-k2",
    "softmoe-star-k1.5",
    "softmoe-k1.5",
    "sparse-k4",
    "softmoe-star",
    "softmoe",
    "softmoe-star-k2-a4",
    "softmoe-k2-a4",
]
ARMS = [
    *MAIN,
    *(f"softmoe-star-tau{t:g}" for t in FIXED_TAUS),
    "sparse-k1-jitter",
    "sparse-k2-jitter",
]
LEARNED = ["softmoe-k1.5", "softmoe", "softmoe-k2-a4"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("softmoe")
    corpus = make_corpus(root / "corpus", n_docs=40, sentences=10)
    out = root / "out"
    doc = run_study("softmoe", out, scale="quick", seeds=2, data=str(corpus), progress=False)
    return out, corpus, doc


def _table(doc, key):
    (table,) = [t for t in doc["tables"] if t["key"] == key]
    return table


def _rows(table):
    return {row["arm"]: row for row in table["rows"]}


def _check_cell(cell, per_seed, rel=1e-9):
    """A mean ± sd cell against statistics.mean / statistics.stdev of ``per_seed``."""
    assert cell["values"] == pytest.approx(per_seed, rel=rel)
    assert cell["mean"] == pytest.approx(statistics.mean(per_seed), rel=rel)
    assert cell["sd"] == pytest.approx(statistics.stdev(per_seed), rel=rel, abs=1e-12)


def _summary(out, arm, seed):
    return json.loads((out / "runs" / arm / f"seed{seed}" / "summary.json").read_text())


def _metric_rows(out, arm, seed):
    path = out / "runs" / arm / f"seed{seed}" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_arms_and_configs(study):
    out, _, doc = study
    assert [a["name"] for a in doc["arms"]] == ARMS
    for arm in ARMS:
        for seed in (0, 1):
            assert _summary(out, arm, seed)["steps"] == 12
    cfg = json.loads((out / "runs" / "softmoe" / "seed0" / "config.json").read_text())
    # learned allocation over the 2 MoE layers with K = 2 L
    assert cfg["model"]["k_total"] == 4.0
    rows = _metric_rows(out, "softmoe", 0)
    k_rows = [r["k_layers"] for r in rows if "k_layers" in r]
    assert k_rows and all(sum(k) == pytest.approx(4.0, rel=1e-5) for k in k_rows)
    assert not any("k_layers" in r for r in _metric_rows(out, "softmoe-star", 0))
    star = json.loads((out / "runs" / "softmoe-star" / "seed0" / "config.json").read_text())
    router = star["model"]["router"]
    assert router["map"] == "lapsum" and router["token_cap_factor"] == 2.0
    assert router["schedule"] == "cosine" and router["temperature"] == 5.0
    # the k = 1.5 pair (K = 1.5 L) and the alpha = 4 pair (cap ceil(2 x 4) = 8)
    for arm, k, alpha in (("softmoe-k1.5", 1.5, 2.0), ("softmoe-star-k2-a4", 2.0, 4.0)):
        r = json.loads((out / "runs" / arm / "seed0" / "config.json").read_text())["model"]
        assert (r["router"]["lapsum_k"], r["router"]["token_cap_factor"]) == (k, alpha)
    learned = json.loads((out / "runs" / "softmoe-k1.5" / "seed0" / "config.json").read_text())
    assert learned["model"]["k_total"] == 3.0 and learned["model"]["k_lr_scale"] == 30.0
    jit = json.loads((out / "runs" / "sparse-k2-jitter" / "seed0" / "config.json").read_text())
    assert jit["model"]["router"]["jitter"] == JITTER
    # the sparse top-k arms compute exactly k experts per token in training
    for k in (1, 2, 4):
        assert all(
            r["active_experts"] == pytest.approx(k)
            for r in _metric_rows(out, f"sparse-k{k}", 0)
            if "active_experts" in r
        )


def test_table1_cells_are_hand_computed(study):
    out, _, doc = study
    table = _table(doc, "softmoe_main")
    headers = [c["header"] for c in table["columns"]]
    for col in ("Train-AE", "Infer-AE", "Active-Param (M)", "Loss", "k", "α"):
        assert col in headers
    rows = _rows(table)
    assert list(rows) == MAIN
    assert [rows[a]["group"] for a in MAIN] == ["= 1", *["≤ 2"] * 3, *["≤ 4"] * 5]
    for arm, row in rows.items():
        losses = [_summary(out, arm, s)["val_loss"] for s in (0, 1)]
        _check_cell(row["loss"], losses)
        # Train-AE by hand: every step counted, each logging window's computed slots
        # per token (mean over the layers) weighted by its steps
        aes = []
        for s in (0, 1):
            rows_ = [r for r in _metric_rows(out, arm, s) if "loss" in r]
            steps = [r["window_steps"] for r in rows_]
            assert sum(steps) == 12  # the windows tile the run
            means = [statistics.fmean(r["active_window_layers"]) for r in rows_]
            aes.append(sum(w * m for w, m in zip(steps, means, strict=True)) / sum(steps))
        _check_cell(row["train_ae"], aes)
        assert [train_ae(out / "runs" / arm / f"seed{s}") for s in (0, 1)] == pytest.approx(aes)
    assert rows["sparse-k2"]["train_ae"]["mean"] == pytest.approx(2.0)
    assert rows["sparse-k4"]["train_ae"]["mean"] == pytest.approx(4.0)
    assert rows["sparse-k4"]["infer_ae"]["mean"] == pytest.approx(4.0)


def test_infer_ae_and_active_params_match_a_direct_model_pass(study):
    """Infer-AE and Active-Param of the learned arm, recomputed by running the model on
    the same validation batches and counting the computed slots and parameters."""
    from moelab.data import batches

    out, _, doc = study
    row = _rows(_table(doc, "softmoe_main"))["softmoe"]
    aes, params = [], []
    for s in (0, 1):
        loaded = load_run(out / "runs" / "softmoe" / f"seed{s}")
        model = loaded.model
        cfg = loaded.config
        counts = []
        it = batches(loaded.val_shard(), cfg.batch_size, cfg.seq_len, shuffle=False, epochs=1)
        with torch.no_grad():
            for j, (x, y) in enumerate(it):
                if j >= 2:  # the quick scale's max_batches
                    break
                o = model(x, y, collect=True)
                counts.append([ro.computed_TK.sum(-1).float() for ro in o.router_outputs])
        n_layers = len(counts[0])
        per_layer = [torch.cat([c[i] for c in counts]).mean().item() for i in range(n_layers)]
        aes.append(sum(per_layer) / n_layers)
        expert = sum(p.numel() for p in model.moe_layers[0].experts.parameters())
        expert //= model.config.n_experts
        non_expert = sum(p.numel() for p in model.parameters()) - n_layers * (
            model.config.n_experts * expert
        )
        params.append((non_expert + sum(per_layer) * expert) / 1e6)
    _check_cell(row["infer_ae"], aes, rel=1e-5)
    _check_cell(row["active_params"], params, rel=1e-5)


def test_load_variance_table(study):
    out, _, doc = study
    table = _table(doc, "softmoe_load_variance")
    assert "Load variance (relative)" in [c["header"] for c in table["columns"]]
    rows = _rows(table)
    assert list(rows) == MAIN
    assert rows["softmoe-star-k1.5"]["paper_owt"] == "0.05"  # the paper's Table 5
    assert rows["softmoe-k2-a4"]["paper_owt"] == "-"
    for arm, row in rows.items():
        per_seed = []
        for s in (0, 1):
            saved = json.loads(
                (out / "runs" / arm / f"seed{s}" / "analysis" / "softmoe_stats_b2.json").read_text()
            )["value"]
            # Var / mean^2 of each layer's load shares by hand (population variance)
            rel = []
            for shares in saved["load_shares"]:
                m = statistics.fmean(shares)
                rel.append(statistics.pvariance(shares) / m**2)
            per_seed.append(statistics.fmean(rel))
        _check_cell(row["load_rel_var"], per_seed, rel=1e-9)
    assert load_relative_variance([1.0, 1.0, 1.0]) == 0.0
    assert load_relative_variance([2.0, 0.0]) == pytest.approx(1.0)
    assert load_relative_variance([0.0, 0.0]) is None


def test_threshold_ablation_table(study):
    out, _, doc = study
    table = _table(doc, "softmoe_threshold_ablation")
    rows = _rows(table)
    assert list(rows) == ["softmoe-star", *(f"softmoe-star-tau{t:g}" for t in FIXED_TAUS)]
    assert rows["softmoe-star"]["tau_text"] == "calibrated"
    for t in FIXED_TAUS:
        row = rows[f"softmoe-star-tau{t:g}"]
        # a fixed tau is never calibrated: the trained threshold is the configured one
        assert row["tau"]["values"] == pytest.approx([t, t], rel=1e-5)
        losses = [_summary(out, f"softmoe-star-tau{t:g}", s)["val_loss"] for s in (0, 1)]
        _check_cell(row["loss"], losses)
    # the calibrated threshold, read from the saved checkpoint's router
    taus = []
    for s in (0, 1):
        model = load_run(out / "runs" / "softmoe-star" / f"seed{s}").model
        taus.append(statistics.fmean(float(layer.router.truncation) for layer in model.moe_layers))
    _check_cell(rows["softmoe-star"]["tau"], taus, rel=1e-5)


def test_inference_truncation_table(study):
    out, _, doc = study
    table = _table(doc, "softmoe_inference_truncation")
    rows = table["rows"]
    assert [r["arm"] for r in rows] == ["softmoe-star"] * 4 + ["softmoe"] * 4
    assert [r["scale"] for r in rows[:4]] == [f"{x:g} ×" for x in INFER_SCALES]
    # a second source: evaluate_truncation run again on the learned arm
    fresh = [
        evaluate_truncation(out / "runs" / "softmoe" / f"seed{s}", INFER_SCALES, max_batches=2)
        for s in (0, 1)
    ]
    for j, row in enumerate(rows[4:]):
        _check_cell(row["nll"], [f["results"][j]["nll"] for f in fresh], rel=1e-6)
        _check_cell(row["infer_ae"], [f["results"][j]["active_experts"] for f in fresh], rel=1e-6)
    # a higher cut keeps no more experts
    ae = [r["infer_ae"]["mean"] for r in rows[4:]]
    assert ae == sorted(ae)


def test_jitter_table(study):
    out, _, doc = study
    table = _table(doc, "softmoe_jitter")
    assert [c["header"] for c in table["columns"]][:4] == ["Arm", "Jitter", "Model", "Loss"]
    rows = table["rows"]
    assert [(r["jitter"], r["model"]) for r in rows] == [
        ("No", "Top-1"),
        (f"{JITTER:g}", "Top-1"),
        ("No", "Top-2"),
        (f"{JITTER:g}", "Top-2"),
    ]
    for row in rows:
        _check_cell(row["loss"], [_summary(out, row["arm"], s)["val_loss"] for s in (0, 1)])


def test_allocation_table_and_figure(study):
    out, _, doc = study
    table = _table(doc, "softmoe_allocation")
    learned = [r for r in table["rows"] if r["arm"] == "softmoe"]
    assert [r["layer"] for r in learned] == ["0", "1"]
    for i, row in enumerate(learned):
        ends = []
        for s in (0, 1):
            k_rows = [r["k_layers"] for r in _metric_rows(out, "softmoe", s) if "k_layers" in r]
            ends.append(k_rows[-1][i])
        _check_cell(row["k_end"], ends)
    steps, k_L = k_layer_series(out / "runs" / "softmoe" / "seed0")
    assert len(k_L) == 2 and len(steps) == len(k_L[0]) > 1
    assert all(a + b == pytest.approx(4.0, rel=1e-5) for a, b in zip(*k_L, strict=True))
    _, k_L = k_layer_series(out / "runs" / "softmoe-k1.5" / "seed0")
    assert all(a + b == pytest.approx(3.0, rel=1e-5) for a, b in zip(*k_L, strict=True))
    assert k_layer_series(out / "runs" / "softmoe-star" / "seed0") == ([], [])
    assert "softmoe_k_layers.png" in doc["figures"]
    assert (out / "softmoe_k_layers.png").stat().st_size > 1000
    assert "softmoe_allocation.png" in doc["figures"]
    assert (out / "softmoe_allocation.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    for title in ("Table 1", "Table 5", "Table 6", "Table 7", "Table 8"):
        assert title in report
    assert "±" in report


def test_cli_quick(study, tmp_path, capsys):
    """`moelab study softmoe --scale quick` through the CLI (reusing the trained runs)."""
    out, corpus, doc = study
    args = ["study", "softmoe", "--scale", "quick", "--seeds", "2", "--data", str(corpus)]
    code = main([*args, "--out", str(out), "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["arm_states"]["softmoe"] == ["reused", "reused"]
    assert res["tables"] == doc["tables"]


def test_paper_scale_arms_match_quick_arms():
    """cpu trains the quick arms; the paper scale adds the rest of its Table 1 (sparse
    top-3 and SoftMoE* k = 1, alpha = 4) in the table's order."""
    study = SoftMoEStudy()
    assert [a.name for a in study.arms("cpu", {})] == ARMS
    paper = [a.name for a in study.arms("paper", {})]
    assert paper == [
        *MAIN[:4], "sparse-k3", "sparse-k4", "softmoe-star-k1-a4", *MAIN[5:], *ARMS[len(MAIN):]
    ]  # fmt: skip


def test_k_lr_scale_gives_the_allocator_its_own_learning_rate():
    """model.k_lr_scale: the allocator's eta in a third optimiser group whose lr is that
    multiple of the schedule's; 1 keeps the two groups; refused without k_total."""
    from moelab.model import ModelConfig, Transformer
    from moelab.train import TrainConfig
    from moelab.train.loop import build_optimizer

    base = dict(
        n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=50,
        max_seq_len=8, n_experts=4, moe_layers="all", k_total=4.0,
        router={"map": "lapsum", "selection": "threshold"},
    )  # fmt: skip
    model = Transformer(ModelConfig(**base, k_lr_scale=25.0))
    opt = build_optimizer(model, TrainConfig(lr=2e-3))
    assert len(opt.param_groups) == 3
    (eta,) = opt.param_groups[2]["params"]
    assert eta is model.allocator.eta
    assert opt.param_groups[2]["lr_scale"] == 25.0
    assert all(eta is not p for g in opt.param_groups[:2] for p in g["params"])
    plain = Transformer(ModelConfig(**base))
    assert len(build_optimizer(plain, TrainConfig(lr=2e-3)).param_groups) == 2
    with pytest.raises(ValueError, match="k_lr_scale"):
        ModelConfig(**{**base, "k_total": None}, k_lr_scale=2.0)
    with pytest.raises(ValueError, match="k_lr_scale"):
        ModelConfig(**base, k_lr_scale=0.0)


# ------------------------------------------------------------------ findings and checks


def test_learned_k_l_differ_at_the_quick_scale(study):
    """The allocator's own lr (model.k_lr_scale) moves the k_l within 12 steps: at the end
    they are not all equal on any seed, they still sum to K, and the checks say how far
    apart they ended (max − min, mean over seeds) and whether any sits on a bound."""
    from moelab.studies.softmoe.findings import K_SPREAD_MIN, checks

    out, _, _ = study
    spreads = []
    for seed in (0, 1):
        _, k_L = k_layer_series(out / "runs" / "softmoe" / f"seed{seed}")
        end = [ks[-1] for ks in k_L]
        assert sum(end) == pytest.approx(2 * len(end), rel=1e-5)  # K = 2 L
        spreads.append(max(end) - min(end))
        assert spreads[-1] > K_SPREAD_MIN
    report = (out / "report.md").read_text()
    mean = statistics.mean(spreads)
    assert f"softmoe: the learned k_l ended {mean:.2f} apart" in report
    assert "softmoe: no k_l on a bound" in report or "warning: softmoe seed" in report
    # and the warning where they did not separate
    lines = checks({}, {"softmoe": [[2.0, 2.01], [1.99, 2.0]]}, {})
    assert lines[0].startswith("warning: softmoe: the learned k_l ended only 0.010 apart")


def test_findings_open_the_report_with_every_claim_and_a_verdict(study):
    from moelab.studies.softmoe.findings import CLAIM_KEYS, REFERENCE

    out, _, doc = study
    st = SoftMoEStudy()
    assert doc["reference"] == REFERENCE == st.reference == "sparse-k2"
    assert [f["key"] for f in doc["findings"]] == list(CLAIM_KEYS) == list(st.claims)
    for f in doc["findings"]:
        assert f["verdict"] in {"holds", "contradicted", "not resolved"}, f["key"]
        assert f["effect"]["n"] == 2
    table = _table(doc, "findings")
    assert [r["verdict"] for r in table["rows"]] == [f["verdict"] for f in doc["findings"]]
    report = (out / "report.md").read_text()
    assert report.index("## Findings") < report.index("## SoftMoE vs sparse MoE")
    assert "## Paired differences from Sparse MoE k=2" in report
    assert "## Budget groups" in report and "## The paper's numbers beside moelab's" in report


def _cells(doc, table_key, label_key, label, column):
    (row,) = [r for r in _table(doc, table_key)["rows"] if r.get(label_key) == label]
    return row[column]["values"]


def test_every_paired_record_names_its_arms_table_and_column(study):
    """Each finding that is a paired difference names its two arms (or rows), its table
    and its column, and its per-seed effect is, seed by seed, the difference of the
    per-seed values that table holds in results.json; so is every row of the paired
    tables within the budget groups."""
    _, _, doc = study
    n = 0
    for f in doc["findings"]:
        extra = f["extra"]
        if f["key"].startswith("later-layers"):
            # the later half's mean k_l minus the earlier half's: at L = 2, layer 1 − 0
            rows = [r for r in _table(doc, extra["table"])["rows"] if r["arm"] == extra["arm"]]
            ends = [r[extra["column"]]["values"] for r in rows]
            assert f["effect"]["values"] == pytest.approx(
                [b - a for a, b in zip(ends[0], ends[1], strict=True)]
            )
            continue
        arm, versus = extra["arms"]
        if "rows" in extra:  # two rows of one arm's sweep (Table 7)
            top, one = extra["rows"]
            rows = [r for r in _table(doc, extra["table"])["rows"] if r["arm"] == arm]
            by_scale = {r["scale"]: r for r in rows}
            a = by_scale[top.split(" @ ")[1]][extra["column"]]["values"]
            b = by_scale[one.split(" @ ")[1]][extra["column"]]["values"]
        else:
            a = _cells(doc, extra["table"], "arm", arm, extra["column"])
            b = _cells(doc, extra["table"], "arm", versus, extra["column"])
            assert extra[arm] == pytest.approx(a) and extra[versus] == pytest.approx(b)
        assert f["effect"]["values"] == pytest.approx(
            [x - y for x, y in zip(a, b, strict=True)], rel=1e-12
        ), f["key"]
        n += 1
    assert n == len(doc["findings"]) - 3  # all but the three later-layers findings
    for group, sparse in ((2, "sparse-k2"), (4, "sparse-k4")):
        table = _table(doc, f"paired_softmoe_main_group{group}")
        assert {r["arm"] for r in table["rows"]} == {
            a
            for a in MAIN
            if a != sparse and _rows(_table(doc, "softmoe_main"))[a]["group"] == f"≤ {group}"
        }
        for r in table["rows"]:
            assert (r["versus"], r["table"]) == (sparse, "softmoe_main")
            a = _cells(doc, "softmoe_main", "arm", r["arm"], r["column_key"])
            b = _cells(doc, "softmoe_main", "arm", sparse, r["column_key"])
            assert r["paired"]["values"] == pytest.approx(
                [x - y for x, y in zip(a, b, strict=True)]
            )


def test_findings_equal_hand_computations(study):
    """Each finding's per-seed effect from the run folders: the later half's k_l minus the
    earlier half's (metrics.jsonl), validation-loss differences within the budget groups
    (summary.json), the inference-cut differences (a fresh evaluate_truncation); the
    interval is mean ± t(0.975, 1) sd / √2."""
    out, _, doc = study
    got = {f["key"]: f for f in doc["findings"]}
    for key, arm in (("later-layers-larger-k-k2", "softmoe"), ("later-layers-larger-k-k1.5",
                                                              "softmoe-k1.5")):  # fmt: skip
        k_diff = []
        for seed in (0, 1):
            rows = [r for r in _metric_rows(out, arm, seed) if "k_layers" in r]
            k_diff.append(rows[-1]["k_layers"][-1] - rows[-1]["k_layers"][0])
        assert got[key]["effect"]["values"] == pytest.approx(k_diff)
    for key, a, b in (
        ("star-k1.5-lower-loss", "softmoe-star-k1.5", "sparse-k2"),
        ("star-k2-lower-loss", "softmoe-star", "sparse-k4"),
        ("softmoe-k2-a4-matches-sparse", "softmoe-k2-a4", "sparse-k4"),
        ("learned-k2-lower-loss", "softmoe", "softmoe-star"),
        ("jitter-hurts-k1", "sparse-k1-jitter", "sparse-k1"),
    ):
        want = [_summary(out, a, s)["val_loss"] - _summary(out, b, s)["val_loss"] for s in (0, 1)]
        eff = got[key]["effect"]
        assert eff["values"] == pytest.approx(want, rel=1e-9), key
        half = 12.706204736 * statistics.stdev(want) / 2**0.5
        assert eff["mean"] == pytest.approx(statistics.mean(want))
        assert (eff["low"], eff["high"]) == pytest.approx(
            (statistics.mean(want) - half, statistics.mean(want) + half), rel=1e-6
        )
    ae, nll = [], []
    for seed in (0, 1):
        loaded = load_run(out / "runs" / "softmoe" / f"seed{seed}")
        res = evaluate_truncation(loaded, (2.0, 1.0), max_batches=2)["results"]
        ae.append(res[0]["active_experts"] - res[1]["active_experts"])
        nll.append(res[0]["nll"] - res[1]["nll"])
    assert got["inference-cut-fewer-experts"]["effect"]["values"] == pytest.approx(ae)
    assert got["inference-cut-costs-loss"]["effect"]["values"] == pytest.approx(nll)
    assert all(v < 0 for v in ae)  # a doubled cut keeps fewer experts on every seed


def test_every_paired_record_matches_the_values_results_json_holds(study):
    """moelab.studies.audit.audit: every paired difference (tables and findings) names
    its table, column and two arms and equals their per-seed values' difference; every
    arm's per-seed cell of a table with the reference's row has its paired difference."""
    from moelab.studies.audit import audit

    out, doc = study[0], study[-1]
    assert audit(doc) == []
    assert audit(json.loads((out / "results.json").read_text())) == []
