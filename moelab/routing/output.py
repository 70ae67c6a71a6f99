"""What a router returns.

Shape legend (used throughout moelab.routing and moelab.moe):
    T  tokens (batch and sequence flattened)
    D  model width
    E  experts
    K  selection slots per token (top_k, or the cap of a truncating router)
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
    """

    scores_TE: torch.Tensor  # raw scores x W^T, float32
    logits_TE: torch.Tensor  # scores after temperature (and, in training, exploration noise)
    probs_TE: torch.Tensor  # the map applied to all E logits
    ids_TK: torch.Tensor  # int64 expert ids
    weights_TK: torch.Tensor  # gate weights of the slots (0 for unused slots)
    selected_TK: torch.Tensor  # bool: slot holds a selected expert
    dropped_TK: torch.Tensor  # bool: selected but refused by the capacity limit
    aux_loss: torch.Tensor  # scalar: sum of the weighted auxiliary losses
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # each, unweighted
    temperature: float = 1.0

    @property
    def computed_TK(self) -> torch.Tensor:
        """Slots whose expert runs: selected, not dropped, non-zero weight."""
        return self.selected_TK & ~self.dropped_TK & (self.weights_TK != 0)

    @property
    def fillers_TK(self) -> torch.Tensor:
        """Selected slots with exactly zero weight."""
        return self.selected_TK & (self.weights_TK == 0)
