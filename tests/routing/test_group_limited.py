"""Group-limited routing (DeepSeek-V3; moelab/routing/selection/groups.py) and the routed
scaling factor: choice by a + b within the best groups, gates from a alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moelab.diagnostics import RoutingStats
from moelab.routing import Router, RouterConfig, selection
from moelab.routing.measures import token_measures
from moelab.routing.router import apply_map, gate_weights
from moelab.routing.selection import Budget, Selected, Selection


def _config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = dict(
        d_model=6, n_experts=8, top_k=3, map="sigmoid", n_groups=4, topk_groups=2, renorm=True
    )
    base.update(kw)
    return RouterConfig(**base)


def _reference(
    a_TE: torch.Tensor, bias_E: torch.Tensor, n_groups: int, topk_groups: int, top_k: int
) -> list[list[int]]:
    """Slow: per token, each group's score (its two largest a + b), the best groups
    (ties: the lower group), then the top-K experts of those groups by a + b."""
    n_experts = a_TE.shape[1]
    size = n_experts // n_groups
    chosen = []
    for row in a_TE.tolist():
        c = [row[e] + float(bias_E[e]) for e in range(n_experts)]
        scores = []
        for g in range(n_groups):
            members = sorted((c[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            scores.append(members[0] + members[1])
        groups = sorted(range(n_groups), key=lambda g: (-scores[g], g))[:topk_groups]
        experts = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen.append(sorted(sorted(experts, key=lambda e: -c[e])[:top_k]))
    return chosen


def _sorted_ids(ids_TK: torch.Tensor) -> list[list[int]]:
    return [sorted(row) for row in ids_TK.tolist()]


@pytest.mark.parametrize(
    ("n_experts", "n_groups", "topk_groups", "top_k"),
    [(8, 4, 2, 3), (12, 3, 1, 2), (16, 4, 3, 5), (6, 2, 2, 6)],
)
def test_router_matches_a_loop_over_tokens(n_experts, n_groups, topk_groups, top_k) -> None:
    torch.manual_seed(n_experts + top_k)
    scaling = 2.5
    config = _config(
        n_experts=n_experts,
        n_groups=n_groups,
        topk_groups=topk_groups,
        top_k=top_k,
        routed_scaling=scaling,
    )
    router = Router(config).eval()
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.bias.copy_(0.3 * torch.randn(n_experts))  # the loss-free bias moves the choice
    x_TD = torch.randn(57, 6)
    out = router(x_TD)
    a_TE = torch.sigmoid(x_TD @ router.weight.t())
    assert _sorted_ids(out.ids_TK) == _reference(a_TE, router.bias, n_groups, topk_groups, top_k)
    assert out.selected_TK.all()
    # gates: the selected a normalised to sum 1, times routed_scaling; not a + b
    a_TK = a_TE.gather(-1, out.ids_TK)
    torch.testing.assert_close(out.weights_TK, scaling * a_TK / a_TK.sum(-1, keepdim=True))
    torch.testing.assert_close(out.weights_TK.sum(-1), torch.full((57,), scaling))


def test_matches_transformers_deepseek_v3_router() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    hf_config = transformers.DeepseekV3Config(
        hidden_size=6,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    hf = DeepseekV3TopkRouter(hf_config)
    config = _config(n_experts=16, n_groups=4, topk_groups=2, top_k=4, routed_scaling=2.5)
    router = Router(config).eval()
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
        hf.e_score_correction_bias.copy_(0.2 * torch.randn(16))
        router.weight.copy_(hf.weight)
        router.bias.copy_(hf.e_score_correction_bias)
    x_TD = torch.randn(200, 6)
    out = router(x_TD)
    _, hf_weights, hf_ids = hf(x_TD)
    order = hf_ids.argsort(-1)
    ours = out.ids_TK.argsort(-1)
    assert torch.equal(out.ids_TK.gather(-1, ours), hf_ids.gather(-1, order))
    torch.testing.assert_close(
        out.weights_TK.gather(-1, ours), hf_weights.gather(-1, order), rtol=1e-5, atol=1e-6
    )


def _route(config: RouterConfig, a_TE: list[list[float]], bias: list[float] | None = None):
    """The selection on given map values (their logits, the ranking of other rules)."""
    probs_TE = torch.tensor(a_TE, dtype=torch.float64)
    logits_TE = torch.logit(probs_TE)
    bias_E = torch.zeros(config.n_experts) if bias is None else torch.tensor(bias)
    budget = Budget(config.top_k, None, 0.0, training=False)
    return Router(config).selection(logits_TE, probs_TE, bias_E.double(), budget)


def test_ties_and_masking_are_deterministic() -> None:
    config = _config(n_experts=4, n_groups=2, topk_groups=1, top_k=2)
    rows = [
        # values exact in binary, so that the sums tie exactly
        [0.75, 0.25, 0.5, 0.5],  # group scores tie (1.0, 1.0): the lower group wins
        [0.5, 0.5, 0.75, 0.25],  # tie again, in the other order
        [0.5, 0.5, 0.5, 0.5],  # everything ties
        [0.875, 0.125, 0.5, 0.4375],  # group 0 (1 > 0.9375): 1 beats the better 2 and 3
        [0.875, 0.25, 0.25, 0.25],  # expert 1 ties with the masked 2 and 3: 1 is kept
    ]
    for _ in range(3):  # the same answer every time
        out = _route(config, rows)
        assert _sorted_ids(out.ids_TK) == [[0, 1]] * 5
    assert _sorted_ids(out.ids_TK) == _reference(
        torch.tensor(rows, dtype=torch.float64), torch.zeros(4), 2, 1, 2
    )


def test_bias_moves_the_groups_and_the_gate_ignores_it() -> None:
    config = _config(n_experts=4, n_groups=2, topk_groups=1, top_k=2, routed_scaling=2.5)
    rows = [[0.6, 0.5, 0.55, 0.5]]
    assert _sorted_ids(_route(config, rows).ids_TK) == [[0, 1]]  # 1.1 > 1.05
    out = _route(config, rows, bias=[0.0, 0.0, 0.2, 0.0])  # group 1: 1.25 > 1.1
    assert _sorted_ids(out.ids_TK) == [[2, 3]]
    p_TK = torch.tensor(rows, dtype=torch.float64).gather(-1, out.ids_TK)
    weights = gate_weights(p_TK, out.selected_TK, True, False, 2.5)
    torch.testing.assert_close(weights, 2.5 * p_TK / 1.05)


def test_groups_rank_by_the_map_values_not_the_logits() -> None:
    # logits (4, -1 | 1.2, 1.2): the logit sums pick group 0 (3 > 2.4), the sums of the
    # sigmoid affinities group 1 (0.982 + 0.269 = 1.251 < 1.537), as DeepSeek-V3 does
    config = _config(n_experts=4, n_groups=2, topk_groups=1, top_k=2)
    a = torch.sigmoid(torch.tensor([[4.0, -1.0, 1.2, 1.2]], dtype=torch.float64))
    assert _sorted_ids(_route(config, a.tolist()).ids_TK) == [[2, 3]]


def test_one_group_is_off_and_top_k_unchanged() -> None:
    torch.manual_seed(0)
    x_TD = torch.randn(20, 6)
    plain = Router(_config(n_groups=None, topk_groups=None)).eval()
    one = Router(_config(n_groups=1, topk_groups=1)).eval()
    one.load_state_dict(plain.state_dict())
    torch.testing.assert_close(one(x_TD).weights_TK, plain(x_TD).weights_TK)
    assert torch.equal(one(x_TD).ids_TK, plain(x_TD).ids_TK)
    # all groups kept: the choice is top-K of a + b, i.e. of the logits + b for sigmoid
    everything = Router(_config(n_groups=4, topk_groups=4)).eval()
    everything.load_state_dict(plain.state_dict())
    assert _sorted_ids(everything(x_TD).ids_TK) == _sorted_ids(plain(x_TD).ids_TK)


def test_routed_scaling_multiplies_every_gate_mode() -> None:
    torch.manual_seed(1)
    p_TK = torch.rand(5, 3, dtype=torch.float64)
    selected_TK = torch.rand(5, 3) > 0.3
    for renorm, st in [(False, False), (True, False), (False, True)]:
        base = gate_weights(p_TK, selected_TK, renorm, st)
        torch.testing.assert_close(gate_weights(p_TK, selected_TK, renorm, st, 0.5), 0.5 * base)


def test_gradient_gradcheck_and_loop_reference() -> None:
    torch.manual_seed(2)
    config = _config(routed_scaling=1.7)
    rule = Router(config).selection
    bias_E = 0.1 * torch.randn(8, dtype=torch.float64)

    def weights(logits_TE: torch.Tensor) -> torch.Tensor:
        probs_TE = apply_map(config, logits_TE)
        ids_TK, selected_TK = rule(logits_TE, probs_TE, bias_E, Budget(3, None, 0.0, False))
        p_TK = probs_TE.gather(-1, ids_TK)
        return gate_weights(p_TK, selected_TK, True, False, config.routed_scaling)

    logits_TE = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(weights, (logits_TE,))

    # the router's weight gradient equals a loop reference's autograd
    router = Router(config)
    with torch.no_grad():
        router.bias.copy_(bias_E.float())
    x_TD, target_TK = torch.randn(11, 6), torch.randn(11, 3)
    out = router(x_TD)
    (out.weights_TK * target_TK).sum().backward()
    weight = router.weight.detach().clone().requires_grad_(True)
    a_TE = torch.sigmoid(x_TD @ weight.t())
    chosen = _reference(a_TE.detach(), router.bias, 4, 2, 3)
    loss = 0.0
    for t, experts in enumerate(chosen):
        total = sum(a_TE[t, e] for e in experts)
        for k, e in enumerate(out.ids_TK[t].tolist()):
            loss = loss + 1.7 * a_TE[t, e] / total * target_TK[t, k]
    loss.backward()
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="must divide n_experts"):
        _config(n_experts=8, n_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="at least 2 experts"):
        _config(n_experts=8, n_groups=8, topk_groups=2, top_k=2)
    with pytest.raises(ValueError, match="needs topk_groups"):
        _config(topk_groups=None)
    with pytest.raises(ValueError, match=r"topk_groups must lie in \[1, n_groups=4\]"):
        _config(topk_groups=5)
    with pytest.raises(ValueError, match=r"topk_groups must lie"):
        _config(topk_groups=0)
    with pytest.raises(ValueError, match="exceeds the 4 experts"):
        _config(topk_groups=2, top_k=5)
    with pytest.raises(ValueError, match="sample_extra"):
        _config(topk_groups=2, top_k=3, sample_extra=2)
    with pytest.raises(ValueError, match="n_groups must be a positive integer"):
        _config(n_groups=0)
    with pytest.raises(ValueError, match="set n_groups > 1"):
        _config(n_groups=None, topk_groups=2)
    for rule in ("top_p", "threshold", "expert_choice"):
        with pytest.raises(ValueError, match=f"selection '{rule}' cannot use group-limited"):
            _config(selection=rule)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="routed_scaling must be a finite number > 0"):
            _config(routed_scaling=bad)
    # a call with more experts than the kept groups hold is refused, not routed to -inf
    router = Router(_config())
    router.top_k = 5
    with pytest.raises(ValueError, match="exceeds the 4 experts of the kept groups"):
        router(torch.randn(3, 6))
    # sample_extra's candidates count in training only
    sampling = Router(_config(top_k=3, sample_extra=1))
    sampling.top_k = 4
    assert sampling.eval()(torch.randn(3, 6)).ids_TK.shape == (3, 4)
    with pytest.raises(ValueError, match=r"plus sample_extra in training\) exceeds the 4"):
        sampling.train()(torch.randn(3, 6))


def test_a_registered_rule_that_allows_groups_composes() -> None:
    class Best(Selection):  # top-1 by the ranking score
        name = "toy_best"
        limits_groups = True

        def select(self, rank_TE, probs_TE, budget) -> Selected:
            ids_TK = rank_TE.argmax(-1, keepdim=True)
            return Selected(ids_TK, torch.ones_like(ids_TK, dtype=torch.bool))

    selection.register(Best)
    try:
        config = _config(n_experts=4, n_groups=2, topk_groups=1, top_k=1, selection="toy_best")
        out = _route(config, [[0.9, 0.1, 0.6, 0.6], [0.9, 0.3, 0.6, 0.5]])
        # token 0: group 1 (1.2 > 1.0), so expert 2, not the best expert 0; token 1: group 0
        assert out.ids_TK.tolist() == [[2], [0]]
    finally:
        selection.unregister("toy_best")


def test_stats_fixture() -> None:
    # identity scorer: the logits are the rows; a = sigmoid; E = 4 in 2 groups, 1 kept, K = 2
    config = _config(d_model=4, n_experts=4, n_groups=2, topk_groups=1, top_k=2, routed_scaling=2.5)
    router = Router(config).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    rows = [
        [2.0, 1.0, 0.0, -1.0],  # group 0 (1.612 > 0.769): {0, 1}
        [-1.0, 0.0, 1.0, 2.0],  # group 1: {2, 3}
        [2.0, -2.0, 1.5, 1.5],  # group 1 (1.635 > 1.0), not the best expert 0: {2, 3}
        [0.0, 0.0, 0.0, 0.0],  # tie: group 0, {0, 1}
        [-1.0, 0.0, 1.0, 2.0],  # {2, 3}
    ]
    chosen = [[0, 1], [2, 3], [2, 3], [0, 1], [2, 3]]
    out = router(torch.tensor(rows))
    assert _sorted_ids(out.ids_TK) == chosen
    torch.testing.assert_close(out.weights_TK.sum(-1), torch.full((5,), 2.5))
    result = RoutingStats("sigmoid").update(out).result()
    assert result["active_experts"] == pytest.approx(2.0)
    assert result["contributors"] == pytest.approx(2.0)
    # load (2, 2, 3, 3) of 10: shares (.2, .2, .3, .3), std .05, mean .25
    assert result["load_cv"] == pytest.approx(0.2, abs=1e-6)

    def sig(z: float) -> float:
        return 1 / (1 + math.exp(-z))

    discarded = [
        1 - sum(sig(row[e]) for e in kept) / sum(sig(z) for z in row)
        for row, kept in zip(rows, chosen, strict=True)
    ]
    # the per-token share of the sigmoid mass (routing.measures) is what the hand
    # computation gives; the statistics report none for sigmoid gates (no fixed total)
    share = token_measures(out).discarded_T
    assert float(share.mean()) == pytest.approx(sum(discarded) / 5, abs=1e-6)
    assert result["discarded_mass"] is None


def test_a_tiny_model_learns_with_group_limited_routing(tmp_path: Path) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    router = dict(
        map="sigmoid",
        n_groups=2,
        topk_groups=1,
        renorm=True,
        routed_scaling=2.5,
        bias_rate=0.001,
        aux_scope="sequence",
        aux_probs="normalized",
        aux_weight=0.01,
    )
    model = {**TINY_MODEL, "router": router}
    train_learns(corpus, run, model=model)
    st = stats(run, max_batches=1)
    for layer in st["layers"]:
        assert layer["active_experts"] == pytest.approx(2.0)  # K = 2 within one group of 2
