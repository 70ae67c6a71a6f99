"""The gate-norm study: its arms, the quick scale through the CLI (two seeds), every
mean ± sd cell against a hand computation on values recomputed from the run folders, the
gate sums against hand references, the findings (every claim, the paired differences
they rest on, the K = 1 identity and its control), the K = 1 renorm refusal and the
paper-scale refusal."""

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
from moelab.routing.config import RouterConfig
from moelab.studies import get_study
from moelab.studies.core import arm_config
from moelab.studies.gate_norm import (
    ARMS,
    CLAIMS,
    K1_CLAIM,
    ORACLE_CLAIM,
    GateNormStudy,
    findings,
    gate_gradient,
)
from moelab.studies.gate_norm.figures import mean_over_seeds
from moelab.train import apply_overrides
from tests.train import make_corpus

ARM_NAMES = [name for name, _, _ in ARMS]
COLUMNS = [
    "arm",
    "val_loss",
    "ppl",
    "active_experts",
    "contributors",
    "discarded_mass",
    "gate_sum",
    "load_cv",
]
MAX_BATCHES = 2  # the quick scale's analysis batches


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`moelab study gate-norm --scale quick --seeds 2` run once, in process."""
    root = tmp_path_factory.mktemp("gate-norm")
    corpus = make_corpus(root / "corpus", n_docs=20, sentences=6)
    out = root / "out"
    buf = io.StringIO()
    argv = ["study", "gate-norm", "--scale", "quick", "--seeds", "2", "--threads", "1"]
    argv += ["--data", str(corpus), "--out", str(out), "--json"]
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    assert rc == 0
    return out, json.loads(buf.getvalue())


def _table(doc, key):
    (table,) = [t for t in doc["tables"] if t["key"] == key]
    return table


def test_arms_are_the_essays_variants_with_one_seed_data_and_k():
    study = get_study("gate-norm")
    assert isinstance(study, GateNormStudy)
    common = study.common("cpu")
    arms = study.arms("cpu", {})
    assert [a.name for a in arms] == ARM_NAMES
    configs = {a.name: arm_config(common, a, 0, "unused") for a in arms}
    assert len({(c.seed, c.data, c.steps, c.batch_size, c.seq_len) for c in configs.values()}) == 1
    rc = {name: c.model_config().router_config() for name, c in configs.items()}
    assert (rc["softmax-topk"].map, rc["softmax-topk"].gate_rule) == ("softmax", "map")
    assert (rc["softmax-renorm"].map, rc["softmax-renorm"].gate_rule) == ("softmax", "renorm")
    assert rc["sigmoid-bias"].map == "sigmoid" and rc["sigmoid-bias"].bias_rate > 0
    assert rc["sigmoid-bias"].gate_rule == "map" and rc["sigmoid-bias"].aux_weight == 0
    assert (rc["relu"].map, rc["relu"].selection, rc["relu"].l1_target) == ("relu", "threshold", 2)
    v3 = rc["deepseek-v3"]  # sigmoid, renormalised top-k, bias rate 0.001, routed scaling
    assert (v3.map, v3.gate_rule, v3.rank_by, v3.bias_rate) == ("sigmoid", "renorm", "probs", 1e-3)
    assert (v3.routed_scaling, v3.aux_weight, v3.aux_scope) == (2.5, 1e-4, "sequence")
    assert v3.aux_probs == "normalized"
    assert rc["straight-through"].gate_rule == "straight_through"
    assert rc["sample"].sample_extra > 0 and rc["sample"].gate_rule == "map"
    assert rc["noisy"].noise_std > 0 and rc["noisy"].gate_rule == "map"
    for name in ARM_NAMES:
        if name != "relu":
            assert rc[name].top_k == 2 and rc[name].selection == "topk"
        # the softmax arms share the Switch loss; the others have their own balancing
        # (DeepSeek-V3's own: its sequence-wise loss beside the bias)
        if name != "deepseek-v3":
            assert (rc[name].aux_weight > 0) == (rc[name].map == "softmax")


def test_quick_study_tables_hold_the_arms_and_columns(quick):
    out, doc = quick
    assert doc["study"] == "gate-norm" and doc["seeds"] == [0, 1]
    main_table = _table(doc, "main")
    assert [c["key"] for c in main_table["columns"]] == COLUMNS
    labels = [label for _, label, _ in ARMS]
    assert [r["arm"] for r in main_table["rows"]] == labels
    for name in ARM_NAMES:
        for s in (0, 1):
            assert (
                json.loads((out / "runs" / name / f"seed{s}" / "summary.json").read_text())["steps"]
                == GateNormStudy().common("quick")["steps"]
            )
    report = (out / "report.md").read_text()
    assert "mean ± sd" in report and "| softmax, top-2, renorm |" in report
    assert (out / "gate-norm-training.png").stat().st_size > 0
    assert r"$\pm$" in (out / "tables.tex").read_text()


def test_cells_are_mean_and_sd_of_values_recomputed_from_the_runs(quick):
    """Each cell's per-seed values equal an independent stats() pass over the run, and
    the cell's mean ± sd equals statistics.mean / stdev of them."""
    out, doc = quick
    rows = {r["name"]: r for r in _table(doc, "main")["rows"]}
    claims = {f["key"]: f for f in doc["findings"]}
    ref = [
        stats(out / "runs" / "softmax-topk" / f"seed{s}", max_batches=MAX_BATCHES)["nll"]
        for s in (0, 1)
    ]
    for name in ARM_NAMES:
        per_seed = [
            stats(out / "runs" / name / f"seed{s}", max_batches=MAX_BATCHES) for s in (0, 1)
        ]
        want = {
            "val_loss": [d["nll"] for d in per_seed],
            "ppl": [math.exp(d["nll"]) for d in per_seed],
            "active_experts": [d["mean"]["active_experts"] for d in per_seed],
            "contributors": [d["mean"]["contributors"] for d in per_seed],
            "load_cv": [d["mean"]["load_cv"] for d in per_seed],
        }
        if per_seed[0]["map"] == "softmax":
            want["discarded_mass"] = [d["mean"]["discarded_mass"] for d in per_seed]
        else:  # sigmoid and ReLU values are no distribution: no discarded mass
            assert rows[name]["discarded_mass"] is None
        for key, values in want.items():
            cell = rows[name][key]
            assert cell["values"] == pytest.approx(values, rel=1e-9), (name, key)
            assert cell["mean"] == pytest.approx(statistics.mean(values), rel=1e-9)
            assert cell["sd"] == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-12)
        # the findings on this arm's val loss: its paired difference from the reference
        diffs = [v - r for v, r in zip(want["val_loss"], ref, strict=True)]
        for c in CLAIMS:
            if c.arm == name and c.column == "val_loss":
                effect = claims[c.key]["effect"]
                assert effect["values"] == pytest.approx(diffs, rel=1e-9, abs=1e-12), c.key
                assert effect["mean"] == pytest.approx(statistics.mean(diffs), abs=1e-12)
                assert effect["sd"] == pytest.approx(statistics.stdev(diffs), abs=1e-12)
    # the seeds differ, so the loss has a spread
    assert rows["softmax-topk"]["val_loss"]["sd"] > 0


def test_gate_sums_against_hand_references(quick):
    """gate sum: 1 under renorm, K = 2 under straight-through, and for the other gates the
    map's values at the selected experts summed, recomputed here from the model."""
    out, doc = quick
    rows = {r["name"]: r for r in _table(doc, "main")["rows"]}
    for name in ARM_NAMES:
        want = []
        for s in (0, 1):
            loaded = load_run(out / "runs" / name / f"seed{s}")
            cfg = loaded.config
            layers = [0.0] * len(loaded.model.moe_layers)
            n = 0
            data = batches(
                loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
            )
            with torch.no_grad():
                for b, (x, y) in enumerate(data):
                    if b == MAX_BATCHES:
                        break
                    outs = loaded.model(x, y, collect=True).router_outputs
                    for i, ro in enumerate(outs):
                        kept_TK = ro.probs_TE.double().gather(-1, ro.ids_TK) * ro.selected_TK
                        if name == "softmax-renorm":
                            per_token = kept_TK.sum(-1) / kept_TK.sum(-1)
                        elif name == "deepseek-v3":  # renormalised, times the scaling
                            per_token = 2.5 * kept_TK.sum(-1) / kept_TK.sum(-1)
                        elif name == "straight-through":
                            per_token = (kept_TK > 0).double().sum(-1)
                        else:
                            per_token = kept_TK.sum(-1)
                        layers[i] += float(per_token.sum())
                    n += x.numel()
            want.append(sum(v / n for v in layers) / len(layers))
        cell = rows[name]["gate_sum"]
        assert cell["values"] == pytest.approx(want, rel=1e-6), name
        assert cell["mean"] == pytest.approx(statistics.mean(want), rel=1e-6)
    assert rows["softmax-renorm"]["gate_sum"]["values"] == pytest.approx([1.0, 1.0])
    assert rows["straight-through"]["gate_sum"]["values"] == pytest.approx([2.0, 2.0])
    assert rows["deepseek-v3"]["gate_sum"]["values"] == pytest.approx([2.5, 2.5])
    # softmax without renorm: the kept probability, 1 - discarded mass
    topk = rows["softmax-topk"]
    for g, d in zip(topk["gate_sum"]["values"], topk["discarded_mass"]["values"], strict=True):
        assert g == pytest.approx(1 - d, rel=1e-5)


def test_k1_renorm_refusal_is_shown_verbatim(quick):
    out, doc = quick
    model = GateNormStudy().common("quick")["model"]
    with pytest.raises(ValueError) as err:
        RouterConfig(d_model=model["d_model"], n_experts=model["n_experts"], top_k=1, renorm=True)
    report = (out / "report.md").read_text()
    assert f"> ValueError: {err.value}\n" in report
    grads = {(r["gate"], r["k"]): r["grad"] for r in _table(doc, "k1-gradient")["rows"]}
    assert grads[("renorm", 1)] < 1e-12  # p / p = 1: nothing reaches the scores
    assert grads[("renorm", 2)] > 1e-3 and grads[("straight_through", 1)] > 1e-3


def test_gate_gradient_of_the_plain_gate_against_its_closed_form():
    """K = 1, w = p_i of the top expert: dL/ds_j = c p_i (delta_ij - p_j)."""
    g = torch.Generator().manual_seed(0)
    s_TE = torch.randn(64, 8, generator=g, dtype=torch.float64)
    c_T = torch.randn(64, 1, generator=g, dtype=torch.float64)
    p_TE = torch.softmax(s_TE, -1)
    i_T = p_TE.argmax(-1)
    p_i = p_TE.gather(-1, i_T[:, None])
    grad_TE = c_T * p_i * (torch.nn.functional.one_hot(i_T, 8).double() - p_TE)
    assert gate_gradient("map", 1) == pytest.approx(float(grad_TE.abs().max()), rel=1e-12)


def test_seed_mean_keeps_the_steps_every_seed_has():
    xs, ys = mean_over_seeds([([1, 2, 3], [1.0, 2.0, 3.0]), ([2, 3], [4.0, 5.0])])
    assert xs == [2, 3] and ys == [3.0, 4.0]


def test_paper_scale_is_refused_with_one_line(tmp_path, capsys):
    rc = main(["study", "gate-norm", "--scale", "paper", "--out", str(tmp_path / "p")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err == f"moelab study: error: {GateNormStudy.paper_refusal}\n"
    assert "no experiment" in err and "--scale cpu" in err
    assert not (tmp_path / "p").exists()


def test_exploration_against_a_hand_computation(quick):
    """0 for the arms without exploration; for the noisy arm the share recomputed from the
    definition: top-2 of the logits against top-2 of the logits plus sd * N(0, 1) noise,
    drawn in the same order (batch by batch, layer by layer) from a generator seeded 0."""
    out, doc = quick
    rows = {r["name"]: r["explored"] for r in _table(doc, "exploration")["rows"]}
    for name in ARM_NAMES:
        if name in ("sample", "noisy"):
            assert all(v > 0 for v in rows[name]["values"]), name
        else:
            assert rows[name]["values"] == [0.0, 0.0], name
    loaded = load_run(out / "runs" / "noisy" / "seed0")
    cfg = loaded.config
    routers = [layer.router for layer in loaded.model.moe_layers]
    std = routers[0].config.noise_std
    xs = {}
    handles = [
        r.register_forward_pre_hook(lambda m, a, i=i: xs.__setitem__(i, a[0]))
        for i, r in enumerate(routers)
    ]
    g = torch.Generator().manual_seed(0)
    missed = total = 0
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    with torch.no_grad():
        for b, (x, _) in enumerate(data):
            if b == MAX_BATCHES:
                break
            loaded.model(x, collect=False)
            for i, r in enumerate(routers):
                z_TE = xs[i].float() @ r.weight.float().t()
                plain = z_TE.topk(2, -1).indices
                noisy = (z_TE + std * torch.randn(z_TE.shape, generator=g)).topk(2, -1).indices
                same = (plain[:, :, None] == noisy[:, None, :]).any(-1)
                missed += int((~same).sum())
                total += plain.numel()
    for h in handles:
        h.remove()
    assert rows["noisy"]["values"][0] == pytest.approx(missed / total, abs=1e-12)


def test_findings_open_the_report_with_every_claim_and_a_verdict(quick):
    out, doc = quick
    study = GateNormStudy()
    assert doc["reference"] == "softmax-topk" == study.reference
    keys = [f["key"] for f in doc["findings"]]
    assert keys == [K1_CLAIM, *(c.key for c in CLAIMS), ORACLE_CLAIM] == list(study.claims)
    verdicts = {"holds", "contradicted", "not resolved"}
    for f in doc["findings"]:
        assert f["verdict"] in verdicts and f["effect"]["n"] == 2, f["key"]
    report = (out / "report.md").read_text()
    assert report.index("## Findings") < report.index("## Loss and routing")
    table = _table(doc, "findings")
    assert [r["verdict"] for r in table["rows"]] == [f["verdict"] for f in doc["findings"]]
    # the load-CV claim is the paired difference of the main table's cells
    main = {r["name"]: r for r in _table(doc, "main")["rows"]}
    (lf,) = [f for f in doc["findings"] if f["key"] == "loss-free-balances"]
    want = [
        a - b
        for a, b in zip(
            main["sigmoid-bias"]["load_cv"]["values"],
            main["softmax-topk"]["load_cv"]["values"],
            strict=True,
        )
    ]
    assert lf["effect"]["values"] == pytest.approx(want, abs=1e-12)
    # the oracle claim is the reference arm's Spearman cells of the oracle table
    oracle = {r["name"]: r for r in _table(doc, "oracle")["rows"]}
    assert set(oracle) == set(ARM_NAMES)
    (of,) = [f for f in doc["findings"] if f["key"] == ORACLE_CLAIM]
    assert of["effect"]["values"] == oracle["softmax-topk"]["spearman"]["values"]
    for row in oracle.values():
        assert all(0 <= v <= 1 for v in row["top1"]["values"])
        assert all(v >= 0 for v in row["regret"]["values"])
    assert report.index("## Loss and routing") < report.index("## The loss oracle")


def test_k1_renorm_gives_the_trained_router_no_gradient_and_the_plain_gate_does(quick):
    """The K = 1 identity on the trained renorm checkpoints holds seed by seed; its
    control, the plain gate at K = 1, is non-zero (so the check can fail), and equals a
    recomputation on a model built from the config with top_k = 1 and gate = map."""
    out, doc = quick
    (k1,) = [f for f in doc["findings"] if f["key"] == K1_CLAIM]
    assert k1["exact"] and k1["expect"] == "zero" and k1["verdict"] == "holds"
    renorm, plain = k1["extra"]["renorm_grad_norm"], k1["extra"]["map_grad_norm"]
    assert all(p > 1e-6 for p in plain)
    assert all(r <= 1e-5 * p for r, p in zip(renorm, plain, strict=True))
    assert k1["effect"]["values"] == pytest.approx(
        [r / p for r, p in zip(renorm, plain, strict=True)]
    )
    rows = {r["gate"].split()[0]: r["grad"]["values"] for r in _table(doc, "k1-checkpoint")["rows"]}
    assert rows == {"renorm": renorm, "map": plain}

    from moelab.model.transformer import Transformer

    loaded = load_run(out / "runs" / "softmax-renorm" / "seed0")
    cfg = apply_overrides(loaded.config, ["top_k=1", "router.gate=map", "router.renorm=false"])
    model = Transformer(cfg.model_config(vocab_size=loaded.tokenizer.vocab_size))
    model.load_state_dict(loaded.model.state_dict())
    model.eval()
    for layer in model.moe_layers:
        layer.router.top_k = 1  # the checkpoint's router state says 2
        assert layer.router.gate.name == "map"
    x, y = next(
        iter(batches(loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False))
    )
    grads = torch.autograd.grad(
        torch.nn.functional.cross_entropy(
            model(x, collect=False).logits_BSV.flatten(0, 1).float(), y.flatten()
        ),
        [layer.router.weight for layer in model.moe_layers],
    )
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert norm == pytest.approx(plain[0], rel=1e-4)


def test_findings_verdicts_follow_the_measurements():
    """findings() on made-up numbers: a K = 1 renorm gradient as large as the control's
    contradicts the identity; a clear loss gap contradicts a "same" claim."""
    main = {name: {"val_loss": [5.0, 5.1, 5.2], "load_cv": [0.2, 0.3, 0.25]} for name in ARM_NAMES}
    main["relu"]["val_loss"] = [5.3, 5.41, 5.5]  # ~0.3 nats worse, every seed
    main["sigmoid-bias"]["load_cv"] = [0.1, 0.2, 0.16]  # lower, every seed
    k1 = [{"renorm": 1e-12, "map": 1e-3}] * 3
    got = {f.key: f.verdict for f in findings(main, k1)}
    assert got[K1_CLAIM] == "holds"
    assert got["relu-competitive"] == "contradicted"
    assert got["sigmoid-competitive"] == "holds"  # identical losses
    assert got["loss-free-balances"] == "holds"
    assert got["renorm-k2-worse"] == "not resolved"  # a difference of exactly 0
    bad = {f.key: f.verdict for f in findings(main, [{"renorm": 1e-3, "map": 1e-3}] * 3)}
    assert bad[K1_CLAIM] == "contradicted"


def test_every_paired_record_matches_the_values_results_json_holds(quick):
    """moelab.studies.audit.audit: every paired difference (tables and findings) names
    its table, column and two arms and equals their per-seed values' difference; every
    arm's per-seed cell of a table with the reference's row has its paired difference."""
    from moelab.studies.audit import audit

    out, doc = quick
    assert audit(doc) == []
    assert audit(json.loads((out / "results.json").read_text())) == []
