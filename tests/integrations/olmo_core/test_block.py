"""moelab's router in OLMo-core's MoE block and Transformer: equivalence of the swap,
the aux-loss path, the config-level choice, training with every map, bad input.

OLMo-core's expert dispatch (``ParallelMLP``'s permute) is a Triton kernel that needs a
GPU driver; ``block.experts`` is replaced by the CPU stand-in of
:mod:`tests.integrations.olmo_core.experts` on the block's own expert weights, and the
rest of the block and model (router call, ``attach_auxiliary_loss``, shared MLP,
attention, norms) is OLMo-core's own code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.moe import MoEConfig
from olmo_core.nn.moe.router import MoERouter, MoERouterConfig
from olmo_core.nn.transformer.config import TransformerConfig
from torch import nn

from moelab.integrations.olmo_core import (
    MoelabRouter,
    MoelabRouterConfig,
    moelab_routers,
    swap_routers,
    use_moelab_routers,
)
from tests.integrations.olmo_core.experts import loop_experts

D, E, H, B, S = 16, 8, 16, 2, 6


def _block(gating="softmax", norm=None, bias=False, lb=None, z=None, top_k=2, router=None):
    torch.manual_seed(0)
    config = MoEConfig(
        num_experts=E,
        hidden_size=H,
        router=router
        or MoERouterConfig(
            top_k=top_k,
            gating_function=gating,
            normalize_expert_weights=norm,
            bias_gamma=0.01 if bias else None,
        ),
        shared_mlp=FeedForwardConfig(hidden_size=H, bias=False),
        lb_loss_weight=lb,
        z_loss_weight=z,
    )
    block = loop_experts(config.build(D))
    if block.router.score_bias is not None:
        block.router.score_bias.copy_(0.05 * torch.randn(E))
    return block


def _tiny_config():
    config = TransformerConfig.smallmoe(vocab_size=64, d_model=32, n_layers=2, n_heads=2)
    config.block.feed_forward_moe.num_experts = E
    config.block.feed_forward_moe.hidden_size = H
    return config


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return loop_experts(_tiny_config().build(init_device="cpu")).eval()


def test_the_block_needs_a_gpu_for_its_dispatch():
    """What this file works around: OLMo-core's own expert dispatch on the CPU."""
    block = MoEConfig(num_experts=E, hidden_size=H, router=MoERouterConfig(top_k=2)).build(D)
    with pytest.raises(RuntimeError, match="0 active drivers"):
        block(torch.randn(B, S, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("gating", "norm", "bias"),
    [
        ("softmax", None, False),
        ("softmax", 1.0, True),
        ("sigmoid", None, True),
        ("sigmoid", 1.0, False),
    ],
)
def test_block_forward_and_backward_unchanged(monkeypatch, dtype, gating, norm, bias):
    if dtype == torch.float64:  # the routers' float32 casts off: both run in float64
        monkeypatch.setattr(torch.Tensor, "float", lambda self: self)
    block = _block(gating, norm, bias).to(dtype).eval()
    swapped = copy.deepcopy(block)
    assert swap_routers(swapped) == ["router"]
    swapped.to(dtype)  # the moelab Router starts as a float32 copy
    x = torch.randn(B, S, D, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = block(x), swapped(x2)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert (y2 - y).abs().max().item() <= tol
    assert (x2.grad - x.grad).abs().max().item() <= tol
    for name, p in block.named_parameters():
        if name == "router.weight":  # OLMo-core's flat (E * D,) weight, moelab's (E, D)
            p2 = swapped.router.router.weight
            assert (p2.grad.flatten() - p.grad).abs().max().item() <= tol
        else:
            p2 = swapped.get_parameter(name)
            assert (p2.grad - p.grad).abs().max().item() <= tol, name


def test_model_logits_unchanged(tiny_model):
    ids = torch.randint(0, 64, (B, S))
    swapped = copy.deepcopy(tiny_model)
    names = swap_routers(swapped)
    assert names == ["blocks.0.feed_forward_moe.router", "blocks.1.feed_forward_moe.router"]
    with torch.no_grad():
        assert (swapped(ids) - tiny_model(ids)).abs().max().item() <= 1e-6


def test_aux_loss_reaches_the_router_through_the_block():
    """moelab's aux loss (here a LapSum router's Switch and z-loss) is the router's
    fourth output, which OLMo-core's block attaches to its activations: a backward of
    the block's output alone brings the aux loss's gradient to the router weight."""
    block = _block(lb=0.01, z=0.001)
    swap_routers(block, map="lapsum", lapsum_k=2.0, aux_weight=0.1, z_loss_weight=0.01)
    router = block.router
    assert isinstance(router, MoelabRouter) and router.router.aux_losses
    block.train()
    y = block(torch.randn(B, S, D))
    (y.sum() * 0).backward(retain_graph=True)  # the output's own gradient is zero
    assert router.last is not None
    (expected,) = torch.autograd.grad(router.last.aux_loss, router.router.weight)
    got = router.router.weight.grad
    assert got is not None and got.abs().sum().item() > 0
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-9)
    metrics = block.compute_metrics()
    assert {"moelab switch", "moelab z"} <= set(metrics)


@pytest.mark.parametrize(
    "keys",
    [
        {"map": "softmax"},
        {"map": "sigmoid"},
        {"map": "relu", "renorm": False},
        {"map": "sparsemax"},
        {"map": "entmax", "alpha": 1.5},
        {"map": "normmax"},
        {"map": "lapsum", "lapsum_k": 2.0},
    ],
    ids=lambda k: k["map"],
)
def test_every_map_trains_in_the_block(keys):
    block = _block(norm=1.0)
    swap_routers(block, aux_weight=0.01, **keys)
    block.train()
    torch.manual_seed(1)
    x = torch.randn(4, S, D)
    target = torch.tanh(x @ torch.randn(D, D) / D**0.5)
    opt = torch.optim.Adam(block.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = (block(x) - target).pow(2).mean()
        loss.backward()
        grad = block.router.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        block.post_batch()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_config_picks_a_moelab_router():
    block = _block(router=MoelabRouterConfig(top_k=2, moelab={"map": "entmax", "alpha": 1.5}))
    assert isinstance(block.router, MoelabRouter)
    assert block.router.router.config.alpha == 1.5
    assert block.router.router.config.aux_weight == 0.0  # the block's lb_loss_weight=None
    assert block(torch.randn(B, S, D)).shape == (B, S, D)

    config = _tiny_config()
    assert use_moelab_routers(config, map="sparsemax") == 1
    config = config.merge(["block.feed_forward_moe.router.moelab.map=normmax"])
    model = config.build(init_device="cpu")
    routers = moelab_routers(model)
    assert len(routers) == 2 and {r.router.config.map for r in routers} == {"normmax"}
    # the router's lb / z weights are OLMo-core's block weights, divided by the layers
    assert routers[0].router.config.aux_weight == pytest.approx(0.01 / 2)

    # a saved OLMo-core config names the class; a dotted override picks it
    plain = _tiny_config()
    picked = plain.merge(
        [
            "block.feed_forward_moe.router._CLASS_="
            "moelab.integrations.olmo_core.router.MoelabRouterConfig",
            "block.feed_forward_moe.router.moelab={map: entmax, alpha: 1.5}",
        ]
    )
    assert isinstance(picked.block.feed_forward_moe.router, MoelabRouterConfig)
    assert picked.block.feed_forward_moe.router.moelab == {"map": "entmax", "alpha": 1.5}
    assert picked.block.feed_forward_moe.router.top_k == 4  # smallmoe's, kept


def test_state_dict_round_trip(tmp_path):
    """A swapped block's state (the moelab Router's weight, selection bias, temperature,
    its K and cut) saved with torch.save loads into a fresh swap of the same keys."""
    keys = {"map": "entmax", "alpha": 1.5, "selection": "top_p", "top_p_cap": 2}
    block = _block(bias=True)
    swap_routers(block, **keys)
    with torch.no_grad():
        block.router.router.weight.mul_(3.0)
        block.router.router.bias.add_(0.1)
    torch.save(block.state_dict(), tmp_path / "block.pt")
    fresh = _block(bias=True)
    swap_routers(fresh, **keys)
    fresh.load_state_dict(torch.load(tmp_path / "block.pt"))
    x = torch.randn(B, S, D)
    block.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(block(x), fresh(x))
    assert torch.equal(fresh.router.router.bias, block.router.router.bias)


def test_config_without_keys_builds_the_engines_model():
    """OLMo-core's way to build: on the meta device, then ``init_weights``. A config
    whose routers are moelab's (no keys) gives the model OLMo-core's own config gives:
    the same initial weights and the same logits; the moelab Routers' buffers are set."""
    models = []
    for moelab in (False, True):
        config = _tiny_config()
        config.block.feed_forward_moe.router.bias_gamma = 0.01
        if moelab:
            use_moelab_routers(config)
        torch.manual_seed(0)
        model = config.build(init_device="meta")
        model.init_weights(device=torch.device("cpu"))
        models.append(loop_experts(model).eval())
    own, mine = models
    for r in moelab_routers(mine):
        assert torch.equal(r.router.bias, torch.zeros(E)) and r.router.temperature.tau == 1.0
    ids = torch.randint(0, 64, (B, S))
    with torch.no_grad():
        assert (own(ids) - mine(ids)).abs().max().item() <= 1e-6


def test_bad_input_one_line():
    def one_line(err: pytest.ExceptionInfo) -> str:
        text = str(err.value)
        assert "\n" not in text
        return text

    with pytest.raises(ValueError) as err:
        swap_routers(_block(), nap="entmax")
    assert "unknown router key 'nap' (did you mean 'map'?) for OLMo-core" in one_line(err)
    with pytest.raises(ValueError) as err:
        use_moelab_routers(_tiny_config(), alhpa=1.5)
    assert "unknown router key 'alhpa'" in one_line(err)
    with pytest.raises(ValueError) as err:
        swap_routers(_block().router)
    assert "for a lone router use moelab_router" in one_line(err)
    with pytest.raises(ValueError) as err:
        swap_routers(nn.Sequential(nn.Linear(D, D)))
    assert "has no OLMo-core MoERouter" in one_line(err)
    block = _block()
    swap_routers(block)
    with pytest.raises(ValueError) as err:
        swap_routers(block)
    assert "swapped already" in one_line(err)
    with pytest.raises(TypeError) as err:
        swap_routers("model")  # type: ignore[arg-type]
    assert "takes a torch module" in one_line(err)
    with pytest.raises(ValueError) as err:
        use_moelab_routers(
            TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=1, n_heads=2)
        )
    assert "holds no MoERouterConfig" in one_line(err)
    with pytest.raises(NotImplementedError) as err:
        block.router.apply_tp(None)
    assert "does not support OLMo-core's tensor parallelism" in one_line(err)
    block = _block()
    with pytest.raises(ValueError):
        swap_routers(block, selection="expert_choice")
    assert type(block.router) is not MoelabRouter and isinstance(block.router, MoERouter)
