"""Routing measures: the single definition of every per-token and per-expert number that
the router, the MoE layer, training's log lines (:func:`moelab.train.routing_numbers`),
the streaming statistics of :mod:`moelab.diagnostics` and the reports build on.

Per token (:func:`token_measures`):

``discarded_T``
    ``1 - (map mass on the selected experts) / (map mass on all E experts)``. For maps on
    the simplex (softmax, sparsemax, entmax, normmax) the denominator is 1, for LapSum
    k. The elementwise sigmoid / relu / sqrtsoftplus have no fixed total
    (``MapInfo.fixed_total``): the statistics and logs report no discarded mass for
    them, whatever this gives.
    A row with no mass at all (relu of all-negative scores) discards 0.
``support_T``
    size of the support ``{i : probs_TE[i] > 0}``.
``contrib_TK``
    selected slots with a positive gate weight (fillers, weight exactly 0, excluded).
``computed_TK``
    slots whose expert runs (selected, not dropped, non-zero weight).
``unrouted_T`` (:func:`unrouted`)
    the token has no selected slot: it reaches no expert (expert choice, a cut on p).

Per expert and per row of values:

:func:`expert_counts`
    slots per expert, counted on the device (no host sync).
:func:`load_cv`
    ``std(load) / mean(load)``, the load imbalance (population std).
:func:`top2_gap`
    largest minus second-largest value of each row (score gaps, gate margins).

Shape suffixes: T, E, K, J (moelab.shapes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moelab.routing.output import RouterOutput

__all__ = [
    "TokenMeasures",
    "check_slots",
    "expert_counts",
    "load_cv",
    "token_measures",
    "top2_gap",
    "unrouted",
]


class TokenMeasures(NamedTuple):
    """What :func:`token_measures` returns (all detached)."""

    discarded_T: torch.Tensor
    support_T: torch.Tensor
    contrib_TK: torch.Tensor
    computed_TK: torch.Tensor


@torch.no_grad()
def token_measures(out: RouterOutput, dtype: torch.dtype = torch.float32) -> TokenMeasures:
    """The per-token measures of ``out``, the mass computed in ``dtype``."""
    probs_TE = out.probs_TE.detach().to(dtype)
    selected_TK = out.selected_TK.detach().bool()
    weights_TK = out.weights_TK.detach()
    kept_T = (probs_TE.gather(-1, out.ids_TK.long()) * selected_TK).sum(-1)
    total_T = probs_TE.sum(-1)
    share_T = torch.where(total_T > 0, kept_T / total_T.clamp_min(torch.finfo(dtype).tiny), 1.0)
    return TokenMeasures(
        discarded_T=1.0 - share_T,
        support_T=(probs_TE > 0).sum(-1),
        contrib_TK=selected_TK & (weights_TK > 0),
        computed_TK=out.computed_TK.detach(),
    )


def unrouted(selected_TK: torch.Tensor) -> torch.Tensor:
    """bool (T,): tokens with no selected slot, which reach no expert (the residual
    carries them)."""
    return ~selected_TK.detach().bool().any(-1)


def check_slots(ids_TK: torch.Tensor, mask_TK: torch.Tensor, n_experts: int) -> None:
    """Raise ValueError unless ``ids_TK`` is an integer (T, K) tensor, ``mask_TK`` a bool
    tensor of the same shape and ``n_experts`` positive (metadata only: no host sync)."""
    if n_experts <= 0:
        raise ValueError(f"n_experts must be positive, got {n_experts}")
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK must have shape (T, K), got {tuple(ids_TK.shape)}")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise ValueError(f"ids_TK must hold integer expert ids, got dtype {ids_TK.dtype}")
    if mask_TK.shape != ids_TK.shape:
        raise ValueError(
            f"mask shape {tuple(mask_TK.shape)} must equal ids_TK shape {tuple(ids_TK.shape)}"
        )
    if mask_TK.dtype != torch.bool:
        raise ValueError(f"the slot mask must be a bool tensor, got dtype {mask_TK.dtype}")


def expert_counts(
    ids_TK: torch.Tensor,
    mask_TK: torch.Tensor,
    n_experts: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Number of slots in ``mask_TK`` routed to each expert.

    counts_i = sum_{t,k} mask[t, k] * 1[ids[t, k] = i]

    Counted on the device without a host sync (so it also runs inside
    ``torch.compile(fullgraph=True)``): slots outside the mask go to an extra bin E that is
    cut off, and ``scatter_add`` adds them up. NOTE: not ``bincount(ids[mask])``: boolean
    indexing and ``bincount`` (whose output length depends on the values) both read the
    device on the host.

    Args:
        ids_TK: integer expert ids, shape (T, K); values in [0, n_experts) where the mask
            is set (anything elsewhere: unused slots are never read).
        mask_TK: bool, shape (T, K): which slots count.
        n_experts: E.
        dtype: of the result; counted in int64, then converted (float32, the default, is
            exact up to 2**24 slots per expert).

    Returns:
        shape (E,), in ``dtype``.
    """
    check_slots(ids_TK, mask_TK, n_experts)
    key_J = torch.where(mask_TK, ids_TK.long(), n_experts).reshape(-1)  # J = T * K slots
    counts_E1 = torch.zeros(n_experts + 1, dtype=torch.int64, device=ids_TK.device)
    counts_E1.scatter_add_(0, key_J, torch.ones_like(key_J))
    return counts_E1[:n_experts].to(dtype)


def load_cv(load_E: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation of a per-expert load: ``std(load) / mean(load)``.

    Population std (``correction=0``), computed in float64 for integer loads and in the
    load's own dtype otherwise. The same for counts and for shares (count / total). NaN
    when the load is all zero: the imbalance of no load is undefined.

    Args:
        load_E: shape (..., E): slot counts or shares per expert.

    Returns:
        shape (...,).
    """
    load = load_E if load_E.is_floating_point() else load_E.to(torch.float64)
    return load.std(dim=-1, correction=0) / load.mean(dim=-1)


def top2_gap(values_TE: torch.Tensor) -> torch.Tensor:
    """Largest minus second-largest value of each row: ``v_(1) - v_(2)`` (>= 0).

    On router logits it is the top-2 score gap of the statistics; on gate values the
    top-1 margin of the certified radius (:func:`moelab.routing.certification.top1_margin`).
    A tie for the top place gives 0. Masked experts (-inf) are allowed: a row whose second
    value is -inf has gap +inf, and a row whose largest is -inf (all masked) gives NaN.

    Args:
        values_TE: shape (..., E) with E >= 2.

    Returns:
        shape (...,), the dtype of ``values_TE``.
    """
    if values_TE.shape[-1] < 2:
        raise ValueError(
            f"a top-2 gap needs at least 2 experts, got {values_TE.shape[-1]}; "
            "with one expert the routing can never change"
        )
    top2 = torch.topk(values_TE, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]
