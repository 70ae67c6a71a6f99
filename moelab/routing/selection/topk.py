"""Top-K selection: each token takes the K experts of largest ranking score.

K is ``Router.top_k`` (``RouterConfig.top_k`` at construction), changeable at inference
without touching the weights. Exploration in training: noise on the ranking scores
(``noise_std``, :meth:`Selection.rank`), or ``sample_extra`` = c: K experts drawn without
replacement from the top K + c in proportion to their probability.

Shape suffixes: T, E, K, A (moelab.shapes).
"""

from __future__ import annotations

import torch

from moelab.routing.selection.base import Budget, Selected, Selection


def select_topk(
    rank_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    top_k: int,
    sample_extra: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """ids_TK of the top_k experts by ``rank_TE``; with ``sample_extra`` = c > 0,
    top_k experts sampled without replacement from the top top_k + c in
    proportion to their probability (exploration, as the gate essay suggests)."""
    if sample_extra == 0:
        return rank_TE.topk(top_k, dim=-1).indices
    cand_TA = rank_TE.topk(top_k + sample_extra, dim=-1).indices
    p_TA = probs_TE.detach().gather(-1, cand_TA).float()
    # NOTE: sparse maps give zeros; a tiny floor lets multinomial draw them last
    # instead of failing when fewer than top_k candidates have positive mass.
    pick_TK = torch.multinomial(p_TA + 1e-12, top_k, replacement=False, generator=generator)
    return cand_TA.gather(-1, pick_TK)


class TopK(Selection):
    """The K experts of largest ranking score; every slot is selected."""

    name = "topk"
    limits_groups = True  # DeepSeek-V3: top-K among the kept groups' experts
    learns_through_gate = True

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        extra = self.config.sample_extra if budget.training else 0
        ids_TK = select_topk(rank_TE, probs_TE, budget.top_k, extra, budget.generator)
        return Selected(ids_TK, torch.ones_like(ids_TK, dtype=torch.bool))
