"""sigmoid(z)_i = 1 / (1 + exp(-z_i)), applied to each expert on its own.

Used by routers that score experts independently (gate values do not sum to
one; see the gate-normalisation essay). -inf gives exactly 0. No singleton
threshold.
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores


def _forward(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "sigmoid")
    return torch.sigmoid(z)


def _backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # d sigmoid / dz = p (1 - p); aten's fused op (differentiable, for double backward)
    return torch.ops.aten.sigmoid_backward(g, p)


_IMPL = MapImpl("sigmoid", _forward, _backward)


def sigmoid(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Elementwise sigmoid; ``dim`` only names the expert axis for the checks."""
    return apply_map(_IMPL, z, dim)
