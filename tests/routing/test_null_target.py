"""LongCat-Flash's zero-computation experts as moelab mechanisms: identity null experts
chosen by softmax value + bias (rank_by="probs"), gate weights = softmax values x
routed_scaling, and the null experts' bias steered toward a target number of real
experts per token (null_target, with bias_rate): the update by hand, convergence on
synthetic tokens, the layer against a loop over tokens, refusals, parameter counts."""

from __future__ import annotations

import pytest
import torch

from moelab.model import ModelConfig, param_counts
from moelab.moe import MoE, MoEConfig
from moelab.routing import Router, RouterConfig
from moelab.routing.balancing import null_target_update
from moelab.routing.router import step_routers


def test_update_by_hand() -> None:
    # E = 4 real, M = 2 null, K = 2: 10 slots, 8 real -> r = 2 * 8 / 10 = 1.6 per token
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    load = torch.tensor([3.0, 1.0, 2.0, 2.0, 1.0, 1.0])
    new = null_target_update(bias, load, 4, 2, 1.5, 0.1)
    # reals balanced among themselves (mean 2); r = 1.6 > 1.5: the nulls go up
    torch.testing.assert_close(new, torch.tensor([-0.1, 0.1, 0.0, 0.0, 0.6, 0.6]))
    assert torch.equal(bias, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5]))  # unchanged
    # r = 1.6 < 1.7: the nulls go down; r exactly at the target: they stay
    torch.testing.assert_close(null_target_update(bias, load, 4, 2, 1.7, 0.1)[4:], bias[4:] - 0.1)
    torch.testing.assert_close(null_target_update(bias, load, 4, 2, 1.6, 0.1)[4:], bias[4:])
    # no load: nothing moves
    torch.testing.assert_close(null_target_update(bias, torch.zeros(6), 4, 2, 1.5, 0.1), bias)
    with pytest.raises(ValueError, match="at least one null expert"):
        null_target_update(bias, load, 6, 2, 1.5, 0.1)


def _longcat_router(target: float | None, rate: float = 2e-3, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    rc = RouterConfig(
        d_model=8,
        n_experts=6,
        top_k=3,
        n_null_experts=2,
        null_expert="identity",
        rank_by="probs",
        routed_scaling=2.0,
        bias_rate=rate,
        null_target=target,
        aux_weight=0.0,
    )
    router = Router(rc)
    with torch.no_grad():
        router.weight.normal_()
    return router


def _real_per_token(router: Router, x_TD: torch.Tensor) -> float:
    out = router(x_TD)
    return float(out.selected_TK.sum(-1).double().mean())


@pytest.mark.parametrize("target", [1.0, 2.8])
def test_the_null_bias_steers_the_real_experts_per_token_to_the_target(target: float) -> None:
    router = _longcat_router(target)
    x_TD = torch.randn(2048, 8)
    start = _real_per_token(router, x_TD)
    seen = []
    for _ in range(600):  # one router call and one step_routers call per "step"
        out = router(x_TD)
        seen.append(float(out.selected_TK.sum(-1).double().mean()))
        step_routers([router], [out])
    late = sum(seen[-200:]) / 200
    # hand check: the start is far from the target, the last 200 steps sit on it
    # (a sign update oscillates around it by about one step's worth of tokens)
    assert abs(start - target) > 0.3
    assert abs(late - target) < 0.05, (start, late)
    # the null experts moved alike; the real experts kept their balance among themselves
    assert torch.equal(router.bias[6], router.bias[7])
    load = torch.bincount(router(x_TD).ids_TK[router(x_TD).selected_TK], minlength=6).double()
    assert float(load.std() / load.mean()) < 0.2


def test_without_a_target_the_null_experts_are_balanced_as_experts() -> None:
    router = _longcat_router(None)
    x_TD = torch.randn(1024, 8)
    for _ in range(300):
        step_routers([router], [router(x_TD)])
    # every one of the E + M experts toward the mean load: K * E / (E + M) real ones
    assert abs(_real_per_token(router, x_TD) - 3 * 6 / 8) < 0.1


def test_choice_by_softmax_plus_bias_and_weights_are_scaled_softmax_values() -> None:
    router = _longcat_router(1.5).eval()
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.05, -0.02, 0.0, 0.1, 0.0, 0.08, 0.12]))
    x_TD = torch.randn(64, 8)
    out = router(x_TD)
    p_TE = torch.softmax(x_TD @ router.weight.t(), -1)
    ids = (p_TE + router.bias).topk(3, -1).indices
    assert torch.equal(out.ids_TK.sort(-1).values, ids.sort(-1).values)
    # every slot, identity null ones included: 2 * p, the unbiased softmax value
    torch.testing.assert_close(out.weights_TK, 2.0 * p_TE.gather(-1, out.ids_TK))
    assert out.null_TK is not None and bool(out.null_TK.any())
    # by logits + bias the choice differs for some token (the bias is on the p scale)
    by_logits = Router(RouterConfig(**{**router.config.__dict__, "rank_by": "logits"})).eval()
    by_logits.load_state_dict(router.state_dict())
    assert not torch.equal(by_logits(x_TD).ids_TK.sort(-1).values, ids.sort(-1).values)


def test_longcat_layer_matches_a_loop_over_tokens() -> None:
    # y = sum over the chosen real experts of s p_e expert_e(x) + sum over null slots s p_m x
    router = _longcat_router(1.5, seed=1)
    moe = MoE(MoEConfig(8, 6, router.config), router=router).double()
    with torch.no_grad():
        moe.router.bias.copy_(torch.linspace(-0.05, 0.1, 8))
    x_TD = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    y, _ = moe(x_TD)
    rows = []
    for t in range(20):
        p = torch.softmax(moe.router.weight @ x_TD[t], -1)
        choice = (p.detach() + moe.router.bias.double()).topk(3).indices.tolist()
        row = torch.zeros(8, dtype=torch.float64)
        for e in choice:
            out_e = moe.experts.forward_expert(e, x_TD[t : t + 1])[0] if e < 6 else x_TD[t]
            row = row + 2.0 * p[e] * out_e
        rows.append(row)
    want = torch.stack(rows)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad(y.square().sum(), [x_TD, moe.router.weight])
    r = torch.autograd.grad(want.square().sum(), [x_TD, moe.router.weight])
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_refusals_say_what_to_change() -> None:
    def make(**kw):
        return RouterConfig(d_model=4, n_experts=8, top_k=2, **kw)

    with pytest.raises(ValueError, match="set n_null_experts >= 1 or null_target=None"):
        make(null_target=1.5, bias_rate=0.01)
    with pytest.raises(ValueError, match=r"in \(0, top_k=2\)"):
        make(n_null_experts=2, null_target=2.0, bias_rate=0.01)
    with pytest.raises(ValueError, match=r"in \(0, top_k=2\)"):
        make(n_null_experts=2, null_target=0.0, bias_rate=0.01)
    with pytest.raises(ValueError, match="set bias_rate > 0"):
        make(n_null_experts=2, null_target=1.5)
    with pytest.raises(ValueError, match="rank_by must be one of"):
        make(rank_by="scores")
    rc = make(n_null_experts=2, null_target=1.5, bias_rate=0.01, rank_by="probs")
    assert rc.expected_experts == 1.5


def test_active_params_count_the_target() -> None:
    def small(**router):
        return ModelConfig(
            n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=50,
            max_seq_len=8, n_experts=4, router={"top_k": 2, "n_null_experts": 2, **router},
        )  # fmt: skip

    expert = 3 * 16 * 24
    balanced = param_counts(small())  # K E / (E + M) = 4 / 3 real experts per token
    target = param_counts(small(null_target=1.0, bias_rate=0.01))
    assert target["total"] == balanced["total"]
    assert target["active"] - balanced["active"] == round(1.0 * expert) - round(4 / 3 * expert)
    assert target["active_at_cap"] == balanced["active_at_cap"]


@pytest.mark.parametrize("target", [0.6, 1.6])
def test_a_tiny_model_trains_toward_the_target(tmp_path, target: float) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    router = {
        "top_k": 2,
        "n_null_experts": 2,
        "null_expert": "identity",
        "rank_by": "probs",
        "null_target": target,
        "bias_rate": 0.01,
        "routed_scaling": 2.0,
        "aux_weight": 0.0,
    }
    train_learns(corpus, run, model={**TINY_MODEL, "router": router})
    st = stats(run, max_batches=2)
    # without null_target (aux_weight 0.01) this model ends at 1.11 real experts per
    # token; after 50 steps: 0.71 (target 0.6) and 1.66 (target 1.6)
    for layer in st["layers"]:
        assert abs(layer["active_experts"] - target) < 0.2, layer["active_experts"]
