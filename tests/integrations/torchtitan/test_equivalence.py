"""swap_routers with no keys reproduces torchtitan's own routing: the same expert ids
and, on the engine router's weights, the same MoE outputs and gradients (float64 <=
1e-12, float32 <= 1e-6) and the same logits of a whole DeepSeek-V3 model (float32:
FlexAttention runs float32 on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from moelab.integrations.torchtitan import swap_routers
from tests.integrations.torchtitan.tiny import VOCAB, build, moe_config, tiny_dsv3

# (score_func, route_norm, route_scale, num_expert_groups, num_limited_groups, top_k)
CASES = [
    ("softmax", False, 1.0, None, None, 2),
    ("softmax", True, 1.0, None, None, 2),
    ("sigmoid", False, 2.5, None, None, 2),
    ("sigmoid", True, 2.5, 4, 2, 3),
    ("softmax", True, 1.5, 4, 2, 3),
    ("sigmoid", False, 1.0, 2, 1, 2),
]
IDS = [f"{c[0]}-norm{int(c[1])}-scale{c[2]}-groups{c[3]}-k{c[5]}" for c in CASES]


def _bias(model: torch.nn.Module, seed: int) -> None:
    """A non-zero engine expert bias in every MoE (as its optimizer hook leaves it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias_E"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))


def _routing(model: torch.nn.Module, run) -> list[tuple[torch.Tensor, ...]]:
    """Each MoE router's (sorted ids, weights in that order, scores_BLE) during
    ``run()``."""
    got: list[tuple[torch.Tensor, ...]] = []

    def hook(module, args, out):
        ids_BLK, order = out[1].sort(-1)
        got.append((ids_BLK, out[0].gather(-1, order).detach(), out[2].detach()))

    handles = [
        m.router.register_forward_hook(hook)
        for m in model.modules()
        if hasattr(m, "router") and hasattr(m, "expert_bias_E")
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_moe_forward_backward(case, dtype, tol):
    score, norm, scale, groups, limited, k = case
    moe = build(moe_config(score, norm, scale, groups, limited, k), dtype)
    _bias(moe, 1)
    ours = copy.deepcopy(moe)
    assert swap_routers(ours) == ["router"]
    x = torch.randn(3, 7, 16, dtype=dtype, generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (moe, ours):
        xg = x.clone().requires_grad_(True)
        routing = _routing(m, lambda m=m, xg=xg: outs.append((m(xg), xg)))
        y, xg = outs[-1]
        (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
        grads = [xg.grad] + [p.grad for p in m.parameters()]
        outs[-1] = (y.detach(), grads, routing)
    (y_ref, g_ref, r_ref), (y, g, r) = outs
    assert torch.equal(r[0][0], r_ref[0][0])  # the same expert ids
    assert _rel(r[0][1], r_ref[0][1]) <= tol
    assert _rel(r[0][2], r_ref[0][2]) <= tol  # scores_BLE: the map's values over E
    assert _rel(y, y_ref) <= tol
    assert len(g) == len(g_ref)
    for a, b in zip(g, g_ref, strict=True):
        assert _rel(a, b) <= tol


def test_moe_top1_route_norm_forward():
    """K = 1 with route_norm: weight 1 (moelab's straight-through gate forward)."""
    moe = build(moe_config("sigmoid", True, 1.0, None, None, 1), torch.float64)
    _bias(moe, 3)
    ours = copy.deepcopy(moe)
    swap_routers(ours)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(ours(x), moe(x)) <= 1e-12


@pytest.mark.parametrize("case", CASES[:4], ids=IDS[:4])
def test_whole_model_logits(case):
    score, norm, scale, groups, limited, k = case
    model = build(tiny_dsv3(score, norm, scale, groups, limited, k), torch.float32)
    _bias(model, 4)
    ours = copy.deepcopy(model)
    assert swap_routers(ours) == ["layers.1.moe.router", "layers.2.moe.router"]
    ours.verify_module_protocol()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    masks = model.get_attention_masks(torch.arange(16).repeat(2, 1))
    got = {}
    for name, m in (("ref", model), ("ours", ours)):
        with torch.no_grad():
            got[name] = _routing(
                m,
                lambda m=m, name=name: got.__setitem__(
                    name + "_y", m(tokens, attention_masks=masks)
                ),
            )
    assert len(got["ref"]) == 2
    for (ids, w, _), (ids_ref, w_ref, _) in zip(got["ours"], got["ref"], strict=True):
        assert torch.equal(ids, ids_ref)
        assert _rel(w, w_ref) <= 1e-6
    assert _rel(got["ours_y"], got["ref_y"]) <= 1e-6
