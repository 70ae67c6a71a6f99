"""Sinkhorn-balanced selection (moelab/routing/selection/sinkhorn.py): in training, top-K of
the row/column-normalised exp(ranking scores); at inference, plain top-K."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moelab.routing import Router, RouterConfig
from moelab.routing.selection import Budget
from moelab.routing.selection.sinkhorn import Sinkhorn, sinkhorn_log


def _reference_matrix(rank_TE: torch.Tensor, top_k: int, n_iters: int) -> list[list[float]]:
    """Slow: M = exp(rank) in float64 lists; n_iters times divide each row by its sum / K,
    then each column by its sum / (T K / E)."""
    n_tokens, n_experts = rank_TE.shape
    m = [[math.exp(v) for v in row] for row in rank_TE.double().tolist()]
    for _ in range(n_iters):
        for t in range(n_tokens):
            total = sum(m[t])
            m[t] = [v * top_k / total for v in m[t]]
        for e in range(n_experts):
            total = sum(m[t][e] for t in range(n_tokens))
            for t in range(n_tokens):
                m[t][e] *= n_tokens * top_k / n_experts / total
    return m


def _reference_ids(rank_TE: torch.Tensor, top_k: int, n_iters: int) -> list[list[int]]:
    """Slow: per token, the K experts of largest normalised value, best first."""
    m = _reference_matrix(rank_TE, top_k, n_iters)
    return [sorted(range(len(row)), key=lambda e: -row[e])[:top_k] for row in m]


def _rule(n_experts: int, top_k: int, n_iters: int = 8) -> Sinkhorn:
    config = RouterConfig(
        d_model=4, n_experts=n_experts, top_k=top_k, selection="sinkhorn", sinkhorn_iters=n_iters
    )
    return Sinkhorn(config.selection_config)


@pytest.mark.parametrize(
    ("n_tokens", "n_experts", "top_k", "n_iters"), [(7, 3, 2, 1), (13, 5, 1, 3)]
)
def test_normalisation_matches_a_loop_reference(n_tokens, n_experts, top_k, n_iters) -> None:
    gen = torch.Generator().manual_seed(n_tokens)
    rank_TE = 2 * torch.randn(n_tokens, n_experts, generator=gen, dtype=torch.float64)
    got = sinkhorn_log(rank_TE, top_k, n_iters).exp()
    want = torch.tensor(_reference_matrix(rank_TE, top_k, n_iters), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_many_iterations_balance_rows_and_columns() -> None:
    gen = torch.Generator().manual_seed(1)
    n_tokens, n_experts, top_k = 50, 8, 2
    rank_TE = torch.randn(n_tokens, n_experts, generator=gen, dtype=torch.float64)
    rank_TE[:, 0] += 3.0  # every token prefers expert 0
    few = sinkhorn_log(rank_TE, top_k, 1).exp()
    many = sinkhorn_log(rank_TE, top_k, 300).exp()
    target = n_tokens * top_k / n_experts
    # columns are exact after every iteration (the last step), rows converge to K
    torch.testing.assert_close(few.sum(0), torch.full((n_experts,), target, dtype=torch.float64))
    torch.testing.assert_close(many.sum(0), torch.full((n_experts,), target, dtype=torch.float64))
    row_err_few = (few.sum(1) - top_k).abs().max()
    row_err_many = (many.sum(1) - top_k).abs().max()
    assert row_err_many < 1e-9 < row_err_few


def test_a_per_expert_shift_fades_with_the_iterations() -> None:
    # the columns' scaling absorbs a bias b_E: the limit is that of the unshifted scores
    gen = torch.Generator().manual_seed(4)
    rank_TE = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    bias_E = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3], dtype=torch.float64)
    gaps = [
        (sinkhorn_log(rank_TE + bias_E, 2, n) - sinkhorn_log(rank_TE, 2, n)).abs().max()
        for n in (1, 300)
    ]
    assert gaps[1] < 1e-9 < 1e-3 < gaps[0]


def test_large_logits_stay_finite() -> None:
    # exp(1000) overflows float64; the log-space iteration does not
    gen = torch.Generator().manual_seed(2)
    rank_TE = 1000 * torch.randn(64, 4, generator=gen)
    log_m = sinkhorn_log(rank_TE, 2, 8)
    assert torch.isfinite(log_m).all()
    torch.testing.assert_close(
        log_m.exp().sum(0), torch.full((4,), 64 * 2 / 4.0), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize(("n_tokens", "n_experts", "top_k"), [(40, 4, 1), (33, 6, 2), (9, 3, 3)])
def test_selection_matches_the_loop_reference(n_tokens, n_experts, top_k) -> None:
    gen = torch.Generator().manual_seed(n_tokens)
    rank_TE = torch.randn(n_tokens, n_experts, generator=gen, dtype=torch.float64)
    rank_TE[:, 0] += 2.0
    rule = _rule(n_experts, top_k, n_iters=5)
    out = rule.select(rank_TE, torch.softmax(rank_TE, -1), Budget(top_k, None, 0.0, True))
    assert out.ids_TK.tolist() == _reference_ids(rank_TE, top_k, 5)
    assert out.selected_TK.all()


def test_training_balances_the_load_that_top_k_skews() -> None:
    gen = torch.Generator().manual_seed(3)
    n_tokens, n_experts = 256, 4
    rank_TE = torch.randn(n_tokens, n_experts, generator=gen)
    rank_TE[:, 0] += 2.0
    probs_TE = torch.softmax(rank_TE, -1)
    rule = _rule(n_experts, 1)
    plain = rule.select(rank_TE, probs_TE, Budget(1, None, 0.0, False)).ids_TK
    balanced = rule.select(rank_TE, probs_TE, Budget(1, None, 0.0, True)).ids_TK
    load_plain = torch.bincount(plain.flatten(), minlength=n_experts)
    load_balanced = torch.bincount(balanced.flatten(), minlength=n_experts)
    assert load_plain.max() > 0.6 * n_tokens  # top-1: expert 0 takes most tokens
    assert load_balanced.max() < 1.25 * n_tokens / n_experts  # Sinkhorn: near T K / E each


def test_inference_is_top_k_exactly() -> None:
    torch.manual_seed(0)
    x_TD = torch.randn(50, 8)
    sink = Router(RouterConfig(d_model=8, n_experts=6, top_k=2, selection="sinkhorn"))
    topk = Router(RouterConfig(d_model=8, n_experts=6, top_k=2))
    topk.load_state_dict(sink.state_dict())
    with torch.no_grad():
        sink.bias.copy_(torch.linspace(-0.1, 0.1, 6))
        topk.bias.copy_(sink.bias)
        sink.weight.add_(torch.randn(6, 8))  # make the routing skewed
        topk.weight.copy_(sink.weight)
    sink.eval(), topk.eval()
    a, b = sink(x_TD), topk(x_TD)
    assert torch.equal(a.ids_TK, b.ids_TK) and torch.equal(a.weights_TK, b.weights_TK)
    assert torch.equal(sink(x_TD, top_k=3).ids_TK, topk(x_TD, top_k=3).ids_TK)
    sink.train(), topk.train()
    assert not torch.equal(sink(x_TD).ids_TK, topk(x_TD).ids_TK)  # training balances


@pytest.mark.parametrize("renorm", [False, True])
def test_gate_gradient_matches_a_loop_reference(renorm: bool) -> None:
    torch.manual_seed(0)
    config = RouterConfig(
        d_model=8, n_experts=4, top_k=2, selection="sinkhorn", renorm=renorm, sinkhorn_iters=3
    )
    router = Router(config)
    x_TD = torch.randn(21, 8)
    target_TK = torch.randn(21, 2)
    out = router(x_TD)
    (out.weights_TK * target_TK).sum().backward()

    weight = router.weight.detach().clone().requires_grad_(True)
    logits_TE = x_TD @ weight.t()
    probs_TE = torch.softmax(logits_TE, -1)
    chosen = _reference_ids(logits_TE.detach(), 2, 3)
    assert out.ids_TK.tolist() == chosen
    loss = 0.0
    for t in range(21):
        total = sum(probs_TE[t, e] for e in chosen[t]) if renorm else 1.0
        loss = loss + sum(probs_TE[t, e] / total * target_TK[t, j] for j, e in enumerate(chosen[t]))
    loss.backward()
    assert router.weight.grad is not None and weight.grad is not None
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)


def test_config_answers_and_refusals() -> None:
    config = RouterConfig(d_model=4, n_experts=8, top_k=2, selection="sinkhorn")
    assert config.sinkhorn_iters == 8
    assert (config.slots, config.expected_experts) == (2, 2.0)
    rule = config.selection_rule
    assert (rule.truncates, rule.sweep, rule.calibrates) == (False, "top_k", False)
    with pytest.raises(ValueError, match="sinkhorn_iters must be >= 1"):
        RouterConfig(d_model=4, n_experts=8, selection="sinkhorn", sinkhorn_iters=0)
    with pytest.raises(ValueError, match="renorm with top_k=1"):
        RouterConfig(d_model=4, n_experts=8, top_k=1, selection="sinkhorn", renorm=True)
    rule_obj = Sinkhorn(config.selection_config)
    bad_TE = torch.zeros(5, 8)
    bad_TE[:, 3] = -math.inf  # expert 3 can take no token
    with pytest.raises(ValueError, match="every expert's column"):
        rule_obj.select(bad_TE, torch.softmax(bad_TE, -1), Budget(2, None, 0.0, True))
    bad_TE[0, 3] = math.nan
    with pytest.raises(ValueError, match="not NaN"):
        rule_obj.select(bad_TE, torch.softmax(bad_TE, -1), Budget(2, None, 0.0, True))
    # an empty batch routes nothing
    empty = rule_obj.select(torch.zeros(0, 8), torch.zeros(0, 8), Budget(2, None, 0.0, True))
    assert empty.ids_TK.shape == (0, 2)


def test_a_tiny_model_learns_with_sinkhorn(tmp_path: Path) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "router": {"selection": "sinkhorn"}}
    train_learns(corpus, run, model=model)
    st = stats(run, max_batches=1)
    assert (st["selection"], st["truncating"]) == ("sinkhorn", False)
    for layer in st["layers"]:
        assert layer["active_experts"] == pytest.approx(2.0)  # inference: plain top-2
        assert layer["dropped_fraction"] == 0.0
