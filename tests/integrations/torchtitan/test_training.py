"""moelab routers train inside torchtitan's MoE module on the CPU: every map and
selection rule the engine's dispatch holds; the aux losses reach the loss and the
router's gradient; the per-step state moves (temperature, ReLU's L1, learned k); the
torchtitan Module protocol (meta build, to_empty, init_states) holds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torchtitan.components.optimizer import default_adamw
from torchtitan.protocols.model import BaseModel

from moelab import Router, RouterConfig
from moelab.integrations.torchtitan import (
    MoelabRouter,
    MoelabRouterConverter,
    aux_loss,
    calibrate_routers,
    moelab_routers,
    register_router_steps,
    step_routers,
    swap_routers,
    with_aux_loss,
    with_router_steps,
)
from tests.integrations.torchtitan.tiny import VOCAB, build, moe_config, tiny_dsv3

KEYS = [
    {"map": "softmax"},
    {"map": "sigmoid"},
    {"map": "relu", "selection": "threshold", "l1_target": 2.0, "token_cap_factor": 1.0},
    {"map": "sparsemax"},
    {"map": "entmax", "alpha": 1.5},
    {"map": "normmax", "alpha": 2.0},
    {"map": "lapsum", "lapsum_k": 2.0},
    {"map": "lapsum", "lapsum_k": 1.5, "selection": "threshold", "token_cap_factor": 1.0},
    {"selection": "top_p", "top_p": 0.5, "top_p_cap": 2},
    {"selection": "sinkhorn"},
    {"capacity_factor": 1.0},
    {"n_null_experts": 2, "null_expert": "zero"},
    {"aux_weight": 0.01, "z_loss_weight": 1e-3},
    {"schedule": "lipschitz"},
    {"temperature": 2.0, "schedule": "cosine", "tau_final": 1.0, "anneal_steps": 3},
]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)


@pytest.mark.parametrize("keys", KEYS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_trains_in_engine_moe(keys):
    moe = build(moe_config(top_k=2))
    swap_routers(moe, **keys)
    x, target = _data()
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    losses, auxes = [], []
    for _ in range(6):
        loss = (moe(x) - target).square().mean()
        aux = aux_loss(moe)
        (loss + aux).backward()
        grad = moe.router.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
        step_routers(moe)
        losses.append(loss.item())
        auxes.append(aux.item())
    assert losses[-1] < losses[0]
    on = keys.get("aux_weight", 0) or keys.get("z_loss_weight", 0) or keys.get("l1_target")
    assert (auxes[0] > 0) == bool(on)


def test_aux_gradient_is_the_routers_own():
    """With aux_weight only, the wrapped loss's gradient in the gate weight is the
    gradient of a plain moelab Router's Switch loss on the same weight and tokens."""
    moe = build(moe_config(top_k=2))
    swap_routers(moe, aux_weight=0.1)
    x, _ = _data(1)
    loss_fn = with_aux_loss(lambda pred, labels, n=None: (0.0 * pred.sum(), {}), moe)
    loss, metrics = loss_fn(moe(x), torch.zeros(4, 8, dtype=torch.long))
    loss.backward()
    plain = Router(RouterConfig(**{**moe.router.router.config.__dict__}))
    with torch.no_grad():
        plain.weight.copy_(moe.router.gate.weight)
    out = plain(x.reshape(-1, 16), seq_len=8)
    (expected,) = torch.autograd.grad(out.aux_loss, plain.weight)
    assert metrics["moelab_aux_loss"] > 0
    torch.testing.assert_close(moe.router.gate.weight.grad, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(metrics["moelab_aux_loss"], out.aux_loss.detach())


def test_aux_loss_scaled_as_the_engine_scales_its_loss():
    moe = build(moe_config(top_k=2))
    swap_routers(moe, aux_weight=0.1)
    x, _ = _data(2)
    labels = torch.zeros(4, 8, dtype=torch.long)
    labels[0, :4] = -100  # 28 valid tokens of a global batch of 56
    loss_fn = with_aux_loss(lambda pred, labels, n=None: (0.0 * pred.sum(), {}), [moe])
    loss, _ = loss_fn(moe(x), labels, torch.tensor(56))
    torch.testing.assert_close(loss, aux_loss(moe) * 0.5)


def test_engine_bias_update_keeps_working():
    """The engine's expert_bias_E (moved by its optimizer hook) steers the swapped
    router's choice, and the routing map counts each token's K distinct experts."""
    moe = build(moe_config(top_k=2))
    swap_routers(moe, map="entmax", alpha=1.5)
    x, _ = _data(3)
    moe(x)
    assert moe.tokens_per_expert_E.sum() == 4 * 8 * 2
    with torch.no_grad():
        moe.expert_bias_E.copy_(torch.tensor([5.0] + [0.0] * 7))
    _, ids, _ = moe.router(x, moe.expert_bias_E)
    assert (ids == 0).any(-1).all()


def test_router_steps_as_optimizer_hook():
    """register_router_steps: the temperature schedule and ReLU's L1 coefficient move
    at each step of torchtitan's OptimizersContainer."""
    moe = build(moe_config(top_k=2))
    swap_routers(
        moe,
        map="relu",
        selection="threshold",
        l1_target=1.0,
        token_cap_factor=2.0,
        temperature=2.0,
        schedule="cosine",
        tau_final=1.0,
        anneal_steps=4,
    )
    optimizers = default_adamw(lr=1e-2).build(model_parts=[moe])
    register_router_steps(optimizers, [moe])
    router = moe.router.router
    x, target = _data(4)
    taus, coefs = [float(router.temperature.tau)], [float(router.l1_coef)]
    for _ in range(3):
        ((moe(x) - target).square().mean() + aux_loss(moe)).backward()
        optimizers.step()
        optimizers.zero_grad()
        taus.append(float(router.temperature.tau))
        coefs.append(float(router.l1_coef))
    assert taus[-1] < taus[0]
    assert coefs[-1] != coefs[0]


def test_learned_k_across_layers():
    """k_total: one allocator across the swapped layers, in the optimizer's params, whose
    k_l move with training (LapSum is differentiable in k)."""

    class TwoLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = build(moe_config(top_k=3))
            self.second = build(moe_config(top_k=3), seed=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(x + self.first(x))

    layers = TwoLayers()
    swap_routers(layers, map="lapsum", selection="threshold", token_cap_factor=1.0, k_total=4.0)
    allocator = layers.moelab_allocator
    torch.testing.assert_close(allocator(), torch.tensor([2.0, 2.0]))
    assert allocator.eta is next(iter(p for n, p in layers.named_parameters() if "eta" in n))
    opt = torch.optim.Adam(layers.parameters(), lr=5e-2)
    x, target = _data(5)
    for _ in range(5):
        (layers(x) - target).square().mean().backward()
        assert allocator.eta.grad is not None and allocator.eta.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
    k = allocator().detach()
    assert not torch.allclose(k, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(k.sum(), torch.tensor(4.0))


def test_module_protocol_meta_build_and_init_states():
    """A converter-built MoE on the meta device: verify_module_protocol passes (the
    trainer's check), to_empty + init_states give the gate its param_init and the
    Router fresh buffers, and a forward runs."""
    moe_cfg = moe_config(top_k=2)
    converted = (
        MoelabRouterConverter.Config(
            router_keys={"map": "entmax", "alpha": 1.5, "n_null_experts": 2}
        )
        .build()
        .convert(moe_cfg)
    )
    with torch.device("meta"):
        moe = converted.build()
    assert isinstance(moe.router, MoelabRouter)
    assert all(p.is_meta for p in moe.parameters())
    BaseModel.verify_module_protocol(moe)  # every submodule is a torchtitan Module
    moe.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        moe.init_states()
    router = moe.router.router
    assert torch.equal(router.bias, torch.zeros(10))
    assert float(router.temperature.tau) == 1.0
    assert 0.1 < float(moe.router.gate.weight.detach().std()) < 1.0  # the gate's param_init (0.5)
    assert router.null_weight.shape == (2, 16) and torch.isfinite(router.null_weight).all()
    y = moe(_data(6)[0])
    assert torch.isfinite(y).all()
    again = copy.deepcopy(moe)
    assert again.router.router._owner[0] is again.router


def test_swapped_model_reinitialises():
    """After swap_routers, the trainer's to_empty + init_states on the swapped model:
    the gate by its param_init, the null rows by moelab's init, the Router's buffers
    fresh; and with_router_steps keeps the engine's post-optimizer hook."""
    moe = build(moe_config(top_k=2))
    swap_routers(moe, n_null_experts=1, schedule="lipschitz")
    moe(_data(7)[0])
    moe.to_empty(device="cpu")
    with torch.no_grad():
        moe.init_states()
    router = moe.router.router
    assert torch.equal(router.bias, torch.zeros(9)) and int(router.temperature.step) == 0
    assert moe.router.last is None
    assert torch.isfinite(router.weight).all() and router.weight.shape == (9, 16)
    assert torch.isfinite(moe(_data(7)[0])).all()
    called = []
    build_fn = with_router_steps(lambda *args: called.append(len(args)))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[moe])
    build_fn(optimizers, [moe], None)
    moe(_data(8)[0]).sum().backward()
    optimizers.step()
    assert called == [3] and int(router.temperature.step) == 1


def test_aux_loss_under_activation_checkpointing():
    """torchtitan's activation checkpointing (non-reentrant): the aux loss read after a
    checkpointed forward gives the same gradients."""
    moe = build(moe_config(top_k=2))
    swap_routers(moe, map="entmax", alpha=1.5, aux_weight=0.1, z_loss_weight=0.01)
    again = copy.deepcopy(moe)
    x, _ = _data(9)
    (moe(x).square().mean() + aux_loss(moe)).backward()
    y = torch.utils.checkpoint.checkpoint(again, x, use_reentrant=False)
    (y.square().mean() + aux_loss(again)).backward()
    torch.testing.assert_close(again.router.gate.weight.grad, moe.router.gate.weight.grad)


def test_calibrated_cut_keeps_about_k_experts():
    """calibrate_routers: each truncating layer's cut lets about its k_l experts per
    token through (the allocator's K / L = 2 at the start)."""
    model = build(tiny_dsv3(top_k=4))
    swap_routers(model, map="lapsum", selection="threshold", token_cap_factor=2.0, k_total=4.0)
    model.verify_module_protocol()  # the allocator is a torchtitan Module too
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    masks = model.get_attention_masks(torch.arange(16).repeat(4, 1))
    cuts = calibrate_routers(model, [tokens], lambda t: model(t, attention_masks=masks))
    assert len(cuts) == 2 and all(c > 0 for c in cuts)
    with torch.no_grad():
        model(tokens, attention_masks=masks)
    for _, router in moelab_routers(model):
        active = router.last.computed_TK.sum(-1).float().mean()
        assert abs(float(active) - 2.0) < 0.25


@pytest.mark.parametrize(
    "keys",
    [
        {"n_null_experts": 2, "null_expert": "zero", "top_k": 2},
        {"selection": "top_p", "top_p": 0.3, "top_p_cap": 2},
        {"map": "sparsemax", "selection": "threshold", "truncation": 0.2, "token_cap_factor": 1.0},
        {"top_k": 1},
    ],
    ids=["null", "top_p", "threshold", "k1-of-2"],
)
def test_slots_without_an_expert_stay_dispatchable(keys):
    """Null, unused and padded slots: a real expert, distinct within each token, at
    weight 0, so the engine's routing map counts K experts per token."""
    moe = build(moe_config(top_k=2))
    swap_routers(moe, **keys)
    x, _ = _data(10)
    weights, ids, scores = moe.router(x, moe.expert_bias_E)
    assert ids.shape == (4, 8, 2) and bool((ids >= 0).all() and (ids < 8).all())
    assert bool((ids[..., 0] != ids[..., 1]).all())
    out = moe.router.last
    empty = (weights == 0).sum()
    assert empty >= (~out.computed_TK).sum() and scores.shape == (4, 8, 8)
    if keys.get("top_k") == 1:
        assert bool((weights[..., 1] == 0).all())
    moe(x)
    assert moe.tokens_per_expert_E.sum() == 4 * 8 * 2
