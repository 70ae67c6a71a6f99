"""Which slots the Switch balance loss counts in f (RouterConfig.aux_count): every selected
slot ("all", the default) or each token's top-1 expert ("top1", the temperature-gating
paper's eq. 6), against hand computations in float64."""

from __future__ import annotations

import pytest
import torch

from moelab.routing import Router, RouterConfig, balancing, losses

# T = 4, E = 3, K = 2. Token 3's slots are not in rank order: its top-1 (e2, 0.5) is slot 1.
PROBS = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5], [0.4, 0.1, 0.5]]
IDS = [[0, 1], [1, 2], [2, 1], [0, 2]]
# P = column means: e0 1.2 / 4 = 0.3, e1 1.3 / 4 = 0.325, e2 1.5 / 4 = 0.375
# top1: e0 (t0), e1 (t1), e2 (t2, t3) -> f = [1/4, 1/4, 2/4]
#   L = 3 (0.25 * 0.3 + 0.25 * 0.325 + 0.5 * 0.375) = 3 * 0.34375
# all: e0 x2, e1 x3, e2 x3 of 8 slots -> f = [2/8, 3/8, 3/8]
#   L = 3 (0.25 * 0.3 + 0.375 * 0.325 + 0.375 * 0.375) = 3 * 0.3375
EXPECTED = {"top1": 3 * 0.34375, "all": 3 * 0.3375}


def _routed(chosen: list[list[bool]] | None = None) -> losses.Routed:
    probs_TE = torch.tensor(PROBS, dtype=torch.float64)
    ids_TK = torch.tensor(IDS)
    chosen_TK = torch.ones(4, 2, dtype=torch.bool) if chosen is None else torch.tensor(chosen)
    return losses.Routed(probs_TE.log(), probs_TE, ids_TK, chosen_TK, probs_TE.gather(-1, ids_TK))


@pytest.mark.parametrize("count", ["top1", "all"])
def test_switch_loss_counts_as_asked(count: str) -> None:
    cfg = losses.BalancingConfig(n_experts=3, n_scored=3, aux_count=count)
    loss = losses.get("switch")(cfg)(_routed())
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(EXPECTED[count], abs=1e-15)


def test_top1_slots_by_map_value_not_slot_order() -> None:
    r = _routed([[True, True], [True, True], [False, True], [False, False]])
    got = balancing.top1_slots(r.probs_TE, r.ids_TK, r.chosen_TK)
    # t2: slot 0 not chosen, so its top-1 is slot 1; t3: nothing chosen, nothing counted
    assert got.tolist() == [[True, False], [True, False], [False, True], [False, False]]
    r = _routed()
    got = balancing.top1_slots(r.probs_TE, r.ids_TK, r.chosen_TK)
    assert got.tolist() == [[True, False], [True, False], [True, False], [False, True]]


def test_top1_of_a_top1_router_is_the_default_loss() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    outs = {}
    for count in ("top1", "all"):
        torch.manual_seed(1)
        router = Router(RouterConfig(d_model=8, n_experts=4, top_k=1, aux_count=count))
        outs[count] = router(x).losses["switch"]
    assert torch.equal(outs["top1"], outs["all"])


def test_router_with_top1_counts_and_validation() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    torch.manual_seed(1)
    router = Router(RouterConfig(d_model=8, n_experts=4, top_k=2, aux_count="top1"))
    out = router(x)
    # the same loss by hand: f from each token's argmax of p, P the mean of p
    p = out.probs_TE.detach().double()
    f = torch.bincount(p.argmax(-1), minlength=4).double() / 16
    want = float(4 * (f * p.mean(0)).sum())
    assert float(out.losses["switch"].detach()) == pytest.approx(want, 1e-6)
    with pytest.raises(ValueError, match="aux_count must be one of"):
        RouterConfig(d_model=8, n_experts=4, aux_count="top2")
