"""Sort-based dispatch and combine: send each computed slot to its expert, weight, sum back.

Shape legend (as in moelab.routing):
    T  tokens (batch and sequence flattened)
    D  model width
    F  expert hidden width (d_ff)
    E  experts
    K  selection slots per token
    S  all slots, T * K
    N  computed slots (selected, not dropped, non-zero weight), sorted by expert

The layer computes

    y_t = sum_{k : computed[t, k]} weights[t, k] * expert_{ids[t, k]}(x_t)

Fillers (selected with weight exactly 0), dropped and unselected slots are never computed,
so they cost nothing and receive no gradient.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GroupedExperts(Protocol):
    """What `dispatch_combine` needs from the experts: E, and a call on rows sorted by
    expert with the block sizes (see `SwiGLUExperts.forward`)."""

    n_experts: int

    def __call__(self, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor: ...


def dispatch_combine(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    computed_TK: torch.Tensor,
    experts: GroupedExperts,
) -> torch.Tensor:
    """y_t = sum over computed slots k of weights[t, k] * expert_{ids[t, k]}(x_t).

    Steps (no Python loop over tokens; one host sync):

    1. Key each slot by its expert id, and by E if it is not computed, so skipped slots
       sort to the end and fall out.
    2. Stable argsort of the keys: computed slots grouped by expert, token order kept
       within each group (so the result does not depend on sort ties).
    3. `bincount` of the keys gives the block size of each expert (their cumulative sum
       gives the block offsets, which `torch.split` takes care of); ``.tolist()`` is the
       single device-to-host sync (the block sizes must be known on the host to slice).
       Expert ids outside [0, E) at computed slots raise ValueError.
    4. Gather the N token rows in that order, run each expert on its contiguous block
       (the experts loop over E, see `SwiGLUExperts.forward`).
    5. Scale each output row by its slot weight and scatter-add into y with
       `index_add` (a token's K slots land on the same row).

    Args:
        x_TD: token representations.
        ids_TK: int64 expert ids of the slots.
        weights_TK: gate weights of the slots; receives gradient only at computed slots.
        computed_TK: bool, slots whose expert runs (`RouterOutput.computed_TK`).
        experts: E experts taking rows sorted by expert and their block sizes.

    Returns:
        y_TD in the promoted dtype of the expert outputs and the weights (e.g. float32
        for bfloat16 experts and float32 gates, so the K-way sum is accumulated in
        float32); `MoE` casts it back to the input dtype.
    """
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be (T, D), got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if ids_TK.dim() != 2 or ids_TK.shape[0] != T:
        raise ValueError(f"ids_TK must be (T={T}, K), got shape {tuple(ids_TK.shape)}")
    if weights_TK.shape != ids_TK.shape or computed_TK.shape != ids_TK.shape:
        raise ValueError(
            f"ids_TK {tuple(ids_TK.shape)}, weights_TK {tuple(weights_TK.shape)} and "
            f"computed_TK {tuple(computed_TK.shape)} must have the same shape"
        )
    K = ids_TK.shape[1]
    E = experts.n_experts

    # 1-3. Group the computed slots by expert. Skipped slots get the sentinel key E.
    computed_S = computed_TK.reshape(-1)
    ids_S = ids_TK.reshape(-1)
    invalid_S = computed_S & ((ids_S < 0) | (ids_S >= E))
    key_S = torch.where(computed_S & ~invalid_S, ids_S, E)
    order_S = torch.argsort(key_S, stable=True)
    # NOTE: the count of invalid ids rides along in the same transfer, so checking them
    # costs no second sync.
    *counts, n_invalid = torch.cat(
        [torch.bincount(key_S, minlength=E + 1), invalid_S.sum().view(1)]
    ).tolist()  # the one host sync
    if n_invalid:
        raise ValueError(
            f"ids_TK holds {n_invalid} expert ids outside [0, n_experts = {E}) at computed slots"
        )
    N = len(order_S) - counts[E]
    slot_N = order_S[:N]
    token_N = torch.div(slot_N, K, rounding_mode="floor")

    # 4. Gather rows in expert order and run each expert on its block.
    x_ND = x_TD.index_select(0, token_N)
    out_ND = experts(x_ND, counts[:E])

    # 5. Weight and scatter back. NOTE: only computed slots are gathered from weights_TK,
    # so fillers, dropped and unselected slots get exactly zero gradient.
    w_N = weights_TK.reshape(-1).index_select(0, slot_N)
    contrib_ND = out_ND * w_N.unsqueeze(-1)
    y_TD = contrib_ND.new_zeros(T, D)
    return y_TD.index_add(0, token_N, contrib_ND)
