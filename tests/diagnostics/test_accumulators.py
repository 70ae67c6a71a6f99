"""Routing statistics: hand-worked values, streaming, merging, the threshold law and
the percentile error bound."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moelab import maps
from moelab.diagnostics import FIELDS, GAP_BIN, ModelRoutingStats, RoutingStats, routing_stats
from moelab.routing import Router, RouterConfig, RouterOutput


def make_output(logits, probs, ids, weights, selected=None, dropped=None) -> RouterOutput:
    logits_TE = torch.tensor(logits, dtype=torch.float32)
    ids_TK = torch.tensor(ids, dtype=torch.int64)
    sel = torch.ones_like(ids_TK, dtype=torch.bool) if selected is None else selected
    drop = torch.zeros_like(ids_TK, dtype=torch.bool) if dropped is None else dropped
    return RouterOutput(
        scores_TE=logits_TE.clone(),
        logits_TE=logits_TE,
        probs_TE=torch.tensor(probs, dtype=torch.float32),
        ids_TK=ids_TK,
        weights_TK=torch.tensor(weights, dtype=torch.float32),
        selected_TK=torch.as_tensor(sel, dtype=torch.bool),
        dropped_TK=torch.as_tensor(drop, dtype=torch.bool),
        aux_loss=torch.zeros(()),
    )


def slice_output(out: RouterOutput, sl: slice) -> RouterOutput:
    return RouterOutput(
        scores_TE=out.scores_TE[sl],
        logits_TE=out.logits_TE[sl],
        probs_TE=out.probs_TE[sl],
        ids_TK=out.ids_TK[sl],
        weights_TK=out.weights_TK[sl],
        selected_TK=out.selected_TK[sl],
        dropped_TK=out.dropped_TK[sl],
        aux_loss=out.aux_loss,
    )


def layer0() -> RouterOutput:
    """T=5, E=4, K=2.

    t  logits               probs                 ids    weights    support gap  discarded
    0  [2, 1, 0, -1]        [.6, .3, .1, 0]       [0,1]  [.6, .3]   3       1.0  0.1
    1  [3, .5, 0, .5]       [1, 0, 0, 0]          [0,3]  [1, 0]     1       2.5  0   (filler e3)
    2  [0, 1, 1, 0]         [0, .5, .5, 0]        [1,2]  [.5, .5]   2       0.0  0   (tie)
    3  [-1, 1, 0, .5]       [.1, .4, .2, .3]      [1,3]  [.4, .3]   4       0.5  0.3 (e3 dropped)
    4  [0, 0, 1.5, 0]       [.2, 0, .8, 0]        [2,0]  [.8, .2]   2       1.5  0
    """
    dropped = torch.zeros(5, 2, dtype=torch.bool)
    dropped[3, 1] = True
    return make_output(
        logits=[[2, 1, 0, -1], [3, 0.5, 0, 0.5], [0, 1, 1, 0], [-1, 1, 0, 0.5], [0, 0, 1.5, 0]],
        probs=[
            [0.6, 0.3, 0.1, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [0.0, 0.5, 0.5, 0.0],
            [0.1, 0.4, 0.2, 0.3],
            [0.2, 0.0, 0.8, 0.0],
        ],
        ids=[[0, 1], [0, 3], [1, 2], [1, 3], [2, 0]],
        weights=[[0.6, 0.3], [1.0, 0.0], [0.5, 0.5], [0.4, 0.3], [0.8, 0.2]],
        dropped=dropped,
    )


def layer1() -> RouterOutput:
    """T=4, E=4, K=2: every state a singleton, the runner-up slot a filler.

    gaps 2, 2.5, 4, 2; hand-worked values in EXPECTED1."""
    return make_output(
        logits=[[2, 0, 0, 0], [0, 2.5, 0, 0], [0, 0, 4, 0], [0, 0, 0, 2]],
        probs=[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
        ids=[[0, 1], [1, 0], [2, 0], [3, 0]],
        weights=[[1, 0], [1, 0], [1, 0], [1, 0]],
    )


# hand-worked statistics of layer0 (map entmax-1.5: threshold 2)
EXPECTED0 = {
    "states": 5,
    "discarded_mass": (0.1 + 0.3) / 5,  # 0.08
    "contributors": 9 / 5,  # positive-weight selected slots: 2+1+2+2+2 (dropped counts)
    "active_experts": 8 / 5,  # computed: the dropped slot of t3 does not run
    "singleton_rate": 1 / 5,  # t1
    "pair_rate": 2 / 5,  # t2, t4
    "discarded_mass_support_ge3": (0.1 + 0.3) / 2,  # t0 (support 3), t3 (support 4)
    # nominal load [3, 3, 2, 2]: mean 2.5, std 0.5
    "nominal_cv": 0.5 / 2.5,
    # contributor load [3, 3, 2, 1] (filler e3 of t1 removed): mean 2.25, var 0.6875
    "contrib_cv": math.sqrt(0.6875) / 2.25,
    "contrib_sd": math.sqrt(0.6875) / 9,  # shares = load / 9
    # computed load [3, 3, 2, 0] (dropped e3 of t3 removed): mean 2, var 1.5
    "load_cv": math.sqrt(1.5) / 2,
    "load_rel_var": 1.5 / 4,
    "load_max_mean": 3 / 2,
    "dead_experts": 1,
    "load_shares": [3 / 8, 3 / 8, 2 / 8, 0.0],
    "dropped_fraction": 1 / 10,
    "dropped_tokens": 0.0,  # t3 keeps e1: one slot dropped is not a dropped token
    # squared centred scores per token: 5, 5.5, 1, 2.1875, 1.6875 -> 15.375 over 20 entries
    "score_rms": math.sqrt(15.375 / 20),
    # gaps sorted [0, .5, 1, 1.5, 2.5]: p50 = 1, p90 at pos 3.6 -> 2.1, p99 at 3.96 -> 2.46
    "gap_p50": 1.0,
    "gap_p90": 2.1,
    "gap_p99": 2.46,
    "frac_gap_ge1": 3 / 5,
    "frac_gap_ge2": 1 / 5,
    "frac_gap_ge_threshold": 1 / 5,  # threshold 2 -> equals the singleton rate here
    "threshold": 2.0,
}

# layer1: discarded 0, 1 contributor (fillers), all singletons, no support >= 3;
# nominal load [4, 2, 1, 1] (e0 as filler 3x), contributor/computed load [1, 1, 1, 1]
EXPECTED1 = {
    "states": 4,
    "discarded_mass": 0.0,
    "contributors": 1.0,
    "active_experts": 1.0,
    "singleton_rate": 1.0,
    "pair_rate": 0.0,
    "discarded_mass_support_ge3": None,
    "nominal_cv": math.sqrt(1.5) / 2,  # mean 2, var (4 + 0 + 1 + 1) / 4
    "contrib_cv": 0.0,
    "contrib_sd": 0.0,
    "load_cv": 0.0,
    "load_rel_var": 0.0,
    "load_max_mean": 1.0,
    "dead_experts": 0,
    "load_shares": [0.25] * 4,
    "dropped_fraction": 0.0,
    "dropped_tokens": 0.0,
    # centred: each row [x, 0, 0, 0] with mean x/4 -> sum of squares 3x^2/4
    "score_rms": math.sqrt(0.75 * (4 + 6.25 + 16 + 4) / 16),
    # gaps sorted [2, 2, 2.5, 4]: p50 at pos 1.5 -> 2.25, p90 at 2.7 -> 3.55, p99 at 2.97 -> 3.955
    "gap_p50": 2.25,
    "gap_p90": 3.55,
    "gap_p99": 3.955,
    "frac_gap_ge1": 1.0,
    "frac_gap_ge2": 1.0,
    "frac_gap_ge_threshold": 1.0,
    "threshold": 2.0,
}


def assert_fields(got: dict, expected: dict, tol: float = 1e-6) -> None:
    for key, want in expected.items():
        have = got[key]
        if want is None:
            assert have is None, key
        elif isinstance(want, list):
            assert have == pytest.approx(want, abs=tol), key
        else:
            assert have == pytest.approx(want, abs=tol), key


def test_layer_hand_worked():
    res = RoutingStats("entmax", 1.5).update(layer0()).result()
    assert_fields(res, EXPECTED0)
    # counts are exact
    assert res["contributors"] == 9 / 5 and res["singleton_rate"] == 1 / 5
    assert res["frac_gap_ge1"] == 3 / 5


def test_second_layer_hand_worked():
    assert_fields(RoutingStats("entmax", 1.5).update(layer1()).result(), EXPECTED1)


def test_model_result_mean_over_layers():
    res = routing_stats([layer0(), layer1()], "entmax", 1.5)
    assert res["map"] == "entmax"
    assert [lay["layer"] for lay in res["layers"]] == [0, 1]
    assert_fields(res["layers"][0], EXPECTED0)
    assert_fields(res["layers"][1], EXPECTED1)
    mean = res["mean"]
    assert set(FIELDS) <= set(mean)
    assert mean["discarded_mass"] == pytest.approx(0.04)
    assert mean["contributors"] == pytest.approx(1.4)
    assert mean["singleton_rate"] == pytest.approx(0.6)
    # undefined in layer 1: averaged over the layers where it is defined
    assert mean["discarded_mass_support_ge3"] == pytest.approx(0.2)
    assert mean["threshold"] == 2.0
    assert mean["gap_p50"] == pytest.approx((1.0 + 2.25) / 2)


def test_result_is_json_and_checks_inputs():
    res = routing_stats([layer0(), layer1()], "entmax", 1.5)
    assert json.loads(json.dumps(res, allow_nan=False)) == res
    with pytest.raises(ValueError, match="router outputs"):
        ModelRoutingStats(2, "sparsemax").update([layer0()])
    with pytest.raises(ValueError, match="different maps"):
        RoutingStats("sparsemax").merge(RoutingStats("entmax", 1.5))
    wide = make_output([[0, 1, 2, 3, 4]], [[0, 0, 0, 0, 1]], [[4, 3]], [[1, 0]])
    with pytest.raises(ValueError, match="experts"):
        RoutingStats("sparsemax").update(layer0()).update(wide)


def test_softmax_threshold_none_and_empty():
    res = RoutingStats("softmax").update(layer0()).result()
    assert res["threshold"] is None and res["frac_gap_ge_threshold"] is None
    assert RoutingStats("sparsemax").update(layer0()).result()["frac_gap_ge_threshold"] == 0.6
    empty = RoutingStats("sparsemax").result()
    assert empty["discarded_mass"] is None and empty["gap_p50"] is None
    assert empty["load_cv"] is None


def test_lapsum_discarded_mass_relative_to_k():
    # values sum to k = 2; selected mass 1.5 -> discarded 1 - 1.5 / 2 = 0.25
    out = make_output(
        logits=[[2, 1, 0, -1]],
        probs=[[0.9, 0.6, 0.3, 0.2]],
        ids=[[0, 1]],
        weights=[[0.9, 0.6]],
    )
    res = RoutingStats("lapsum").update(out).result()
    assert res["discarded_mass"] == pytest.approx(0.25)
    assert res["threshold"] is None


def _assert_same(a: dict, b: dict, tol: float = 1e-12) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], abs=tol, rel=0), key
        else:
            assert a[key] == b[key], key


def _random_output(seed: int, T: int = 600, capacity: float | None = 1.0) -> RouterOutput:
    torch.manual_seed(seed)
    cfg = RouterConfig(d_model=16, n_experts=8, top_k=2, map="sparsemax", capacity_factor=capacity)
    router = Router(cfg).eval()
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        return router(torch.randn(T, 16))


def test_streaming_and_merge_equal_one_shot():
    outs = [layer0(), _random_output(0)]
    one_shot = ModelRoutingStats(2, "sparsemax").update(outs).result()

    streamed = ModelRoutingStats(2, "sparsemax")
    bounds = [(0, 2), (2, 3), (3, 5)]
    cuts = [(0, 100), (100, 350), (350, 600)]
    for (a, b), (c, d) in zip(bounds, cuts, strict=True):
        streamed.update([slice_output(outs[0], slice(a, b)), slice_output(outs[1], slice(c, d))])
    _assert_same(streamed.result()["mean"], one_shot["mean"])
    for s, o in zip(streamed.result()["layers"], one_shot["layers"], strict=True):
        _assert_same(s, o)
        # exact counts and means of integer counts
        for key in ("states", "contributors", "singleton_rate", "pair_rate", "frac_gap_ge1"):
            assert s[key] == o[key]
        for key in ("gap_p50", "gap_p90", "gap_p99"):
            assert s[key] == o[key]

    # merge of accumulators of disjoint chunks (e.g. ranks)
    parts = []
    for (a, b), (c, d) in zip(bounds, cuts, strict=True):
        acc = ModelRoutingStats(2, "sparsemax")
        acc.update([slice_output(outs[0], slice(a, b)), slice_output(outs[1], slice(c, d))])
        parts.append(acc)
    merged = parts[0].merge(parts[1]).merge(parts[2]).result()
    _assert_same(merged["mean"], one_shot["mean"])
    for m, o in zip(merged["layers"], one_shot["layers"], strict=True):
        _assert_same(m, o)

    # the one-shot function with chunk lists
    chunked = routing_stats(
        [[slice_output(outs[0], slice(a, b)) for a, b in bounds], outs[1]], "sparsemax"
    )
    _assert_same(chunked["mean"], one_shot["mean"])


def test_router_output_with_capacity_drops():
    out = _random_output(1, T=400, capacity=0.8)
    res = RoutingStats("sparsemax").update(out).result()
    n_sel = int(out.selected_TK.sum())
    assert res["dropped_fraction"] == int(out.dropped_TK.sum()) / n_sel > 0
    assert res["active_experts"] == int(out.computed_TK.sum()) / 400
    assert res["active_experts"] < res["contributors"]
    assert sum(res["load_shares"]) == pytest.approx(1.0)


def test_dropped_tokens_hand_worked():
    """T=5, E=3, K=2; a token is dropped when every slot it was routed to was refused.

    t  ids    weights   dropped slots   dropped token?
    0  [0,1]  [.6,.4]   [1, 1]          yes: both refused
    1  [0,2]  [.7,.3]   [1, 0]          no: e2 computed
    2  [1,2]  [.5,.5]   [0, 0]          no
    3  [2,0]  [1., 0]   [1, 0]          yes: e0 is a filler (weight 0, never computed)
    4  [1,0]  [.9,.1]   [0, 1]          no
    dropped slots 5 of 10 selected; dropped tokens 2 of 5.
    """
    probs = [[0.6, 0.4, 0.0], [0.7, 0.0, 0.3], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0], [0.1, 0.9, 0.0]]
    dropped = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 0], [0, 1]], dtype=torch.bool)
    out = make_output(
        probs,
        probs,
        [[0, 1], [0, 2], [1, 2], [2, 0], [1, 0]],
        [[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [1.0, 0.0], [0.9, 0.1]],
        dropped=dropped,
    )
    res = RoutingStats("sparsemax").update(out).result()
    assert res["dropped_fraction"] == 5 / 10
    assert res["dropped_tokens"] == 2 / 5
    # top-1: one selected slot per token, so the two shares agree
    top1 = make_output(
        probs,
        probs,
        [[0], [0], [1], [2], [1]],
        [[0.6], [0.7], [0.5], [1.0], [0.9]],
        dropped=dropped[:, :1],
    )
    res1 = RoutingStats("sparsemax").update(top1).result()
    assert res1["dropped_fraction"] == res1["dropped_tokens"] == 3 / 5


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("sparsemax", lambda z: maps.sparsemax(z)),
        ("entmax", lambda z: maps.entmax(z, 1.5)),
        ("normmax", lambda z: maps.normmax(z, 2.0)),
    ],
)
def test_singleton_rate_equals_fraction_at_threshold(name, fn):
    g = torch.Generator().manual_seed(3)
    logits = 1.5 * torch.randn(3000, 8, generator=g)
    probs = fn(logits)
    ids = logits.topk(2, dim=-1).indices
    out = RouterOutput(
        scores_TE=logits,
        logits_TE=logits,
        probs_TE=probs,
        ids_TK=ids,
        weights_TK=probs.gather(1, ids),
        selected_TK=torch.ones_like(ids, dtype=torch.bool),
        dropped_TK=torch.zeros_like(ids, dtype=torch.bool),
        aux_loss=torch.zeros(()),
    )
    alpha = {"entmax": 1.5, "normmax": 2.0}.get(name)
    res = RoutingStats(name, alpha).update(out).result()
    assert 0 < res["singleton_rate"] < 1
    assert res["singleton_rate"] == res["frac_gap_ge_threshold"]


def test_percentiles_against_numpy():
    g = torch.Generator().manual_seed(7)
    logits = 2.0 * torch.randn(20000, 6, generator=g)
    logits[:50] *= 100  # some gaps beyond the histogram range (kept exactly)
    logits[50:80] = 0.0  # exact ties: gap 0
    T = logits.shape[0]
    ids = logits.topk(2, dim=-1).indices
    probs = maps.softmax(logits)
    out = RouterOutput(
        scores_TE=logits,
        logits_TE=logits,
        probs_TE=probs,
        ids_TK=ids,
        weights_TK=probs.gather(1, ids),
        selected_TK=torch.ones_like(ids, dtype=torch.bool),
        dropped_TK=torch.zeros_like(ids, dtype=torch.bool),
        aux_loss=torch.zeros(()),
    )
    top2 = logits.double().topk(2, dim=-1).values.numpy()
    gaps = top2[:, 0] - top2[:, 1]
    acc = RoutingStats("softmax")
    for a in range(0, T, 7000):
        acc.update(slice_output(out, slice(a, a + 7000)))
    for q in (0, 1, 10, 50, 90, 99, 99.9, 100):
        err = abs(acc.gap_percentile(q) - np.percentile(gaps, q))
        assert err <= GAP_BIN / 2 + 1e-9 < 0.01, q
    res = acc.result()
    assert res["frac_gap_ge1"] == float(np.mean(gaps >= 1))
    assert res["frac_gap_ge2"] == float(np.mean(gaps >= 2))
    assert res["gap_p99"] == acc.gap_percentile(99)
    assert acc.gap_percentile(0) == 0.0  # ties are exact
    assert acc.overflow  # gaps >= GAP_MAX were kept exactly
    assert acc.gap_percentile(100) == gaps.max()


def test_stats_names_one_thing() -> None:
    """``moelab.diagnostics.stats`` is the stats command's function (in run_stats); the
    streaming accumulators live in ``moelab.diagnostics.accumulators``, so no module of
    that name hides behind the function."""
    import importlib.util

    import moelab.diagnostics as diagnostics
    from moelab.diagnostics import accumulators, run_stats

    assert diagnostics.stats is run_stats.stats and callable(diagnostics.stats)
    assert importlib.util.find_spec("moelab.diagnostics.stats") is None
    assert diagnostics.RoutingStats is accumulators.RoutingStats
