"""Expert-choice selection (moelab/routing/selection/expert_choice.py): each expert takes
its top-C tokens by softmax affinity, C = min(T, ceil(T * k * cf / E))."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moelab.diagnostics import RoutingStats
from moelab.routing import Router, RouterConfig
from moelab.routing.selection import Budget
from moelab.routing.selection.expert_choice import ExpertChoice, expert_capacity


def _reference_chosen(rank_TE: torch.Tensor, n_chosen: int) -> list[list[int]]:
    """Slow: per expert, the tokens of its column sorted by affinity, best first, cut at C."""
    affinity_TE = torch.softmax(rank_TE.double(), dim=-1)
    chosen = []
    for e in range(rank_TE.shape[1]):
        column = affinity_TE[:, e].tolist()
        order = sorted(range(len(column)), key=lambda t: -column[t])
        chosen.append(sorted(order[:n_chosen]))
    return chosen


def _select(rank_TE: torch.Tensor, top_k: int, capacity_factor: float | None = None):
    config = RouterConfig(
        d_model=4,
        n_experts=rank_TE.shape[1],
        top_k=top_k,
        selection="expert_choice",
        capacity_factor=capacity_factor,
    )
    budget = Budget(top_k, None, config.truncation, training=False)
    return ExpertChoice(config.selection_config).select(rank_TE, torch.softmax(rank_TE, -1), budget)


@pytest.mark.parametrize(
    ("n_tokens", "top_k", "n_experts", "factor", "expected"),
    [
        (10, 2, 4, None, 5),  # ceil(10 * 2 / 4)
        (10, 1, 4, None, 3),  # ceil(2.5)
        (10, 1, 11, 1.1, 1),  # exact rational ceiling: 1.1 * 10 / 11 is 1, not 2
        (7, 3, 4, 2.0, 7),  # ceil(10.5) = 11 > T: capped at T
        (0, 2, 4, None, 0),
    ],
)
def test_capacity_formula(n_tokens, top_k, n_experts, factor, expected) -> None:
    rank_TE = torch.randn(n_tokens, n_experts, dtype=torch.float64)
    selected_TE = _select(rank_TE, top_k, factor).selected_TK
    assert expert_capacity(n_tokens, top_k, n_experts, 1.0 if factor is None else factor) == (
        expected
    )
    assert selected_TE.sum(0).tolist() == [expected] * n_experts  # every expert is full


def test_each_expert_takes_the_top_c_of_its_column() -> None:
    gen = torch.Generator().manual_seed(0)
    for n_tokens, n_experts, top_k in [(37, 8, 2), (64, 5, 1), (9, 3, 3)]:
        rank_TE = torch.randn(n_tokens, n_experts, generator=gen, dtype=torch.float64)
        out = _select(rank_TE, top_k)
        n_chosen = math.ceil(n_tokens * top_k / n_experts)
        assert out.ids_TK.tolist() == [list(range(n_experts))] * n_tokens  # slot e: expert e
        got = [out.selected_TK[:, e].nonzero().flatten().tolist() for e in range(n_experts)]
        assert got == _reference_chosen(rank_TE, min(n_chosen, n_tokens))
        # a token reaches 0..E experts; here some reach none and some several
        per_token = out.selected_TK.sum(1)
        assert per_token.sum() == n_experts * min(n_chosen, n_tokens)


def test_ties_fill_each_expert_with_c_of_the_best_tokens() -> None:
    # tokens 0-3 identical: each expert's best values tie across them
    rank_TE = torch.tensor(
        [[1.0, 0.0, 0.0]] * 4 + [[0.0, 0.0, 2.0], [0.0, 1.0, 0.0]], dtype=torch.float64
    )
    out = _select(rank_TE, top_k=1)  # C = ceil(6 / 3) = 2
    affinity_TE = torch.softmax(rank_TE, -1)
    for e in range(3):
        chosen = out.selected_TK[:, e]
        assert int(chosen.sum()) == 2
        values = affinity_TE[:, e]
        assert values[chosen].min() >= values[~chosen].max()  # no better token left out
        best = sorted(values.tolist(), reverse=True)[:2]
        assert sorted(values[chosen].tolist(), reverse=True) == best
    assert out.selected_TK[:4, 0].sum() == 2  # two of the four tied tokens


def test_gate_gradient_matches_a_loop_reference() -> None:
    torch.manual_seed(0)
    config = RouterConfig(d_model=8, n_experts=4, top_k=2, selection="expert_choice")
    router = Router(config)
    x_TD = torch.randn(13, 8)
    target_TE = torch.randn(13, 4)
    out = router(x_TD)
    (out.weights_TK * target_TE).sum().backward()
    assert router.weight.grad is not None

    weight = router.weight.detach().clone().requires_grad_(True)
    probs_TE = torch.softmax(x_TD @ weight.t(), -1)
    chosen = _reference_chosen((x_TD @ weight.t()).detach(), math.ceil(13 * 2 / 4))
    loss = sum(probs_TE[t, e] * target_TE[t, e] for e in range(4) for t in chosen[e])
    loss.backward()
    assert weight.grad is not None
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)
    # only the chosen pairs are computed: C * E of the T * E slots
    assert int(out.computed_TK.sum()) == 4 * math.ceil(13 * 2 / 4)


def test_config_answers_and_refusals() -> None:
    config = RouterConfig(d_model=4, n_experts=8, top_k=2, selection="expert_choice")
    assert (config.slots, config.expected_experts) == (8, 2.0)
    assert config.selection_rule.truncates and config.selection_rule.sweep == "top_k"
    capped = RouterConfig(
        d_model=4, n_experts=8, top_k=2, selection="expert_choice", capacity_factor=1.5
    )
    assert capped.expected_experts == 3.0
    with pytest.raises(ValueError, match="sample_extra=0"):
        RouterConfig(d_model=4, n_experts=8, top_k=2, selection="expert_choice", sample_extra=1)
    router = Router(config)
    with pytest.raises(ValueError, match="finite ranking score"):
        router.selection.select(
            torch.full((3, 8), -math.inf), torch.zeros(3, 8), Budget(2, None, 0.0, False)
        )


def test_stats_fixture_active_experts_and_unrouted_fraction() -> None:
    # scorer = identity, so the logits are the rows below; T = E = 3, k = 1: C = 1.
    # affinities: t0 ~ (.5, .5, 0), t1 = (1/3, 1/3, 1/3), t2 ~ (0, 0, 1):
    # e0 and e1 take t0, e2 takes t2; t1 reaches no expert.
    config = RouterConfig(d_model=3, n_experts=3, top_k=1, selection="expert_choice")
    router = Router(config).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    x_TD = torch.tensor([[4.0, 4.0, -4.0], [0.0, 0.0, 0.0], [-4.0, -4.0, 4.0]])
    out = router(x_TD)
    assert out.selected_TK.tolist() == [[True, True, False], [False] * 3, [False, False, True]]
    result = RoutingStats("softmax").update(out).result()
    assert result["active_experts"] == pytest.approx(3 / 3)  # C * E / T
    assert result["contributors"] == pytest.approx(1.0)
    assert result["unrouted_fraction"] == pytest.approx(1 / 3)
    assert result["dropped_fraction"] == 0.0
    assert result["load_cv"] == 0.0  # every expert exactly full
    # top-1 routes every token: nothing unrouted
    topk = Router(RouterConfig(d_model=3, n_experts=3, top_k=1)).eval()
    topk_result = RoutingStats("softmax").update(topk(x_TD)).result()
    assert topk_result["unrouted_fraction"] == 0.0


def test_a_tiny_model_learns_with_expert_choice(tmp_path: Path) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "router": {"selection": "expert_choice"}}
    train_learns(corpus, run, model=model)
    st = stats(run, max_batches=1)
    assert (st["selection"], st["truncating"]) == ("expert_choice", True)
    for layer in st["layers"]:
        # T even, k = 2, E = 4: C = T / 2, C * E / T = 2 experts per token on average
        assert layer["active_experts"] == pytest.approx(2.0)
        assert 0.0 <= layer["unrouted_fraction"] < 1.0
        assert layer["load_cv"] == pytest.approx(0.0)
