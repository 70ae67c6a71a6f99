"""Sinkhorn-balanced selection (``selection="sinkhorn"``; S-BASE of Clark et al., 2022,
*Unified Scaling Laws for Routed Language Models*, https://arxiv.org/abs/2202.01169).

In training, the rule balances the token-expert matrix before it selects: starting from
M = exp(r), r the ranking scores (:meth:`Selection.rank`: the detached logits plus the
balancing bias and, in training, the exploration noise), it alternately rescales the rows
of M to sum to K and its columns to sum to T * K / E, ``sinkhorn_iters`` times (rows
first, columns last), and each token takes the top-K experts of its row of the
normalised matrix. Every expert is then asked for about T * K / E tokens (exactly, in
the limit of many iterations, when every entry is finite). The computation runs in log
space (log M = r + u_T + v_E, updated by ``logsumexp``), so large logits neither
overflow nor underflow; it has a fixed iteration count, so the forward pass needs no
host sync. Within a row the normalised matrix orders the experts as r + v_E does: the
balancing moves the choice through a per-expert shift v_E, like the loss-free bias.

The iteration count: S-BASE approximates the balanced assignment with a few Sinkhorn
iterations; Megatron-LM's ``sinkhorn`` iterates to a tolerance (a host sync per
iteration) and lucidrains' sinkhorn-router-pytorch runs 8 fixed iterations, this rule's
default (``RouterConfig.sinkhorn_iters``). K = 1 is S-BASE's setting; K > 1 takes the
top K of the balanced row, as Megatron-LM does.

The gates come from the router's ordinary map values (the gate stage: p, or p
renormalised over the K selected, ...), never from the normalised matrix; the
normalisation reads detached scores, so it carries no gradient.

The rule reads the whole batch in training: a token's experts depend on the other tokens
of the call, including later positions of its own sequence, so training-time routing is
**not causal across positions**. "The batch" is the tokens of one router call: under
data parallelism, the rank's micro-batch (batch and sequence flattened), never the
global batch. At inference (``Budget.training`` false) the rule is plain top-K
(:class:`~moelab.routing.selection.topk.TopK`), each token on its own, so inference is
causal. The balancing bias and the exploration (``noise_std``, ``sample_extra``) apply
as they do for top-K: the bias and the noise enter r before the normalisation, and
``sample_extra`` samples among the top K + c of the normalised row. A per-expert shift
such as the bias is what the column normalisation itself adjusts, so in training its
effect fades as the iterations grow (the limit does not depend on it); at inference it
shifts top-K as usual.

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import math

import torch

from moelab.maps import host_checks
from moelab.routing.selection.base import Budget, Selected
from moelab.routing.selection.topk import TopK

__all__ = ["Sinkhorn", "sinkhorn_log", "sinkhorn_potentials"]


def sinkhorn_potentials(
    rank_TE: torch.Tensor, top_k: int, n_iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_T1, v_1E) with log M = ``rank_TE`` + u_T1 + v_1E the Sinkhorn-normalised
    matrix: ``n_iters`` times, rescale the rows of M to sum to ``top_k`` and then its
    columns to sum to T * ``top_k`` / E (T > 0). Both are finite exactly when every
    entry is below +inf and not NaN and every row and column holds a finite entry."""
    n_tokens, n_experts = rank_TE.shape
    log_row = math.log(top_k)
    log_col = math.log(n_tokens * top_k / n_experts)
    u_T1 = rank_TE.new_zeros(n_tokens, 1)
    v_1E = rank_TE.new_zeros(1, n_experts)
    for _ in range(n_iters):
        u_T1 = log_row - torch.logsumexp(rank_TE + v_1E, dim=1, keepdim=True)
        v_1E = log_col - torch.logsumexp(rank_TE + u_T1, dim=0, keepdim=True)
    return u_T1, v_1E


def sinkhorn_log(rank_TE: torch.Tensor, top_k: int, n_iters: int) -> torch.Tensor:
    """log of the Sinkhorn-normalised matrix exp(``rank_TE``)
    (:func:`sinkhorn_potentials`). After the last iteration the column sums are exact
    and the row sums approach ``top_k``."""
    if rank_TE.shape[0] == 0:  # no tokens: nothing to balance
        return rank_TE
    u_T1, v_1E = sinkhorn_potentials(rank_TE, top_k, n_iters)
    return rank_TE + u_T1 + v_1E


class Sinkhorn(TopK):
    """Top-K of the Sinkhorn-balanced token-expert matrix in training; top-K at inference."""

    name = "sinkhorn"
    reads_batch = "training"
    reads_batch_why = (
        "in training the token-expert matrix is balanced over the call's tokens before "
        "top-K (at inference the rule is plain top-K)"
    )
    # NOTE: group-limited choice masks experts with -inf; a column of -inf has no
    # scaling that gives it T * K / E, so the rule refuses n_groups
    limits_groups = False

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        if budget.training and rank_TE.shape[0] > 0:
            u_T1, v_1E = sinkhorn_potentials(rank_TE, budget.top_k, self.config.sinkhorn_iters)
            # NOTE: checked on the T + E potentials, not on the (T, E) scores: far cheaper
            if host_checks() and not bool(torch.isfinite(u_T1).all() & torch.isfinite(v_1E).all()):
                raise ValueError(
                    "sinkhorn needs ranking scores below +inf, not NaN, with a finite entry "
                    "in every token's row and every expert's column"
                )
            rank_TE = rank_TE + u_T1 + v_1E
        return super().select(rank_TE, probs_TE, budget)
