"""Expert-choice selection: each expert takes its top-C tokens of the batch
(``selection="expert_choice"``; Zhou et al., 2022, *Mixture-of-Experts with Expert Choice
Routing*, https://arxiv.org/abs/2202.09368).

The token-to-expert affinity is the softmax over the experts of the ranking scores
(:meth:`Selection.rank`: the detached logits, plus the balancing bias and, in training,
the exploration noise; without these it is the router's softmax map). Expert e then
takes the C tokens of largest affinity in its column, with

    C = min(T, ceil(T * k * cf / E)),

k the call's ``top_k`` (``Router.top_k``), cf ``RouterConfig.capacity_factor`` (None,
dropless, reads as 1.0 here: the paper's c = k experts per token on average) and T the
tokens of the call. Every expert is exactly full, so the load is even by construction, and
a token reaches 0..E experts, k * cf on average (up to the ceiling); a token no expert
takes passes through the residual only (``moelab stats`` reports that share as
``unrouted_fraction``). Ties in a column are broken arbitrarily (``torch.topk``); the
expert still takes exactly C tokens. The capacity limit of the balancing stage, with the
same cf, drops nothing.

The rule reads the whole batch: a token's experts depend on the other tokens of the call,
including later positions of its own sequence, so it is **not causal across positions**,
and routing one token at a time (decoding) behaves differently from routing the
sequence. "The batch" is the tokens of one router call: under data parallelism, the
rank's micro-batch (batch and sequence flattened), never the global batch.

Representation: K = E slots per token, slot e holding expert e (``ids_TK`` is
``arange(E)`` on every row, an expanded view) and ``selected_TK[t, e]`` saying whether
expert e took token t. Unselected slots get gate weight 0 and are never computed (the
MoE layer's :func:`moelab.moe.dispatch.permute` gathers only the computed slots), so the
experts' work stays T * k * cf token-expert pairs although there are E slots. Statistics
count selected slots, so ``active_experts`` is the mean number of experts that took a
token. The gate stage uses the map's value p[t, e] of the selected slots, as the paper's
output sum_e P[t, e] * FFN_e(x_t).

Shape suffixes: T, E, K, O (moelab.shapes); here K = E and O is the capacity C.
"""

from __future__ import annotations

import torch

from moelab.maps import host_checks
from moelab.routing.balancing import capacity
from moelab.routing.selection.base import Budget, Selected, Selection, SelectionConfig

__all__ = ["ExpertChoice", "expert_capacity", "select_expert_choice"]


def _factor(config: SelectionConfig) -> float:
    """cf of the rule: ``capacity_factor``, 1.0 when None (dropless)."""
    return 1.0 if config.capacity_factor is None else float(config.capacity_factor)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """C = min(T, ceil(T * k * cf / E)): the tokens each expert takes (exact rational
    ceiling, :func:`moelab.routing.balancing.capacity`)."""
    return min(n_tokens, capacity(n_tokens, top_k, n_experts, factor))


def select_expert_choice(rank_TE: torch.Tensor, n_chosen: int) -> torch.Tensor:
    """bool (T, E): expert e takes the ``n_chosen`` tokens of largest affinity
    ``softmax(rank_TE, -1)[:, e]``."""
    affinity_TE = torch.softmax(rank_TE, dim=-1)
    chosen_TE = torch.zeros(rank_TE.shape, dtype=torch.bool, device=rank_TE.device)
    if n_chosen > 0:
        # NOTE: top-C along contiguous rows of the (E, T) copy: about twice as fast as
        # topk(dim=0) on the (T, E) layout
        top_EO = affinity_TE.t().contiguous().topk(n_chosen, dim=1).indices
        chosen_TE.scatter_(0, top_EO.t(), True)
    return chosen_TE


class ExpertChoice(Selection):
    """Each expert takes its top-C tokens by softmax affinity; K = E slots per token."""

    name = "expert_choice"
    truncates = True
    reads_batch = "always"
    reads_batch_why = (
        "each expert takes the top ceil(T k cf / E) tokens of the call: a token's experts "
        "depend on every other token of the call and on T"
    )
    # NOTE: Router.top_k sets C, so the inference K sweep varies the experts' budget
    # (k * cf token-expert pairs per token on average) as it does for top-K.
    sweep = "top_k"

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        if config.sample_extra:
            raise ValueError(
                "sample_extra samples a token's top-K experts; expert choice has experts "
                "pick tokens: set sample_extra=0 (noise_std explores instead)"
            )

    @classmethod
    def slots(cls, config: SelectionConfig, lapsum_k: float | torch.Tensor | None = None) -> int:
        """E: a token can reach every expert."""
        return config.n_experts

    @classmethod
    def expected_experts(cls, config: SelectionConfig) -> float:
        """k * cf (``top_k`` times ``capacity_factor``, 1.0 when None): the mean experts
        per token, exact up to the ceiling of C."""
        return config.top_k * _factor(config)

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        n_tokens, n_experts = rank_TE.shape
        if host_checks() and not bool(torch.isfinite(rank_TE).any(-1).all()):
            raise ValueError("expert choice needs a finite ranking score in every token's row")
        n_chosen = expert_capacity(n_tokens, budget.top_k, n_experts, _factor(self.config))
        selected_TK = select_expert_choice(rank_TE, n_chosen)
        ids_TK = torch.arange(n_experts, device=rank_TE.device).expand(n_tokens, n_experts)
        return Selected(ids_TK, selected_TK)
