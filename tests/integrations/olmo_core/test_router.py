"""moelab's router in OLMo-core, at the router level: the swapped router against
OLMo-core's own ``MoELinearRouter`` on its weights (expert ids, weights, counts, aux
losses), the engine's settings that carry over, and the refusals.

OLMo-core's router (and moelab's) computes in float32 whatever the input dtype
(``x.float()``, ``logits.float()``); the float64 comparisons patch ``Tensor.float`` to
the identity for the call, so both run their own code in float64.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from olmo_core.nn.moe.loss import MoELoadBalancingLossGranularity
from olmo_core.nn.moe.router import MoERouterConfig

from moelab.integrations.olmo_core import (
    MoelabRouter,
    check_version,
    engine_weight,
    equivalent_keys,
    moelab_router,
)

D, E, B, S = 16, 8, 3, 5
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _engine(dtype=torch.float32, **kw):
    top_k = kw.pop("top_k", 2)
    losses = {
        k: kw.pop(k) for k in ("lb_loss_weight", "z_loss_weight", "lb_loss_granularity") if k in kw
    }
    torch.manual_seed(0)
    engine = MoERouterConfig(top_k=top_k, **kw).build(D, E, **losses).to(dtype)
    if engine.score_bias is not None:
        engine.score_bias.copy_(0.05 * torch.randn(E, dtype=dtype))
    return engine


def _pair(dtype=torch.float32, **kw):
    engine = _engine(dtype, **kw)
    return engine, moelab_router(engine, engine_weight(engine)).to(dtype)


@pytest.fixture
def in_dtype(request, monkeypatch):
    dtype = request.param
    if dtype == torch.float64:  # both routers cast to float32; keep the float64 input
        monkeypatch.setattr(torch.Tensor, "float", lambda self: self)
    return dtype


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64], indirect=True)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm", [None, 1.0, 2.0])
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_same_routing_as_olmo_core(in_dtype, gating, norm, bias):
    engine, new = _pair(
        in_dtype,
        gating_function=gating,
        normalize_expert_weights=norm,
        bias_gamma=0.01 if bias else None,
    )
    engine.eval(), new.eval()
    x = torch.randn(B, S, D, dtype=in_dtype)
    w, ids, counts, aux = engine(x)
    w2, ids2, counts2, aux2 = new(x)
    assert w2.dtype == w.dtype == in_dtype and w2.shape == (B, S, 2)
    assert torch.equal(ids2, ids) and torch.equal(counts2, counts)
    assert (w2 - w).abs().max().item() <= TOL[in_dtype]
    assert aux is None and aux2 is None


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64], indirect=True)
@pytest.mark.parametrize("granularity", ["local_batch", "instance"])
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_same_aux_losses_and_metrics(in_dtype, gating, granularity):
    """In training the engine's load-balancing and z-loss weights carry over to moelab's
    Switch loss and z-loss: the aux loss the block attaches is the engine's, with and
    without OLMo-core's ``loss_div_factor``."""
    engine, new = _pair(
        in_dtype,
        gating_function=gating,
        lb_loss_weight=0.01,
        z_loss_weight=0.001,
        lb_loss_granularity=MoELoadBalancingLossGranularity(granularity),
    )
    x = torch.randn(B, S, D, dtype=in_dtype)
    for div in (None, 2.5 * B * S):
        _, ids, _, aux = engine(x, loss_div_factor=div)
        _, ids2, _, aux2 = new(x, loss_div_factor=div)
        assert torch.equal(ids, ids2)
        # NOTE: OLMo-core's P_i of a sigmoid router holds its +1e-7 per score (2e-11 on
        # a loss of 0.014); moelab's normalised sigmoid values do not
        tol = TOL[in_dtype] if gating == "softmax" else max(TOL[in_dtype], 1e-10)
        assert abs(aux2.item() - aux.item()) <= tol
    # the engine keeps its metric sums in float32
    ours, theirs = new.compute_metrics(), engine.compute_metrics()
    assert set(ours) == {"load imbalance", "moelab switch", "moelab z"}
    assert torch.equal(ours["load imbalance"][0], theirs["load imbalance"][0])
    for mine, engines in (("switch", "load balancing loss"), ("z", "router Z loss")):
        value, expected = ours[f"moelab {mine}"][0], theirs[f"{engines} unscaled"][0]
        assert abs(value.item() - expected.item()) <= 1e-6 * expected.item()


def test_top_one_uniform_and_jitter():
    """K = 1 with a norm (w = 1), OLMo-core's uniform expert assignment and its input
    jitter in training (the same draws under the same seed)."""
    engine, new = _pair(top_k=1, normalize_expert_weights=1.0)
    assert equivalent_keys(engine)["straight_through"] is True
    x = torch.randn(B, S, D)
    assert torch.equal(engine.eval()(x)[0], new.eval()(x)[0])
    engine, new = _pair(uniform_expert_assignment=True, jitter_eps=0.1)
    for mode in (False, True):
        engine.train(mode), new.train(mode)
        torch.manual_seed(1)
        w, ids, counts, _ = engine(x)
        torch.manual_seed(1)
        w2, ids2, counts2, _ = new(x)
        assert torch.equal(ids2, ids) and torch.equal(counts2, counts)
        assert (w2 - w).abs().max().item() <= 1e-6
    assert torch.equal(ids2.flatten(), torch.arange(B * S * 2) % E)


def test_keys_change_the_routing():
    engine, _ = _pair()
    keys = {"map": "entmax", "alpha": 1.5, "temperature": 0.005}
    new = moelab_router(engine, engine_weight(engine), **keys)
    assert new.router.config.map == "entmax" and isinstance(new, MoelabRouter)
    x = torch.randn(B, S, D)
    w, _, counts, _ = new.eval()(x)
    assert (new.last.probs_TE == 0).any() and counts.sum().item() == B * S * 2
    assert (w - engine.eval()(x)[0]).abs().max().item() > 1e-3


def test_bias_follows_the_engines_update():
    """``post_batch``: OLMo-core's loss-free bias update, and the Router chooses with
    the moved bias."""
    engine, new = _pair(bias_gamma=0.01)
    x = torch.randn(B, S, D)
    for router in (engine, new):
        router.train()
        router(x)
        router.post_batch()
    assert torch.equal(new.score_bias, engine.score_bias)
    assert torch.equal(new.router.bias, engine.score_bias)
    engine.eval(), new.eval()
    assert torch.equal(engine(x)[1], new(x)[1])


@pytest.mark.parametrize(
    "keys",
    [
        {"selection": "top_p", "top_p": 0.3, "top_p_cap": 2},
        {"map": "sparsemax", "selection": "threshold", "truncation": 0.05, "token_cap_factor": 1.0},
        {"n_null_experts": 2},
        {"top_k": 1, "straight_through": True},
    ],
)
def test_variable_slots_keep_valid_ids(keys):
    engine, _ = _pair()
    new = moelab_router(engine, engine_weight(engine), **keys).train()
    w, ids, counts, _ = new(torch.randn(B, S, D))
    assert w.shape == ids.shape == (B, S, 2)
    assert ids.min().item() >= 0 and ids.max().item() < E
    computed = new.last.computed_TK
    pad = 2 - computed.shape[1]
    computed = torch.nn.functional.pad(computed, (0, pad)).view(B, S, 2)
    assert (w[~computed] == 0).all() and (w[computed] > 0).all()
    assert counts.sum().item() == B * S * 2


@pytest.mark.parametrize(
    ("engine_kw", "keys", "message"),
    [
        ({}, {"nap": "entmax"}, "unknown router key 'nap' (did you mean 'map'?) for OLMo-core"),
        ({}, {"d_model": 8}, "d_model comes from the OLMo-core model"),
        ({}, {"selection": "expert_choice"}, "selection='expert_choice' has experts pick"),
        ({}, {"top_k": 3}, "3 slots per token and the OLMo-core MoE block dispatches top_k=2"),
        ({}, {"n_null_experts": 1, "null_expert": "identity"}, "null_expert='identity'"),
        ({"random_expert_assignment": True}, {}, "random_expert_assignment routes by random"),
        ({"gating_function": "topk_softmax"}, {}, "gating_function='topk_softmax'"),
        ({"normalize_expert_weights": 2.0}, {"map": "entmax"}, "an L2.0 norm of the weights"),
        (
            {"uniform_expert_assignment": True},
            {"selection": "top_p", "top_p_cap": 2},
            "benchmarking mode",
        ),
        ({"jitter_eps": 0.05}, {"jitter": 0.05}, "jittered twice"),
    ],
)
def test_refusals_say_what_to_change(engine_kw, keys, message):
    engine = _engine(**engine_kw)
    with pytest.raises(ValueError) as err:
        moelab_router(engine, engine_weight(engine), **keys)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_version_mismatch_is_one_line(monkeypatch):
    assert check_version() == "3.0.0"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.4.0")
    with pytest.raises(ImportError) as err:
        check_version()
    text = str(err.value)
    assert "ai2-olmo-core==3.0.0" in text and "found 2.4.0" in text and "\n" not in text
