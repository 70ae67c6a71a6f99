"""Top-p (dynamic) selection: each token takes the smallest set of experts whose map
values reach ``top_p`` (Huang et al., 2024, *Harder Tasks Need More Experts: Dynamic
Routing in MoE Models*; ``selection="top_p"``).

Per token, the experts are sorted by their ranking scores, descending (the detached
logits plus the balancing bias and, in training, the exploration noise; without bias or
noise and with a monotone map such as softmax, that is the order of p). The rule keeps
the shortest prefix whose sum of p reaches ``top_p``: slot j is kept when the sum of p
over the slots before it is still below ``top_p``. The first slot is always kept (at
least one expert), and an expert with p = 0 (a masked expert, or one outside a sparse
map's support) is never kept beyond it, so ``top_p=1`` keeps the support even when the
float sum of p falls short of 1.

Cap: none by default, the rule's definition (the prefix is taken among all E
experts). ``top_p_cap`` caps it at K experts per token; K is the router's K
(``Router.top_k``, E without a cap, or a call's ``top_k=``), the slots of ``ids_TK``; the
kept slots are ``selected_TK``. ``top_k`` is not read. The paper's p is 0.4.

The gates are the kept p, not renormalised (``renorm=False``, the paper's choice). The
paper's "dynamic loss", the mean over tokens of the entropy -sum_e p_e log p_e of the
map's values, is added to the router's ``aux_loss`` with weight ``entropy_loss_weight``
(:func:`moelab.routing.balancing.entropy_loss`; default 0, off; the paper minimises it
beside the balance loss so that p does not flatten to reach ``top_p`` with every expert).

Statistics: the rule ``truncates`` (a token-dependent count), so ``moelab stats``
reports the measured mean number of experts (``active_experts``); ``moelab params``
counts the cap K as its nominal ``active``. Its budget sweep is the K sweep
(``sweep = "top_k"``): it varies the cap K at a fixed ``top_p``, not p.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moelab.routing.selection.base import Budget, Selected, Selection, SelectionConfig


def select_top_p(
    rank_TE: torch.Tensor, probs_TE: torch.Tensor, top_p: float, top_k: int
) -> Selected:
    """The top-p slots: ``ids_TK`` the ``top_k`` experts of largest ranking score in
    order, ``selected_TK`` the shortest prefix of them whose p (``probs_TE``, detached)
    sums to at least ``top_p``, at least one slot, no slot of p = 0 after the first."""
    ids_TK = rank_TE.topk(top_k, dim=-1).indices
    p_TK = probs_TE.detach().gather(-1, ids_TK)
    before_TK = F.pad(p_TK.cumsum(-1)[:, :-1], (1, 0))  # sum of p over the earlier slots
    first_K = torch.arange(top_k, device=ids_TK.device) == 0
    return Selected(ids_TK, ((before_TK < top_p) & (p_TK > 0)) | first_K)


class TopP(Selection):
    """The shortest prefix of the ranked experts whose p reaches ``top_p``, at most K
    (``top_p_cap``, E without one)."""

    name = "top_p"
    truncates = True
    sweep = "top_k"
    takes_top_p_cap = True

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        cap = config.top_p_cap
        if cap is not None and not 1 <= cap <= config.n_experts:
            raise ValueError(
                f"top_p_cap must lie in [1, n_experts={config.n_experts}] (or None: no cap), "
                f"got {cap}"
            )

    @classmethod
    def slots(cls, config: SelectionConfig, lapsum_k: float | torch.Tensor | None = None) -> int:
        """K: ``top_p_cap``, or E without a cap."""
        return config.n_experts if config.top_p_cap is None else config.top_p_cap

    @classmethod
    def router_top_k(cls, config: SelectionConfig) -> int:
        return cls.slots(config)

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        return select_top_p(rank_TE, probs_TE, self.config.top_p, budget.top_k)
