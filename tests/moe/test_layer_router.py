"""The MoE layer with the real router: the sorted dispatch against a plain
per-token loop, for several maps, K, capacity limits, fillers and truncation."""

from __future__ import annotations

import pytest
import torch

from moelab import MoE, MoEConfig, RouterConfig
from moelab.moe import dispatch_combine

ROUTERS = {
    "softmax": {"map": "softmax"},
    "sparsemax": {"map": "sparsemax"},  # K=4: fillers
    "entmax": {"map": "entmax", "alpha": 1.5},
    "normmax": {"map": "normmax", "alpha": 2.0},
    "lapsum-threshold": {
        "map": "lapsum",
        "lapsum_k": 2.0,
        "selection": "threshold",
        "threshold": 0.3,
        "cap_factor": 2.0,
    },
}


def reference(x_TD: torch.Tensor, out, experts) -> torch.Tensor:
    """y_t = sum over computed slots of w * expert(x_t), one token at a time."""
    rows = []
    for t in range(x_TD.shape[0]):
        y = x_TD.new_zeros(x_TD.shape[1])
        for k in range(out.ids_TK.shape[1]):
            if out.computed_TK[t, k]:
                e = int(out.ids_TK[t, k])
                y = y + out.weights_TK[t, k] * experts.forward_expert(e, x_TD[t : t + 1])[0]
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_dispatch_matches_per_token_reference(router: str, top_k: int, capacity_factor) -> None:
    torch.manual_seed(top_k)
    rc = RouterConfig(
        d_model=8,
        n_experts=6,
        top_k=top_k,
        init_std=1.0,
        capacity_factor=capacity_factor,
        **ROUTERS[router],
    )
    moe = MoE(MoEConfig(d_model=8, d_ff=12, router=rc)).double()
    x = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    out = moe.router(x)
    if capacity_factor is not None:
        assert out.dropped_TK.any()
    y = dispatch_combine(x, out.ids_TK, out.weights_TK, out.computed_TK, moe.experts)
    y_ref = reference(x, out, moe.experts)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-10)
    g = torch.randn_like(y)
    params = [x, moe.router.weight, *moe.experts.parameters()]
    grads = torch.autograd.grad((y * g).sum(), params, retain_graph=True, allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), params, allow_unused=True)
    for a, b in zip(grads, grads_ref, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)
    # and the layer itself computes exactly this
    y_layer, _ = moe(x)
    torch.testing.assert_close(y_layer, y, atol=1e-12, rtol=1e-10)


def test_fillers_are_counted_but_not_computed() -> None:
    torch.manual_seed(0)
    rc = RouterConfig(d_model=8, n_experts=6, top_k=4, map="sparsemax", init_std=2.0)
    moe = MoE(MoEConfig(d_model=8, d_ff=12, router=rc))
    _, out = moe(torch.randn(64, 8))
    assert out.fillers_TK.any()
    assert out.selected_TK.all()
    assert not (out.computed_TK & out.fillers_TK).any()


def test_design_contract() -> None:
    rc = RouterConfig(d_model=64, n_experts=8, top_k=2, map="entmax", alpha=1.5, renorm=False)
    moe = MoE(MoEConfig(d_model=64, d_ff=128, router=rc))
    x = torch.randn(2, 5, 64)
    y, out = moe(x)
    assert y.shape == x.shape
    for name in ("scores_TE", "probs_TE", "ids_TK", "weights_TK", "aux_loss"):
        assert hasattr(out, name)
