"""Per-token routing measures of one :class:`RouterOutput`: the single definition that
training's log lines (:func:`moelab.train.routing_numbers`) and the streaming statistics
of :mod:`moelab.diagnostics` both build on.

``discarded_T``
    ``1 - (map mass on the selected experts) / (map mass on all E experts)``. For maps on
    the simplex (softmax, sparsemax, entmax, normmax) the denominator is 1; for LapSum
    (values sum to k) and the elementwise sigmoid / relu it reads the values as shares.
    A row with no mass at all (relu of all-negative scores) discards 0.
``support_T``
    size of the support ``{i : probs_TE[i] > 0}``.
``contrib_TK``
    selected slots with a positive gate weight (fillers, weight exactly 0, excluded).
``computed_TK``
    slots whose expert runs (selected, not dropped, non-zero weight).

Shape legend: T tokens, E experts, K selection slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moelab.routing.output import RouterOutput

__all__ = ["TokenMeasures", "expert_load", "token_measures"]


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


def expert_load(ids_TK: torch.Tensor, mask_TK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert among those in ``mask_TK`` (int64, shape E)."""
    return torch.bincount(ids_TK[mask_TK].long(), minlength=n_experts)
