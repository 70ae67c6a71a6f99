"""The softmoe study's measures and findings on planted numbers (no study run): Train-AE
as the paper defines it (every training step), the findings within the budget groups
each way, "later layers get more" each way, the warning when a k_l sits on a bound, the
budget-group check, and the paper's own Table 1 against the definitions moelab uses."""

from __future__ import annotations

import json
import math

import pytest

from moelab.studies.softmoe import SoftMoEStudy, train_ae, train_ae_logged
from moelab.studies.softmoe.findings import (
    BOUND_SHARE,
    bound_lines,
    checks,
    findings,
    late_minus_early,
    late_share,
)
from moelab.studies.softmoe.paper import TABLE1, TRAIN_AE_REDUCTION, group_of

ARMS = [a.name for a in SoftMoEStudy().arms("quick", {})]


def _write_rows(run, rows):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# ------------------------------------------------------------------------ Train-AE


def test_train_ae_counts_every_step(tmp_path):
    """Windows of 2 and 3 steps, two layers: (2 · (1 + 2)/2 + 3 · (3 + 3)/2) / 5 = 2.4,
    not the mean of the logged steps' own batches ((1.0 + 3.5) / 2 = 2.25)."""
    run = tmp_path / "run"
    _write_rows(
        run,
        [
            {"step": 0, "calibrated_thresholds": [1.0, 1.0]},
            {"step": 2, "loss": 5.0, "active_experts": 1.0, "window_steps": 2,
             "active_window_layers": [1.0, 2.0]},
            {"step": 5, "loss": 4.0, "active_experts": 3.5, "window_steps": 3,
             "active_window_layers": [3.0, 3.0]},
            {"step": 5, "val_loss": 4.5, "active_experts": 9.0},
        ],
    )  # fmt: skip
    assert train_ae(run) == pytest.approx(2.4)
    assert train_ae_logged(run) == pytest.approx(2.25)
    # a run logged before the window fields: the logged steps' mean
    old = tmp_path / "old"
    _write_rows(old, [{"step": 2, "loss": 5.0, "active_experts": 1.0},
                      {"step": 4, "loss": 4.0, "active_experts": 2.0}])  # fmt: skip
    assert train_ae(old) == pytest.approx(1.5)


def test_window_counts_equal_each_steps_own_count(tmp_path):
    """The same run logged every step and every second step: each 2-step window's
    active_window_layers is the mean of the two steps' own active_layers."""
    from moelab.train import TrainConfig, train
    from tests.train import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_docs=20, sentences=6)
    model = dict(
        n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16,
        n_experts=4, moe_layers="all",
        router={"map": "lapsum", "selection": "threshold", "lapsum_k": 1.5,
                "token_cap_factor": 2.0, "truncation_relative": True},
    )  # fmt: skip
    rows = {}
    for every in (1, 2):
        out = tmp_path / f"log{every}"
        cfg = TrainConfig(
            data=str(corpus), out=str(out), model=model, steps=4, batch_size=2, seq_len=16,
            vocab_size=300, log_every=every, eval_every=0, checkpoint_every=0,
            device="cpu", threads=1, progress=False, calibrate_batches=1,
        )  # fmt: skip
        train(cfg)
        rows[every] = [
            json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
        rows[every] = [r for r in rows[every] if "loss" in r]
    each = {r["step"]: r["active_layers"] for r in rows[1]}
    assert all(r["window_steps"] == 1 for r in rows[1])
    assert all(r["active_window_layers"] == pytest.approx(r["active_layers"]) for r in rows[1])
    for r in rows[2]:
        s = r["step"]
        want = [(a + b) / 2 for a, b in zip(each[s - 1], each[s], strict=True)]
        assert r["window_steps"] == 2
        assert r["active_window_layers"] == pytest.approx(want, rel=1e-9)
    assert train_ae(tmp_path / "log2") == pytest.approx(train_ae(tmp_path / "log1"), rel=1e-9)


# ------------------------------------------------------------------------ findings


def _columns(loss, train, infer):
    return {a: {"loss": loss(a), "train_ae": train(a), "infer_ae": infer(a),
                "load_rel_var": [0.05, 0.06, 0.07]} for a in ARMS}  # fmt: skip


def _planted(soft_better: bool):
    """Sparse arms at their k; each soft arm's loss 0.05 lower (or higher) and its AE
    0.4 below (or above) the sparse arm of its group, seed by seed with some spread."""
    sign = -1 if soft_better else 1
    sparse_ae = {"sparse-k1": 1.0, "sparse-k2": 2.0, "sparse-k4": 4.0}
    group_ae = {"k1.5": 2.0, "k2": 4.0}

    def ae(a):
        if a in sparse_ae or a.startswith("sparse"):
            return [sparse_ae.get(a, 2.0)] * 3
        base = group_ae["k1.5"] if "k1.5" in a else group_ae["k2"]
        return [base + sign * d for d in (0.4, 0.5, 0.45)]

    def loss(a):
        if a.startswith("sparse"):
            return [5.0, 5.1, 5.2]
        return [5.0 + sign * 0.05, 5.1 + sign * 0.06, 5.2 + sign * 0.055]

    return _columns(loss, ae, ae)


@pytest.mark.parametrize("soft_better", [True, False])
def test_budget_group_findings_come_out_each_way(soft_better):
    got = {f.key: f for f in findings(_planted(soft_better), {}, {}, 3)}
    want = "holds" if soft_better else "contradicted"
    for key in (
        "star-k1.5-lower-loss", "star-k1.5-fewer-experts-train",
        "star-k1.5-fewer-experts-inference", "softmoe-k1.5-matches-sparse",
        "star-k2-lower-loss", "star-k2-fewer-experts-train", "star-k2-a4-fewer-experts-inference",
        "softmoe-k2-matches-sparse",
    ):  # fmt: skip
        assert got[key].verdict == want, key
    # each against the sparse arm of its group, named in the record
    assert got["star-k1.5-lower-loss"].extra["arms"] == ["softmoe-star-k1.5", "sparse-k2"]
    assert got["star-k2-lower-loss"].extra["arms"] == ["softmoe-star", "sparse-k4"]
    assert got["star-k2-lower-loss"].extra["table"] == "softmoe_main"
    # the <= 2 group's Train-AE reduction, as the paper states it: 1 − 1.6 / 2 = 20%
    red = got["star-k1.5-fewer-experts-train"].extra["reduction"]
    assert red[0] == pytest.approx(-0.2 if not soft_better else 0.2)
    # the arms of no claim at this scale are not measured
    assert got["later-layers-larger-k-k2"].verdict == "not measured"


def test_later_layers_finding_comes_out_each_way():
    up = [[1.2, 1.5, 2.3, 3.0], [1.1, 1.6, 2.4, 2.9], [1.3, 1.4, 2.2, 3.1]]
    down = [list(reversed(ks)) for ks in up]
    cols = _planted(True)
    for ends, verdict in ((up, "holds"), (down, "contradicted")):
        k_end = {"softmoe": ends, "softmoe-k1.5": ends, "softmoe-k2-a4": ends}
        got = {f.key: f for f in findings(cols, k_end, {}, 3)}
        for key in ("later-layers-larger-k-k2", "later-layers-larger-k-k1.5"):
            assert got[key].verdict == verdict
    f = {f.key: f for f in findings(cols, {"softmoe": up}, {}, 3)}["later-layers-larger-k-k2"]
    # (2.3 + 3.0)/2 − (1.2 + 1.5)/2 = 1.3; slope Σ (i − 1.5) k_i / 5 = 3.1 / 5
    assert f.effect.values[0] == pytest.approx(1.3)
    assert f.extra["slope"][0] == pytest.approx(3.1 / 5)
    # the last ceil(0.3 · 4) = 2 layers hold (2.3 + 3.0) / 8 of K
    assert f.extra["late_share"][0] == pytest.approx(5.3 / 8)
    # odd L: the middle layer is left out
    assert late_minus_early([1.0, 5.0, 2.0]) == pytest.approx(1.0)
    assert late_share([1.0, 1.0, 2.0]) == pytest.approx(0.5)


def test_bound_warning_each_way():
    """K = 8 over L = 4 (bounds 1 and 5): 37 x's saturated end warns, 10 x's does not."""
    saturated = [[4.96, 1.01, 1.02, 1.01]]
    lines = bound_lines("softmoe", saturated, [0])
    assert len(lines) == 1 and lines[0].startswith("warning: softmoe seed 0")
    assert "layer(s) 1, 2, 3 on the lower bound 1" in lines[0]
    assert "layer(s) 0 on the upper bound K − L + 1 = 5" in lines[0]
    free = [[3.04, 1.66, 1.66, 1.64], [2.87, 1.82, 1.60, 1.71]]
    lines = bound_lines("softmoe", free, [0, 1])
    assert lines == [
        "softmoe: no k_l on a bound at the end (shares (k_l − 1) / (K − L) from 0.15 to "
        f"0.51; bound within {BOUND_SHARE:g})"
    ]
    # the share of the movable budget: (1.03 − 1) / 4 = 0.0075, on the bound
    assert bound_lines("softmoe", [[4.91, 1.03, 1.03, 1.03]], [0])[0].startswith("warning")
    # and in the study's checks
    assert any(
        line.startswith("warning: softmoe seed 0")
        for line in checks({}, {"softmoe": saturated}, {}, [0])
    )


def test_budget_group_check_each_way():
    cols = {"softmoe-star-k1.5": {"infer_ae": [2.3, 2.4]}, "softmoe-star": {"infer_ae": [3.1, 3.0]}}
    lines = checks(cols, {}, {})
    (k15,) = [x for x in lines if "softmoe-star-k1.5 activates" in x]
    assert k15.startswith("warning") and "beyond its budget group ≤ 2" in k15
    assert "here ≤ 3" in k15
    (k2,) = [x for x in lines if x.startswith("softmoe-star activates")]
    assert k2.endswith("in its budget group ≤ 4")
    lines = checks({"softmoe-star-k1.5": {"infer_ae": [1.7, 1.8]}}, {}, {})
    assert not any(x.startswith("warning") for x in lines)


# ------------------------------------------------------------------ the paper's Table 1


def test_the_papers_groups_are_the_groups_of_their_infer_ae():
    for dataset, rows in TABLE1.items():
        for row in rows:
            assert group_of(row.infer_ae) == row.group, (dataset, row)
    assert group_of(2.0) == 2 and group_of(2.01) == 3 and group_of(0.5) == 1


def test_the_papers_active_params_follow_its_infer_ae():
    """Active-Param = the parameters outside the experts + Infer-AE experts per layer (as
    moelab's Table 1 counts it): every row is 107.74M + (Infer-AE − 1) · 49.20M (the
    step from sparse k = 1 to k = 2) within 0.02M, so the paper's Infer-AE is the mean
    over tokens and layers of the experts a token computes at inference."""
    step = 156.94 - 107.74
    for rows in TABLE1.values():
        for row in rows:
            assert row.active_params_m == pytest.approx(
                107.74 + (row.infer_ae - 1) * step, abs=0.02
            ), row


def test_the_papers_train_ae_reduction():
    """Section 5.1's 17% (C4) and 24% (OWT): 1 − Train-AE / 2 of SoftMoE* k = 1.5."""
    for dataset, claimed in TRAIN_AE_REDUCTION.items():
        (star,) = [r for r in TABLE1[dataset] if r.model == "SoftMoE*" and r.k == 1.5]
        assert 1 - star.train_ae / 2 == pytest.approx(claimed, abs=0.006)
    assert math.isclose(1 - 1.53 / 2, 0.235)
