"""sqrtsoftplus(z)_i = sqrt(softplus(z_i)) = sqrt(log(1 + e^{z_i})), applied to each
expert on its own.

DeepSeek-V4's router score (DeepSeek-AI, 2026, the ``"sqrtsoftplus"`` scoring function
of its config; Hugging Face's rule of the same name, :mod:`moelab.integrations.hf.rules`):
an affinity in [0, inf) that grows like sqrt(z) for large z (gentler than the logit,
unbounded unlike sigmoid) and like e^{z/2} for very negative z. Not on the simplex, no
fixed total (the statistics report no discarded mass, as for sigmoid), no singleton
threshold. -inf gives exactly 0, with gradient 0.

Backward, from the output p alone: with s = p^2 = softplus(z), sigmoid(z) = 1 - e^{-s},
so

    dp/dz = sigmoid(z) / (2 sqrt(softplus(z))) = -expm1(-s) / (2 p)

which tends to p / 2 (and to e^{z/2} / 2) as z -> -inf; where s underflows to 0 with
p > 0 the limit p / 2 is used, and where p = 0 the gradient is 0: never 0/0 or inf.
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores


def _forward(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "sqrtsoftplus")
    # softplus(-inf) = 0 and softplus of a large z is z itself: finite for finite z
    return torch.nn.functional.softplus(z).sqrt()


def _backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    s = p * p  # softplus(z)
    pos = s > 0
    # NOTE: double-where: the quotient never sees p = 0 (its own gradient would be NaN
    # under double backward even where torch.where discards it)
    p_safe = torch.where(pos, p, 1)
    # dp/dz = sigmoid(z) / (2 p) with sigmoid(z) = 1 - e^{-s} = -expm1(-s); its limit
    # p / 2 where s underflows (0 where p = 0, a masked expert)
    d = torch.where(pos, -torch.expm1(-s) / (2 * p_safe), 0.5 * p)
    return g * d


_IMPL = MapImpl("sqrtsoftplus", _forward, _backward)


def sqrtsoftplus(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Elementwise sqrt(softplus(z)) (DeepSeek-V4's router score); ``dim`` only names
    the expert axis for the checks."""
    return apply_map(_IMPL, z, dim)
