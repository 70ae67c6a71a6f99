"""Balancing functions against hand-computed values and a plain-loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.routing.balancing import (
    bias_update,
    capacity,
    capacity_drop,
    expert_counts,
    load_stats,
    switch_loss,
    z_loss,
)

# Shape suffixes: T, E, K (moelab.shapes).

# ---------------------------------------------------------------------------- expert_counts


def test_expert_counts_hand() -> None:
    ids_TK = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 0]])
    mask_TK = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    counts_E = expert_counts(ids_TK, mask_TK, 4)
    assert counts_E.dtype == torch.float32
    assert counts_E.tolist() == [3.0, 2.0, 2.0, 0.0]


def test_expert_counts_rejects_bad_input() -> None:
    ids_TK = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="bool"):
        expert_counts(ids_TK, torch.ones(3, 2), 4)
    with pytest.raises(ValueError, match="shape"):
        expert_counts(ids_TK, torch.ones(3, 1, dtype=torch.bool), 4)


# ------------------------------------------------------------------------------ switch_loss

# 4 tokens, 3 experts, K=2; token 3 selects one expert only (its unused slot
# holds expert 0, which must not count).
PROBS_TE = torch.tensor(
    [
        [0.5, 0.3, 0.2],
        [0.1, 0.6, 0.3],
        [0.2, 0.2, 0.6],
        [0.4, 0.4, 0.2],
    ],
    dtype=torch.float64,
)
IDS_TK = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 0]])
SELECTED_TK = torch.tensor([[True, True], [True, True], [True, True], [True, False]])


def test_switch_loss_hand() -> None:
    # Selected slots per expert: e0: t0, t2, t3 -> 3; e1: t0, t1 -> 2; e2: t1, t2 -> 2.
    # Total 7 selected slots, f = (3/7, 2/7, 2/7).
    # P = column means: e0 (0.5+0.1+0.2+0.4)/4 = 0.3, e1 (0.3+0.6+0.2+0.4)/4 = 0.375,
    #                   e2 (0.2+0.3+0.6+0.2)/4 = 0.325.
    # L = 3 * (3/7*0.3 + 2/7*0.375 + 2/7*0.325) = 3 * (0.9 + 0.75 + 0.65)/7 = 6.9/7.
    loss = switch_loss(PROBS_TE, IDS_TK, SELECTED_TK, 3)
    assert loss.dim() == 0
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(6.9 / 7, abs=1e-12)
    # Had the unused slot (t3, k=1 -> expert 0) counted: f = (4/8, 2/8, 2/8) and
    # L = 3 * (0.15 + 0.09375 + 0.08125) = 0.975, a different value.
    assert loss.item() != pytest.approx(0.975, abs=1e-6)


def test_switch_loss_float32_for_half_inputs() -> None:
    loss = switch_loss(PROBS_TE.to(torch.bfloat16), IDS_TK, SELECTED_TK, 3)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(6.9 / 7, abs=1e-2)


def test_switch_loss_uniform_is_one() -> None:
    n_experts, top_k, n_tokens = 4, 2, 8
    # Each expert gets 4 of the 16 slots: balanced dispatch.
    ids_TK = torch.tensor([[t % 4, (t + 1) % 4] for t in range(n_tokens)])
    selected_TK = torch.ones(n_tokens, top_k, dtype=torch.bool)
    uniform_TE = torch.full((n_tokens, n_experts), 1 / n_experts, dtype=torch.float64)
    assert switch_loss(uniform_TE, ids_TK, selected_TK, n_experts).item() == pytest.approx(1.0)
    # Balanced dispatch: L = sum_i P_i = 1 for any probabilities summing to 1.
    probs_TE = torch.randn(n_tokens, n_experts, dtype=torch.float64).softmax(-1)
    assert switch_loss(probs_TE, ids_TK, selected_TK, n_experts).item() == pytest.approx(1.0)
    # Uniform probabilities: L = E * sum_i f_i / E = 1 for any dispatch.
    skewed_TK = torch.zeros(n_tokens, top_k, dtype=torch.int64)
    skewed_TK[:, 1] = 1
    assert switch_loss(uniform_TE, skewed_TK, selected_TK, n_experts).item() == pytest.approx(1.0)


def test_switch_loss_no_selection_is_zero() -> None:
    loss = switch_loss(PROBS_TE, IDS_TK, torch.zeros_like(SELECTED_TK), 3)
    assert loss.item() == 0.0
    no_tokens = switch_loss(PROBS_TE[:0], IDS_TK[:0], SELECTED_TK[:0], 3)
    assert no_tokens.item() == 0.0


def test_switch_loss_gradient_through_probs_only() -> None:
    probs_TE = PROBS_TE.clone().requires_grad_(True)
    switch_loss(probs_TE, IDS_TK, SELECTED_TK, 3).backward()
    # f is a constant: dL/dprobs[t, i] = E * f_i / T = 3 * f_i / 4 for every token.
    expected_E = torch.tensor([3 / 7, 2 / 7, 2 / 7], dtype=torch.float64) * 3 / 4
    assert probs_TE.grad is not None
    torch.testing.assert_close(probs_TE.grad, expected_E.expand(4, 3))


def test_switch_loss_gradient_reaches_logits_through_softmax() -> None:
    # aux_probs="softmax": P from softmax(logits); the gradient reaches every logit.
    logits_TE = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    switch_loss(logits_TE.softmax(-1), IDS_TK, SELECTED_TK, 3).backward()
    assert logits_TE.grad is not None and logits_TE.grad.abs().sum() > 0

    def loss_of(z_TE: torch.Tensor) -> torch.Tensor:
        return switch_loss(z_TE.softmax(-1), IDS_TK, SELECTED_TK, 3)

    assert torch.autograd.gradcheck(loss_of, (logits_TE.detach().requires_grad_(True),))


def test_switch_loss_shape_check() -> None:
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        switch_loss(PROBS_TE[:, :2], IDS_TK, SELECTED_TK, 3)


# ----------------------------------------------------------------------------------- z_loss


def test_z_loss_hand() -> None:
    # Row 0: logsumexp(0, 0) = ln 2.  Row 1: logsumexp(ln 3, 0) = ln(3 + 1) = 2 ln 2.
    # z-loss = ((ln 2)^2 + (2 ln 2)^2) / 2 = 2.5 (ln 2)^2.
    logits_TE = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    assert z_loss(logits_TE).item() == pytest.approx(2.5 * math.log(2.0) ** 2, abs=1e-12)


def test_z_loss_gradient_and_masked_logits() -> None:
    logits_TE = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    z_loss(logits_TE).backward()
    # dL/dz_ti = 2 lse(z_t) softmax(z_t)_i / T
    z_TE = logits_TE.detach()
    expected_TE = 2 * torch.logsumexp(z_TE, -1, keepdim=True) * z_TE.softmax(-1) / 5
    assert logits_TE.grad is not None
    torch.testing.assert_close(logits_TE.grad, expected_TE)
    # A masked (-inf) expert contributes nothing.
    masked_TE = torch.tensor([[0.0, -math.inf], [1.0, 1.0]], dtype=torch.float64)
    assert z_loss(masked_TE).item() == pytest.approx((0.0 + (1 + math.log(2.0)) ** 2) / 2)


# --------------------------------------------------------------------------------- capacity


def test_capacity_formula() -> None:
    assert capacity(8, 2, 4, 1.0) == 4  # 1.0 * 8 * 2 / 4
    assert capacity(8, 2, 4, 1.25) == 5  # 1.25 * 16 / 4
    assert capacity(10, 1, 3, 1.0) == 4  # ceil(10 / 3)
    assert capacity(4, 2, 3, 0.75) == 2  # 0.75 * 8 / 3
    assert capacity(0, 2, 4, 1.0) == 0
    # 1.1 * 10 / 11 is 1.0000000000000002 in floating point; the capacity is 1.
    assert capacity(10, 1, 11, 1.1) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity(8, 2, 4, 0.0)


# ---------------------------------------------------------------------------- capacity_drop


def test_capacity_drop_second_choice_before_later_first_choice() -> None:
    # T=4, K=2, E=3, cf=0.75 -> C = ceil(0.75 * 4 * 2 / 3) = 2 slots per expert.
    # Token 0 selects one expert only: its slot k=1 is unused (holds expert 0).
    ids_TK = torch.tensor([[1, 0], [2, 0], [0, 1], [1, 2]])
    selected_TK = torch.tensor([[True, False], [True, True], [True, True], [True, True]])
    # Admission in slot-major order, (t, k): expert -> fill after the slot
    #   k=0: (0,0): e1 -> 1   (1,0): e2 -> 1   (2,0): e0 -> 1   (3,0): e1 -> 2
    #   k=1: (0,1): unused, skipped, takes no capacity
    #        (1,1): e0 -> 2   (kept; it would be dropped had the unused slot counted)
    #        (2,1): e1 full   DROPPED: token 2's second choice loses to token 3's first
    #        (3,1): e2 -> 2   (kept)
    # Token-major order would have kept (2,1) and dropped (3,0) instead.
    dropped_TK = capacity_drop(ids_TK, selected_TK, 3, 0.75)
    expected_TK = torch.tensor([[False, False], [False, False], [False, True], [False, False]])
    assert dropped_TK.dtype == torch.bool
    assert torch.equal(dropped_TK, expected_TK)


def test_capacity_drop_first_choices_in_token_order() -> None:
    # T=4, K=1, E=2, cf=1.0 -> C = 2; every token picks expert 0: tokens 2 and 3 are dropped.
    ids_TK = torch.zeros(4, 1, dtype=torch.int64)
    selected_TK = torch.ones(4, 1, dtype=torch.bool)
    dropped_TK = capacity_drop(ids_TK, selected_TK, 2, 1.0)
    assert dropped_TK[:, 0].tolist() == [False, False, True, True]


def test_capacity_drop_unselected_never_dropped() -> None:
    # All slots point at expert 0, only the first two are selected; C = ceil(0.5*4*2/4) = 1.
    ids_TK = torch.zeros(4, 2, dtype=torch.int64)
    selected_TK = torch.tensor([[True, False], [True, False], [False, False], [False, False]])
    dropped_TK = capacity_drop(ids_TK, selected_TK, 4, 0.5)
    expected_TK = torch.zeros(4, 2, dtype=torch.bool)
    expected_TK[1, 0] = True  # the second selected slot overflows; unused slots never drop
    assert torch.equal(dropped_TK, expected_TK)


def test_capacity_drop_none_drops_nothing() -> None:
    ids_TK = torch.zeros(6, 2, dtype=torch.int64)
    selected_TK = torch.ones(6, 2, dtype=torch.bool)
    dropped_TK = capacity_drop(ids_TK, selected_TK, 4, None)
    assert dropped_TK.shape == (6, 2) and dropped_TK.dtype == torch.bool
    assert not dropped_TK.any()


def capacity_drop_reference(
    ids_TK: torch.Tensor, selected_TK: torch.Tensor, n_experts: int, capacity_factor: float
) -> torch.Tensor:
    """Plain loops: admit slots k-major, then t, count per expert."""
    n_tokens, top_k = ids_TK.shape
    cap = capacity(n_tokens, top_k, n_experts, capacity_factor)  # checked on its own above
    fill = [0] * n_experts
    dropped = [[False] * top_k for _ in range(n_tokens)]
    for k in range(top_k):
        for t in range(n_tokens):
            if not selected_TK[t, k]:
                continue
            e = int(ids_TK[t, k])
            if fill[e] < cap:
                fill[e] += 1
            else:
                dropped[t][k] = True
    return torch.tensor(dropped, dtype=torch.bool).reshape(n_tokens, top_k)


@pytest.mark.parametrize("seed", range(30))
def test_capacity_drop_matches_loop_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_tokens = int(torch.randint(1, 40, (), generator=gen))
    n_experts = int(torch.randint(1, 9, (), generator=gen))
    top_k = int(torch.randint(1, n_experts + 1, (), generator=gen))
    capacity_factor = [0.25, 0.5, 0.8, 1.0, 1.25, 2.0][seed % 6]
    if seed % 2:  # distinct experts per token, as top-K gives, skewed towards low ids
        skew_E = torch.linspace(2.0, 0.0, n_experts)
        scores_TE = torch.randn(n_tokens, n_experts, generator=gen) + skew_E
        ids_TK = scores_TE.topk(top_k, dim=-1).indices
    else:  # arbitrary ids, repeats allowed
        ids_TK = torch.randint(0, n_experts, (n_tokens, top_k), generator=gen)
    selected_TK = torch.rand(n_tokens, top_k, generator=gen) < 0.8
    ids_TK = torch.where(selected_TK, ids_TK, 0)  # unused slots hold expert 0
    expected_TK = capacity_drop_reference(ids_TK, selected_TK, n_experts, capacity_factor)
    dropped_TK = capacity_drop(ids_TK, selected_TK, n_experts, capacity_factor)
    assert torch.equal(dropped_TK, expected_TK)
    # No expert keeps more than its capacity.
    kept_E = expert_counts(ids_TK, selected_TK & ~dropped_TK, n_experts)
    assert kept_E.max() <= capacity(n_tokens, top_k, n_experts, capacity_factor)


# ------------------------------------------------------------------------------ bias_update


def test_bias_update_hand() -> None:
    bias_E = torch.tensor([0.0, 0.1, -0.2, 0.0])
    load_E = torch.tensor([4, 1, 2, 1])  # mean 2
    # sign(mean - load) = (-1, +1, 0, +1); rate 0.01:
    # (0 - 0.01, 0.1 + 0.01, -0.2 + 0, 0 + 0.01)
    new_E = bias_update(bias_E, load_E, 0.01)
    torch.testing.assert_close(new_E, torch.tensor([-0.01, 0.11, -0.2, 0.01]))
    assert new_E.dtype == bias_E.dtype
    assert new_E is not bias_E
    assert bias_E.tolist() == pytest.approx([0.0, 0.1, -0.2, 0.0])  # input untouched


def test_bias_update_balanced_and_no_grad() -> None:
    bias_E = torch.zeros(3, requires_grad=True)
    new_E = bias_update(bias_E, torch.tensor([5.0, 5.0, 5.0]), 0.1)
    assert new_E.tolist() == [0.0, 0.0, 0.0]
    assert not new_E.requires_grad


# ------------------------------------------------------------------------------- load_stats


def test_load_stats_hand_with_filler() -> None:
    # t0: experts 0, 1 with weights 0.7, 0.3
    # t1: experts 0, 2 with weights 1.0, 0.0  -> (1, 1) is a filler: nominal, not contributor
    # t2: expert 1 (weight 1.0); its slot k=1 is unused (expert 0, weight 0)
    ids_TK = torch.tensor([[0, 1], [0, 2], [1, 0]])
    weights_TK = torch.tensor([[0.7, 0.3], [1.0, 0.0], [1.0, 0.0]])
    selected_TK = torch.tensor([[True, True], [True, True], [True, False]])
    stats = load_stats(ids_TK, selected_TK, weights_TK, 3)
    # Nominal counts (2, 2, 1), total 5 -> shares (0.4, 0.4, 0.2), mean 1/3,
    # deviations (1/15, 1/15, -2/15), var = 6/225/3 = 2/225, sd = sqrt(2)/15,
    # cv = sd / (1/3) = sqrt(2)/5, max/mean = 0.4 * 3 = 1.2.
    torch.testing.assert_close(stats["nominal_share_E"], torch.tensor([0.4, 0.4, 0.2]))
    assert stats["nominal_sd"].item() == pytest.approx(math.sqrt(2) / 15, rel=1e-6)
    assert stats["nominal_cv"].item() == pytest.approx(math.sqrt(2) / 5, rel=1e-6)
    assert stats["nominal_max_over_mean"].item() == pytest.approx(1.2, rel=1e-6)
    # Contributor counts (2, 2, 0), total 4 -> shares (0.5, 0.5, 0), mean 1/3,
    # deviations (1/6, 1/6, -1/3), var = (1 + 1 + 4)/36/3 = 1/18, sd = sqrt(2)/6,
    # cv = sqrt(2)/2, max/mean = 1.5.
    torch.testing.assert_close(stats["contrib_share_E"], torch.tensor([0.5, 0.5, 0.0]))
    assert stats["contrib_sd"].item() == pytest.approx(math.sqrt(2) / 6, rel=1e-6)
    assert stats["contrib_cv"].item() == pytest.approx(math.sqrt(2) / 2, rel=1e-6)
    assert stats["contrib_max_over_mean"].item() == pytest.approx(1.5, rel=1e-6)
    assert all(v.dtype == torch.float32 for v in stats.values())


def test_load_stats_cv_matches_count_cv() -> None:
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(0, 6, (50, 2), generator=gen)
    weights_TK = torch.rand(50, 2, generator=gen)
    selected_TK = torch.ones(50, 2, dtype=torch.bool)
    stats = load_stats(ids_TK, selected_TK, weights_TK, 6)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=6).double()
    cv = (counts_E.std(correction=0) / counts_E.mean()).item()
    assert stats["nominal_cv"].item() == pytest.approx(cv, rel=1e-5)
    assert stats["contrib_cv"].item() == pytest.approx(cv, rel=1e-5)  # all weights > 0
