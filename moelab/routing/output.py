"""What a router returns.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RouterOutput:
    """The router's decision for a batch of T tokens.

    A slot ``(t, k)`` names expert ``ids_TK[t, k]`` for token ``t``. It is
    *selected* when ``selected_TK[t, k]`` (a truncating router selects fewer
    than K experts for some tokens; unused slots hold expert 0, weight 0). A
    selected slot whose weight is exactly 0 is a *filler*: it counts as a
    selection (nominal load) but its expert is not computed. A slot
    ``dropped_TK`` was refused by the capacity limit: it is selected but not
    computed either.

    Null experts (``RouterConfig.n_null_experts`` = M > 0, AdaMoE / MoE++): the map
    and the selection run over E + M columns (``scores_TE``, ``logits_TE`` and
    ``probs_TE`` have E + M of them; ids E .. E + M - 1 are the null experts). A slot
    that took a null expert is ``null_TK``, *not* ``selected_TK``: ``selected_TK``,
    ``computed_TK``, ``fillers_TK`` and everything counted from them (loads,
    contributors, active experts, drops, unrouted tokens) concern the ``n_experts``
    real experts only. A null slot costs nothing; its weight is 0 for "zero" null
    experts and the gate weight that multiplies x for "identity" ones.
    """

    scores_TE: torch.Tensor  # raw scores x W^T, float32
    logits_TE: torch.Tensor  # scores after temperature (and, in training, exploration noise)
    probs_TE: torch.Tensor  # the map applied to all E (+ M null) logits
    ids_TK: torch.Tensor  # int64 expert ids
    weights_TK: torch.Tensor  # gate weights of the slots (0 for unused slots)
    selected_TK: torch.Tensor  # bool: slot holds a selected expert
    dropped_TK: torch.Tensor  # bool: selected but refused by the capacity limit
    aux_loss: torch.Tensor  # scalar: sum of the weighted auxiliary losses
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # each, unweighted
    temperature: float | torch.Tensor = 1.0  # tau of the call (the router gives a 0-d tensor)
    null_TK: torch.Tensor | None = None  # bool: slot took a null expert; None: no null experts
    n_null: int = 0  # M: the null experts among the probs_TE columns (the last M)

    @property
    def n_experts(self) -> int:
        """E, the real experts: the columns of ``probs_TE`` less the ``n_null`` null ones."""
        return self.probs_TE.shape[-1] - self.n_null

    @property
    def chosen_TK(self) -> torch.Tensor:
        """Slots the selection rule filled: a real expert (``selected_TK``) or a null
        one (``null_TK``); what the balancing counts over the E + M experts."""
        return self.selected_TK if self.null_TK is None else self.selected_TK | self.null_TK

    @property
    def computed_TK(self) -> torch.Tensor:
        """Slots whose expert runs: selected, not dropped, non-zero weight (a real expert:
        null slots are never selected)."""
        return self.selected_TK & ~self.dropped_TK & (self.weights_TK != 0)

    @property
    def fillers_TK(self) -> torch.Tensor:
        """Selected slots with exactly zero weight."""
        return self.selected_TK & (self.weights_TK == 0)
