"""Sort-based dispatch in three steps: permute -> experts -> unpermute.

Shape suffixes: T, D, E, K, J, N (moelab.shapes).

The layer computes

    y_t = sum_{k : computed[t, k]} weights[t, k] * expert_{ids[t, k]}(x_t)

as

    permuted = permute(x_TD, ids_TK, weights_TK, computed_TK, E)   # rows grouped by expert
    y_ND = experts(permuted.x_ND, permuted.counts_E)                # each expert on its block
    y_TD = unpermute(y_ND, permuted.plan)                           # weight, sum back per token

The steps only meet through ``x_ND``, ``counts_E`` and ``y_ND``, so whatever maps rows
sorted by expert to rows in the same order can go between them: an all-to-all that sends
each expert's block to the rank holding it and back (expert parallelism), or a grouped
GEMM in place of the loop over experts (the block offsets are ``cumsum(counts_E)``).

Fillers (selected with weight exactly 0), dropped and unselected slots are never computed,
so they cost nothing and receive no gradient.

Under ``torch.compile`` `MoE` takes `permute_padded` instead: no host sync, every slot
keeps a row (the skipped ones weighted 0 at the end), the block ends stay on the device
for grouped GEMM (`SwiGLUExperts.forward_offsets`), so no shape depends on the routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from moelab.routing.measures import expert_counts

if TYPE_CHECKING:
    from moelab.routing.config import RouterConfig
    from moelab.routing.output import RouterOutput


class GroupedExperts(Protocol):
    """What `dispatch_combine` needs from the experts: E, and a call on rows sorted by
    expert with the block sizes (see `SwiGLUExperts.forward`)."""

    n_experts: int

    def __call__(self, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor: ...


class ExpertDispatch(Protocol):
    """What `MoE` calls at its seam when its experts are spread over ranks
    (``MoE.expert_dispatch``; `moelab.moe.expert_parallel.ExpertParallelDispatch`):
    ``drop`` right after the router (the capacity limit of the ranks that share the
    experts), then the call in place of ``experts(x_ND, counts_E)``, returning the
    rows' outputs in ``x_ND``'s order."""

    def drop(self, out: RouterOutput, config: RouterConfig) -> RouterOutput: ...

    def __call__(
        self, experts: GroupedExperts, x_ND: torch.Tensor, counts_E: list[int]
    ) -> torch.Tensor: ...


class Plan(NamedTuple):
    """What `unpermute` needs to undo `permute` (it stays with the tokens' owner)."""

    token_N: torch.Tensor
    """int64: the token of each permuted row (a token's K rows share it)."""
    weight_N: torch.Tensor
    """The gate weight of each permuted row (gradient flows to ``weights_TK`` through it)."""
    n_tokens: int
    """T, the number of output rows."""


class Permuted(NamedTuple):
    """What `permute` returns."""

    x_ND: torch.Tensor
    """The token rows of the computed slots, grouped by expert (token order within each)."""
    counts_E: list[int]
    """Rows per expert: expert e owns rows ``sum(counts_E[:e]) : sum(counts_E[:e + 1])``.
    A host list: the block sizes must be known on the host to slice (or to size an
    all-to-all); reading them is the dispatch's one host sync."""
    plan: Plan
    """How to scatter the expert outputs back (`unpermute`)."""


def permute(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    computed_TK: torch.Tensor,
    n_experts: int,
) -> Permuted:
    """Gather the rows of the computed slots, grouped by expert.

    Steps (no Python loop over tokens; one host sync):

    1. Key each slot by its expert id, and by E if it is not computed, so skipped slots
       sort to the end and fall out.
    2. Stable argsort of the keys: computed slots grouped by expert, token order kept
       within each group (so the result does not depend on sort ties).
    3. The block size of each expert (`moelab.routing.measures.expert_counts`, on the
       device); ``.tolist()`` is the single device-to-host sync. Expert ids outside
       [0, E) at computed slots raise ValueError (their count rides along in the same
       transfer, so the check costs no second sync).
    4. Gather the N token rows and their gate weights in that order.

    Args:
        x_TD: token representations.
        ids_TK: int64 expert ids of the slots.
        weights_TK: gate weights of the slots; receives gradient only at computed slots.
        computed_TK: bool, slots whose expert runs (`RouterOutput.computed_TK`).
        n_experts: E.

    Returns:
        `Permuted`: ``x_ND``, ``counts_E`` and the `Plan` for `unpermute`.
    """
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be (T, D), got shape {tuple(x_TD.shape)}")
    T = x_TD.shape[0]
    if ids_TK.dim() != 2 or ids_TK.shape[0] != T:
        raise ValueError(f"ids_TK must be (T={T}, K), got shape {tuple(ids_TK.shape)}")
    if weights_TK.shape != ids_TK.shape or computed_TK.shape != ids_TK.shape:
        raise ValueError(
            f"ids_TK {tuple(ids_TK.shape)}, weights_TK {tuple(weights_TK.shape)} and "
            f"computed_TK {tuple(computed_TK.shape)} must have the same shape"
        )
    K, E = ids_TK.shape[1], n_experts

    # 1-3. Group the computed slots by expert. Skipped slots get the sentinel key E.
    invalid_TK = computed_TK & ((ids_TK < 0) | (ids_TK >= E))
    valid_TK = computed_TK & ~invalid_TK
    key_J = torch.where(valid_TK, ids_TK, E).reshape(-1)
    order_J = torch.argsort(key_J, stable=True)
    counts_dev_E = expert_counts(ids_TK, valid_TK, E, torch.int64)
    *counts_E, n_invalid = torch.cat([counts_dev_E, invalid_TK.sum().view(1)]).tolist()
    # ^ the one host sync
    if n_invalid:
        raise ValueError(
            f"ids_TK holds {n_invalid} expert ids outside [0, n_experts = {E}) at computed slots"
        )
    slot_N = order_J[: sum(counts_E)]
    token_N = torch.div(slot_N, K, rounding_mode="floor")

    # 4. NOTE: only computed slots are gathered from weights_TK, so fillers, dropped and
    # unselected slots get exactly zero gradient.
    plan = Plan(token_N, weights_TK.reshape(-1).index_select(0, slot_N), T)
    return Permuted(x_TD.index_select(0, token_N), counts_E, plan)


class PermutedPadded(NamedTuple):
    """What `permute_padded` returns: all J = T * K slots, computed ones first."""

    x_JD: torch.Tensor
    """The token rows of all slots: the computed ones grouped by expert (token order
    within each), then the skipped ones (zeroed by the experts, `SwiGLUExperts.forward_offsets`)."""
    offs_E: torch.Tensor
    """int32 on the device: ``cumsum(counts_E)``, the end row of each expert's block; rows
    from ``offs_E[-1]`` on belong to no expert."""
    expert_J: torch.Tensor
    """int64: the expert of each row, E for a skipped slot."""
    plan: Plan
    """For `unpermute`; the weight of a skipped row is exactly 0 (``torch.where``)."""


def permute_padded(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    computed_TK: torch.Tensor,
    n_experts: int,
) -> PermutedPadded:
    """`permute` without the host sync: every one of the J = T * K slots keeps a row, so
    the shapes never depend on the routing (what ``torch.compile`` needs to trace one
    graph per input shape). Skipped slots (not computed) sort to the end; their weight is
    set to 0 by ``torch.where`` (not multiplied, so whatever the experts leave in those
    rows cannot reach the output or a gradient), and the block ends stay on the device
    (``offs_E``) for ``torch._grouped_mm``.

    Expert ids outside [0, E) at computed slots are not checked here (that takes a host
    read): they count as skipped. Same arguments as `permute`.
    """
    T, K = ids_TK.shape
    E = n_experts
    valid_TK = computed_TK & (ids_TK >= 0) & (ids_TK < E)
    key_J = torch.where(valid_TK, ids_TK, E).reshape(-1)
    order_J = torch.argsort(key_J, stable=True)
    expert_J = key_J.index_select(0, order_J)
    counts_E = expert_counts(ids_TK, valid_TK, E, torch.int64)
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    token_J = torch.div(order_J, K, rounding_mode="floor")
    weight_J = weights_TK.reshape(-1).index_select(0, order_J)
    weight_J = torch.where(expert_J < E, weight_J, torch.zeros_like(weight_J))
    plan = Plan(token_J, weight_J, T)
    return PermutedPadded(x_TD.index_select(0, token_J), offs_E, expert_J, plan)


def unpermute(y_ND: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Weight each expert output row by its gate weight and sum it into its token's row:
    ``y[t] = sum_{n : token[n] = t} weight[n] * y_N[n]`` (`index_add`; a token's K rows
    land on the same row).

    Args:
        y_ND: the expert outputs, in the row order of `permute`'s ``x_ND``.
        plan: `permute`'s plan.

    Returns:
        y_TD in the promoted dtype of ``y_ND`` and the weights (e.g. float32 for bfloat16
        experts and float32 gates, so the K-way sum is accumulated in float32); `MoE`
        casts it back to the input dtype. Rows of tokens with no computed slot are 0.
    """
    if y_ND.dim() != 2 or y_ND.shape[0] != plan.token_N.shape[0]:
        raise ValueError(
            f"y_ND must have one row per permuted row ({plan.token_N.shape[0]}), "
            f"got shape {tuple(y_ND.shape)}"
        )
    contrib_ND = y_ND * plan.weight_N.unsqueeze(-1)
    y_TD = contrib_ND.new_zeros(plan.n_tokens, y_ND.shape[1])
    return y_TD.index_add(0, plan.token_N, contrib_ND)


def dispatch_combine(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    computed_TK: torch.Tensor,
    experts: GroupedExperts,
) -> torch.Tensor:
    """y_t = sum over computed slots k of weights[t, k] * expert_{ids[t, k]}(x_t):
    `permute`, the experts on their blocks, `unpermute`.

    Args:
        x_TD, ids_TK, weights_TK, computed_TK: as in `permute`.
        experts: E experts taking rows sorted by expert and their block sizes.

    Returns:
        y_TD, as in `unpermute`.
    """
    x_ND, counts_E, plan = permute(x_TD, ids_TK, weights_TK, computed_TK, experts.n_experts)
    # NOTE: the seam: expert parallelism's all-to-all (moelab.moe.expert_parallel) sends
    # x_ND's blocks to their experts' ranks here and brings y_ND back in the same order
    # (MoE.forward calls it; this function runs every expert in this process).
    y_ND = experts(x_ND, counts_E)
    return unpermute(y_ND, plan)
