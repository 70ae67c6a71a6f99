"""relu(z)_i = max(z_i, 0), applied to each expert on its own.

A gate with exact zeros and no normalisation (ReLU routing); -inf gives 0.
The gradient at exactly 0 is taken as 0. No singleton threshold.
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores


def _forward(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "relu")
    return z.clamp_min(0)


def _backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # d relu / dz = 1[z > 0] = 1[p > 0]; aten's fused op (differentiable, for double
    # backward), 30x faster on the CPU than torch.where(p > 0, g, 0) with its bool mask
    return torch.ops.aten.threshold_backward(g, p, 0)


_IMPL = MapImpl("relu", _forward, _backward)


def relu(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Elementwise ReLU; ``dim`` only names the expert axis for the checks."""
    return apply_map(_IMPL, z, dim)
