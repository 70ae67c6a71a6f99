"""softmax(z)_i = exp(z_i) / sum_j exp(z_j): the dense map of standard routers.

It is the solution of  argmax_{p in simplex} <p, z> + H(p)  with Shannon
entropy H, and never assigns an exact zero to a finite score: it has no
singleton threshold.
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores


def _forward(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "softmax")
    return torch.softmax(z, dim=-1)


def _backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch._softmax_backward_data(
        g, p, -1, p.dtype
    )  # J = diag(p) - p p^T  =>  J^T g = p * (g - <g, p>)


_IMPL = MapImpl("softmax", _forward, _backward)


def softmax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``z`` along ``dim``; -inf entries get exactly 0."""
    return apply_map(_IMPL, z, dim)
