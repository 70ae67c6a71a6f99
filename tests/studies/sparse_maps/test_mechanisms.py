"""The sparse-maps study's measures of issue 44, by hand: gradient saturation on a tiny
router, the contributors' dip and return, the spread ratios, the paper's numbers; and
each new finding on planted results where it holds and where it is contradicted."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moelab.routing.config import RouterConfig
from moelab.routing.router import Router
from moelab.studies.sparse_maps import grid
from moelab.studies.sparse_maps.findings import (
    contributor_return,
    new_findings,
    spread_ratios,
)
from moelab.studies.sparse_maps.paper import PAPER, paper_table
from moelab.studies.sparse_maps.saturation import shares, sums

# two tokens, three experts, identity scorer: scores = x
X = [[3.0, 0.5, 0.0], [0.6, 0.2, 0.0]]  # gaps 2.5 (past 1 and 2) and 0.4
V = [[2.0, -1.0], [0.5, 3.0]]  # the loss: sum_t,k w_tk * V_tk, so dL/dw = V


def _router(map_name: str, aux_probs: str = "map") -> Router:
    cfg = RouterConfig(
        d_model=3, n_experts=3, top_k=2, map=map_name, aux_weight=0.01, aux_probs=aux_probs
    )
    r = Router(cfg).eval()
    with torch.no_grad():
        r.weight.copy_(torch.eye(3))
    return r


def _sums(router: Router, threshold: float) -> dict[str, float]:
    out = router(torch.tensor(X))
    loss = (out.weights_TK * torch.tensor(V)).sum()
    return sums([out], loss, out.aux_loss, threshold)[0]


@pytest.mark.parametrize("map_name,theta", [("sparsemax", 1.0), ("normmax", 1.0), ("entmax", 2.0)])
def test_saturation_by_hand_on_a_tiny_router(map_name: str, theta: float) -> None:
    s = _sums(_router(map_name), theta)
    # token 0 (gap 2.5) is past the threshold: top-1 signal |2|; token 1: |0.5|
    assert (s["tokens"], s["past"]) == (2.0, 1.0)
    assert s["u"] == pytest.approx(2.5, abs=1e-12) and s["u_past"] == pytest.approx(2.0)
    sh = shares(s)
    assert sh["token_share_past"] == 0.5 and sh["lost_share"] == pytest.approx(0.8)
    # the saturated token sends the scores nothing; the other one does
    assert s["gz_past"] == 0.0 and s["gz"] > 0 and sh["passed_share_past"] == 0.0
    # a balance loss on the map's probabilities saturates as well
    assert s["ga_past"] == 0.0


def test_saturation_score_gradient_by_hand_for_sparsemax() -> None:
    """Token 1 has the full support {0, 1, 2} under sparsemax (z = 0.6, 0.2, 0: tau =
    -1/15), where the Jacobian is I - 11^T/3: dL/dz = u - mean(u) with u = (0.5, 3, 0)
    (expert 2 is not selected, its weight is in no loss)."""
    s = _sums(_router("sparsemax"), 1.0)
    u = [0.5, 3.0, 0.0]
    mean = sum(u) / 3
    assert s["gz"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in u)), rel=1e-6)


def test_a_softmax_balance_keeps_a_gradient_past_the_threshold() -> None:
    s = _sums(_router("sparsemax", aux_probs="softmax"), 1.0)
    assert s["gz_past"] == 0.0  # the LM loss still saturates
    assert s["ga_past"] > 0 and shares(s)["aux_share_past"] > 0


def test_a_map_that_does_not_saturate_is_caught() -> None:
    """Planted: softmax read with sparsemax's threshold passes gradient past it."""
    s = _sums(_router("softmax"), 1.0)
    assert s["past"] == 1.0 and s["gz_past"] > 0 and shares(s)["passed_share_past"] > 0


def test_contributor_return_by_hand() -> None:
    xs = [float(10 * i) for i in range(1, 21)]  # 20 rows, 10..200 tokens
    ys = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.75, 1.85, 1.9] + [1.9] * 10
    r = contributor_return(xs, ys)
    assert r is not None
    # end: rows with tokens > 180 (190, 200); dip: lowest mean of 5 rows among the first 18
    assert r["end"] == pytest.approx(1.9)
    assert r["dip"] == pytest.approx((1.7 + 1.6 + 1.5 + 1.4 + 1.75) / 5)  # rows 4-8
    assert r["dip_tokens"] == 80.0 and r["return"] == pytest.approx(1.9 - 1.59)
    # still falling at the end: a negative return
    falling = contributor_return(xs, [2.0 - 0.01 * i for i in range(20)])
    assert falling is not None and falling["return"] < 0
    assert contributor_return(xs[:4], ys[:4]) is None and contributor_return([], []) is None


def test_spread_ratios_by_hand() -> None:
    ent = {"layers": [{"block": 1, "score_rms": 0.5}, {"block": 3, "score_rms": 0.3}]}
    soft = {"layers": [{"block": 3, "score_rms": 0.6}, {"block": 1, "score_rms": 1.0}]}
    assert spread_ratios(ent, soft) == pytest.approx([0.5, 0.5])
    assert spread_ratios({"layers": [{"block": 1, "score_rms": None}]}, soft) is None


# -------------------------------------------------------------- planted findings


def _seed(
    rms: tuple[float, float],
    singles: float,
    ret: float | None,
    passed: float = 0.0,
    past: float = 0.1,
) -> dict[str, Any]:
    return {
        "layers": [{"block": 1, "score_rms": rms[0]}, {"block": 3, "score_rms": rms[1]}],
        "mean": {"singleton_rate": singles},
        "trajectory": None if ret is None else {"return": ret, "end": 2.0, "dip": 2.0 - ret},
        "saturation": {
            "mean": {"passed_share_past": passed, "token_share_past": past, "lost_share": 0.2}
        },
    }


def _planted(holds: bool) -> dict[str, list[dict[str, Any]]]:
    """Three seeds of each map: where the claims hold (entmax half softmax's spread,
    entmax returns, normmax more singletons, saturation) or where each is contradicted."""
    s = 1.0 if holds else -1.0
    soft = [_seed((1.0, 1.0), 0.0, None) for _ in range(3)]
    ent = [
        _seed(
            (0.5 if holds else 1.5, 0.45 if holds else 1.6 + 0.01 * i), 0.01, s * (0.1 + 0.01 * i)
        )
        for i in range(3)
    ]
    sparse = [_seed((0.4, 0.4), 0.10 + 0.01 * i, 0.0, 0.0 if holds else 0.3) for i in range(3)]
    normmax = [
        _seed((0.5, 0.5), 0.10 + 0.01 * i + s * 0.1, 0.0, 0.0 if holds else 0.2) for i in range(3)
    ]
    return {"softmax": soft, "entmax15": ent, "sparsemax": sparse, "normmax2": normmax}


@pytest.mark.parametrize("holds", [True, False])
def test_new_findings_come_out_either_way(holds: bool) -> None:
    found = {f.key: f for f in new_findings(_planted(holds))}
    expected = "holds" if holds else "contradicted"
    for key in (
        "score_spread_entmax15_vs_softmax",
        "contributors_return_entmax15",
        "singletons_normmax2_vs_sparsemax",
        "saturation_sparsemax",
        "saturation_normmax2",
    ):
        assert found[key].verdict == expected, key
    # entmax's saturation is planted exact (0) both times
    assert found["saturation_entmax15"].verdict == "holds"
    spread = found["score_spread_entmax15_vs_softmax"]
    # the effect is the largest layer ratio minus 1, seed by seed
    if holds:
        assert spread.effect.values == pytest.approx((-0.5, -0.5, -0.5))
        assert spread.extra["mean_ratio"] == pytest.approx([0.475] * 3)


def test_findings_with_nothing_to_act_on_are_not_resolved() -> None:
    planted = _planted(True)
    for m in ("entmax15", "sparsemax", "normmax2"):
        for seed in planted[m]:
            seed["saturation"]["mean"]["token_share_past"] = 0.0
            seed["trajectory"] = None
    found = {f.key: f for f in new_findings(planted)}
    assert found["saturation_sparsemax"].verdict == "not resolved"
    assert found["contributors_return_entmax15"].verdict == "not measured"


# -------------------------------------------------------------- the paper's numbers


def test_the_paper_table_sets_the_papers_values_beside_the_study() -> None:
    def seed(i: int, m: int) -> dict[str, Any]:
        return {
            "nll": 3.0 + m,
            "mean": {
                "discarded_mass": 0.1 * m,
                "contributors": 2.0,
                "singleton_rate": 0.01 * m,
                "score_rms": 1.0 + m + i,
                "gap_p50": 0.5,
            },
            "sweep": {"nll_increase": 0.01 * m},
        }

    maps = ("softmax", "entmax15", "sparsemax", "normmax2")
    measured = {name: [seed(i, m) for i in range(2)] for m, name in enumerate(maps)}
    labels = dict(zip(maps, ("softmax", "1.5-entmax", "sparsemax", "2-normmax"), strict=True))

    def values(per_seed, fn):
        return [fn(x) for x in per_seed]

    columns, rows = paper_table(measured, labels, "moelab quick", values)
    assert [c[0] for c in columns][2] == "moelab quick"
    by = {(r["stat"], r["map"]): r for r in rows}
    assert by[("discarded mass (Table 2)", "sparsemax")]["p300m"] == "0.099"
    assert by[("s=1 % (Tables 2, 5)", "2-normmax")]["p1b"] == "21.256"
    assert by[("s=1 % (Tables 2, 5)", "2-normmax")]["moelab"] == pytest.approx([3.0, 3.0])
    assert by[("Delta NLL K=2 -> 8 (Table 3)", "softmax")]["p1b"] == "0.582"
    ratio = by[("RMS / softmax's RMS (Table 7)", "1.5-entmax")]
    # the paper's Table 7: 0.52 / 0.98 at 300M and 0.36 / 0.86 at 1B
    assert ratio["p300m"] == format(0.52 / 0.98, ".3f") and ratio["p1b"] == format(
        0.36 / 0.86, ".3f"
    )
    assert ratio["moelab"] == pytest.approx([2.0 / 1.0, 3.0 / 2.0])
    assert ("RMS / softmax's RMS (Table 7)", "softmax") not in by
    assert by[("validation loss (Table 1)", "softmax")]["p1b"] == "-"
    assert PAPER["nll_increase"]["300m"][2] == 0.004


def test_the_demo_keeps_its_four_arms_and_the_study_has_the_balanced_ones() -> None:
    for scale in ("quick", "cpu"):
        full = [a.name for a in grid.arms(scale, {})]
        demo = [a.name for a in grid.arms(scale, {"softmax_balanced": False})]
        assert demo == ["softmax", "entmax15", "sparsemax", "normmax2"]
        assert full == [*demo, "entmax15-sb", "sparsemax-sb", "normmax2-sb"]
        for arm in grid.arms(scale, {}):
            router = arm.config["model"]["router"]
            balanced = arm.name.endswith("-sb")
            assert router.get("aux_probs", "map") == ("softmax" if balanced else "map")
