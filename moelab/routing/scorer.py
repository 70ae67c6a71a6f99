"""The scorer stage of the router: ``scores_TE = x_TD W^T (+ b)``, a linear map of the
tokens onto the E + M experts it scores (M null experts), with an optional bias.

In training, with ``jitter`` = eps > 0, the scorer first multiplies its input by
independent factors drawn from U(1 - eps, 1 + eps), one per entry of ``x_TD``
(:func:`jitter`): the input jitter of the Switch Transformer (Fedus et al., 2021,
arXiv 2101.03961) that Megatron-Core offers as ``moe_input_jitter_eps``. Since it acts
before the scores, it moves the map's values, so both the selection and the gate
weights; only the router sees the jittered copy, the experts get ``x_TD`` as it came.

The stage takes its own settings, a :class:`ScorerConfig` (the Router builds it from
``RouterConfig``); the weight and the bias are the Router's parameters ``weight`` and
``scorer_bias`` (their state-dict keys).

Shape suffixes: T, D, E (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ScorerConfig", "jitter", "scorer_parameters", "scores"]


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
    jitter: float = 0.0
    """eps of the input jitter in training, in [0, 1) (0: off)."""

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_scored <= 0:
            raise ValueError("d_model and n_experts must be positive")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(
                f"jitter must lie in [0, 1) (the router input is multiplied by "
                f"U(1 - jitter, 1 + jitter); 0: off), got {self.jitter}"
            )


def scorer_parameters(config: ScorerConfig) -> tuple[nn.Parameter, nn.Parameter | None]:
    """``(weight_ED, bias_E)``: the weight drawn from N(0, init_std^2) with torch's global
    RNG, and the bias, zero at the start, or None when ``scorer_bias`` is off."""
    weight_ED = nn.Parameter(torch.empty(config.n_scored, config.d_model))
    nn.init.normal_(weight_ED, std=config.init_std)
    bias_E = nn.Parameter(torch.zeros(config.n_scored)) if config.scorer_bias else None
    return weight_ED, bias_E


def _score_dtype(weight_ED: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 weight (an engine's float64 model)."""
    return torch.float64 if weight_ED.dtype == torch.float64 else torch.float32


def jitter(
    x_TD: torch.Tensor,
    eps: float,
    weight_ED: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x_TD * f_TD``, f drawn independently per entry from U(1 - eps, 1 + eps) (as
    ``1 - eps + 2 eps u``, u ~ U[0, 1) from ``generator``, the global RNG when None), in
    the dtype the scorer computes in (:func:`scores`, from ``weight_ED``). The gradient
    reaches x through the product (the factors are constants)."""
    dtype = _score_dtype(weight_ED)
    u_TD = torch.rand(x_TD.shape, generator=generator, device=x_TD.device, dtype=dtype)
    return x_TD.to(dtype) * (1.0 - eps + (2.0 * eps) * u_TD)


def scores(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T (+ b)`` in float32, whatever the input dtypes; in float64 when the weight
    is float64 (an engine's float64 model, whose router scores in float64)."""
    dtype = _score_dtype(weight_ED)
    scores_TE = x_TD.to(dtype) @ weight_ED.to(dtype).t()
    if bias_E is not None:
        scores_TE = scores_TE + bias_E.to(dtype)
    return scores_TE
