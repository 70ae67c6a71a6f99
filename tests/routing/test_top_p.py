"""Top-p (dynamic) selection (Huang et al., 2024): the rule against a per-token loop in
float64 (ties, masked experts, several p and caps), the gradient of its gates against the
loop's autograd, the entropy ("dynamic") loss on a hand-computed fixture, a 50-step tiny
training run and the statistics of its router outputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moelab.diagnostics.accumulators import routing_stats
from moelab.routing import Router, RouterConfig, selection
from moelab.routing.balancing import entropy_loss
from moelab.routing.selection import Budget
from moelab.routing.selection.top_p import TopP, select_top_p


def reference_top_p(probs_E: list[float], top_p: float, cap: int) -> list[int]:
    """The experts one token keeps: walk the experts by p, descending, and stop once the
    kept p reach top_p, at the cap, or at an expert of p = 0 (after the first)."""
    order = sorted(range(len(probs_E)), key=lambda e: -probs_E[e])
    kept: list[int] = []
    total = 0.0
    for e in order[:cap]:
        if kept and (total >= top_p or probs_E[e] == 0.0):
            break
        kept.append(e)
        total += probs_E[e]
    return kept


def _logits(n_tokens: int, n_experts: int, seed: int) -> torch.Tensor:
    """float64 logits: half the rows with ties (small integers), some experts masked."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, n_experts, generator=g, dtype=torch.float64)
    ties = torch.randint(0, 3, (n_tokens // 2, n_experts), generator=g).double()
    logits[: n_tokens // 2] = ties
    mask = torch.rand(n_tokens, n_experts, generator=g) < 0.25
    mask[:, 0] = False  # every row keeps an unmasked expert
    return logits.masked_fill(mask, -math.inf)


def _budget(top_k: int) -> Budget:
    return Budget(top_k=top_k, lapsum_k=None, truncation=0.0, training=False)


@pytest.mark.parametrize("top_p", [0.2, 0.4, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("cap", [1, 3, 8])
def test_top_p_matches_a_per_token_loop(top_p: float, cap: int) -> None:
    logits = _logits(64, 8, seed=cap)
    probs = torch.softmax(logits, -1)
    rc = RouterConfig(d_model=4, n_experts=8, top_p_cap=cap, selection="top_p", top_p=top_p)
    rule = TopP(rc.selection_config)
    ids_TK, selected_TK = rule(logits, probs, torch.zeros(8), _budget(cap))
    assert ids_TK.shape == selected_TK.shape == (64, cap)
    for t in range(64):
        row = probs[t].tolist()
        kept = reference_top_p(row, top_p, cap)
        got = ids_TK[t][selected_TK[t]].tolist()
        # ties may swap experts of equal p, never the count or the kept values
        assert len(got) == len(kept), (t, row)
        assert sorted(row[e] for e in got) == sorted(row[e] for e in kept)
        assert len(set(got)) == len(got)
        if cap == 8 and top_p == 1.0:  # p = 1 keeps the support, never a masked expert
            assert len(got) == int((probs[t] > 0).sum())
        assert all(row[e] > 0 for e in got)


def test_top_p_on_exact_fixtures() -> None:
    probs = torch.tensor(
        [[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    ids_TK, selected_TK = select_top_p(probs.log(), probs, 0.5, 4)
    # row 0: 0.5 reaches 0.5 -> 1 expert; row 1: 0.25 + 0.25 -> 2; row 2: the one nonzero
    assert selected_TK.sum(-1).tolist() == [1, 2, 1]
    assert ids_TK[0, 0] == 0 and ids_TK[2, 0] == 1
    _, selected_TK = select_top_p(probs.log(), probs, 0.75, 4)
    assert selected_TK.sum(-1).tolist() == [2, 3, 1]


def test_the_rule_answers_and_its_settings_are_checked() -> None:
    rc = RouterConfig(d_model=4, n_experts=8, top_p_cap=3, selection="top_p", top_p=0.7)
    assert rc.selection_rule is TopP and selection.get("top_p") is TopP
    assert (rc.slots, rc.expected_experts, Router(rc).top_k) == (3, 3.0, 3)
    # no cap (the default): K is every expert, whatever top_k says
    rc = RouterConfig(d_model=4, n_experts=8, top_k=2, selection="top_p", top_p=0.7)
    assert (rc.top_p_cap, rc.slots, rc.expected_experts, Router(rc).top_k) == (None, 8, 8.0, 8)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"top_p_cap must lie in \[1, n_experts=8\]"):
            RouterConfig(d_model=4, n_experts=8, selection="top_p", top_p_cap=bad)
    with pytest.raises(ValueError, match="top_p_cap caps selection='top_p'"):
        RouterConfig(d_model=4, n_experts=8, top_p_cap=2)
    assert (TopP.truncates, TopP.sweep, TopP.calibrates) == (True, "top_k", False)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
            RouterConfig(d_model=4, n_experts=8, selection="top_p", top_p=bad)
    with pytest.raises(ValueError, match="entropy_loss_weight must be >= 0"):
        RouterConfig(d_model=4, n_experts=8, entropy_loss_weight=-1.0)


def test_gate_gradient_reaches_the_router_weight_as_in_the_loop() -> None:
    torch.manual_seed(0)
    rc = RouterConfig(
        d_model=6, n_experts=8, top_p_cap=4, selection="top_p", top_p=0.6, init_std=0.7
    )
    router = Router(rc)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=g)
    target = torch.randn(40, 8, generator=g)
    out = router(x)
    assert out.selected_TK.sum(-1).min() >= 1 and out.selected_TK.sum(-1).max() > 1
    (out.weights_TK * target.gather(-1, out.ids_TK)).sum().backward()
    # the loop: float64 weights, each token's kept set from the reference rule, gate = p
    w = router.weight.detach().double().requires_grad_(True)
    total = w.new_zeros(())
    for t in range(40):
        p = torch.softmax(x[t].double() @ w.t(), -1)
        for e in reference_top_p(p.tolist(), 0.6, 4):
            total = total + p[e] * target[t, e].double()
    total.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(router.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)


def _identity_router(**kw) -> Router:
    """A router whose logits are its input (W = I, temperature 1)."""
    kw = {"aux_weight": 0.0, **kw}  # the dynamic loss alone in aux_loss
    router = Router(RouterConfig(d_model=4, n_experts=4, selection="top_p", **kw))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router


FIXTURE = torch.tensor(
    [[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25], [0.9, 0.05, 0.03, 0.02]]
).log()
"""Rows of log p: at top_p = 0.7 they keep 2, 3 and 1 experts (cap 4)."""


def test_entropy_loss_is_the_hand_computed_mean_entropy() -> None:
    ln2 = math.log(2)
    two = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(entropy_loss(two)) == pytest.approx(ln2 / 2)
    router = _identity_router(top_p_cap=4, top_p=0.7, entropy_loss_weight=0.1)
    out = router(FIXTURE[:2])
    # row 0: 0.5 ln2 + 0.25 * 2 ln2 + 2 * 0.125 * 3 ln2 = 1.75 ln2; row 1: 2 ln2
    assert float(out.losses["entropy"].detach()) == pytest.approx(1.875 * ln2, rel=1e-5)
    assert float(out.aux_loss.detach()) == pytest.approx(0.1 * 1.875 * ln2, rel=1e-5)
    out.aux_loss.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    off = _identity_router(top_p_cap=4, top_p=0.7)(FIXTURE[:2])
    assert "entropy" not in off.losses and float(off.aux_loss) == 0.0


@pytest.mark.parametrize("map_name", ["softmax", "sparsemax"])
def test_entropy_loss_gradient_is_finite_with_zero_probabilities(map_name: str) -> None:
    from moelab import maps

    logits = torch.tensor([[0.0, 1.0, -math.inf, 2.0], [3.0, 0.0, 0.0, -1.0]])
    logits.requires_grad_(True)
    probs = maps.get(map_name)(logits)
    assert (probs == 0).any()
    entropy_loss(probs).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(("cap", "per_token"), [(4, [2, 3, 1]), (2, [2, 2, 1])])
def test_stats_count_the_selected_experts(cap: int, per_token: list[int]) -> None:
    out = _identity_router(top_p_cap=cap, top_p=0.7)(FIXTURE)
    assert out.selected_TK.sum(-1).tolist() == per_token  # by hand, see FIXTURE
    res = routing_stats([out], "softmax")["layers"][0]
    mean = sum(per_token) / 3
    assert res["active_experts"] == pytest.approx(mean)
    assert res["contributors"] == pytest.approx(mean)


def test_a_tiny_model_trains_with_top_p(tmp_path: Path) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    router = {"selection": "top_p", "top_p": 0.7, "entropy_loss_weight": 0.01}
    train_learns(corpus, run, model=dict(TINY_MODEL, router=router))
    st = stats(run, max_batches=1)
    n_experts = TINY_MODEL.get("n_experts", 8)
    assert (st["selection"], st["truncating"], st["top_k"]) == ("top_p", True, n_experts)
    for layer in st["layers"]:
        assert 1.0 <= layer["active_experts"] <= n_experts


def test_without_a_cap_a_token_keeps_more_than_top_k_experts() -> None:
    """The rule's definition: the prefix is taken among all E experts. A flat row needs
    every expert to reach top_p = 0.95; the default top_k (2) is no cap."""
    flat = torch.zeros(1, 4)  # p = 0.25 each
    out = _identity_router(top_p=0.95)(flat)
    assert out.selected_TK.sum(-1).tolist() == [4]
    assert out.ids_TK.shape == (1, 4)
    capped = _identity_router(top_p=0.95, top_p_cap=2)(flat)
    assert capped.selected_TK.sum(-1).tolist() == [2]
    # a call's top_k is the cap of that call (the K sweep)
    assert _identity_router(top_p=0.95)(flat, top_k=3).selected_TK.sum(-1).tolist() == [3]
