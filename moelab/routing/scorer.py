"""The scorer stage of the router: ``scores_TE = x_TD W^T (+ b)``, a linear map of the
tokens onto the E + M experts it scores (M null experts), with an optional bias.

The stage takes its own settings, a :class:`ScorerConfig` (the Router builds it from
``RouterConfig``); the weight and the bias are the Router's parameters ``weight`` and
``scorer_bias`` (their state-dict keys).

Shape suffixes: T, D, E (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ScorerConfig", "scorer_parameters", "scores"]


@dataclass(frozen=True)
class ScorerConfig:
    """The scorer stage's settings, checked on construction."""

    d_model: int
    """D, the width of the token representations."""
    n_scored: int
    """E + M, the experts scored: the real ones and the null ones."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the weight."""
    scorer_bias: bool = False
    """A learned (E + M,) bias added to the scores (off: no bias parameter at all)."""

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_scored <= 0:
            raise ValueError("d_model and n_experts must be positive")


def scorer_parameters(config: ScorerConfig) -> tuple[nn.Parameter, nn.Parameter | None]:
    """``(weight_ED, bias_E)``: the weight drawn from N(0, init_std^2) with torch's global
    RNG, and the bias, zero at the start, or None when ``scorer_bias`` is off."""
    weight_ED = nn.Parameter(torch.empty(config.n_scored, config.d_model))
    nn.init.normal_(weight_ED, std=config.init_std)
    bias_E = nn.Parameter(torch.zeros(config.n_scored)) if config.scorer_bias else None
    return weight_ED, bias_E


def scores(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T (+ b)`` in float32, whatever the input dtypes; in float64 when the weight
    is float64 (an engine's float64 model, whose router scores in float64)."""
    dtype = torch.float64 if weight_ED.dtype == torch.float64 else torch.float32
    scores_TE = x_TD.to(dtype) @ weight_ED.to(dtype).t()
    if bias_E is not None:
        scores_TE = scores_TE + bias_E.to(dtype)
    return scores_TE
