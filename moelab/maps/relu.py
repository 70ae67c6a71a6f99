"""relu(z)_i = max(z_i, 0), applied to each expert on its own.

A gate with exact zeros and no normalisation (ReLU routing); -inf gives 0.
The gradient at exactly 0 is taken as 0. No singleton threshold.
"""

from __future__ import annotations

import torch

from ._core import check_scores, rowwise


class _ReluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        check_scores(z, "relu")
        p = z.clamp_min(0)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        return torch.where(p > 0, g, 0)  # d relu / dz = 1[z > 0]


def relu(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Elementwise ReLU; ``dim`` only names the expert axis for the checks."""
    return rowwise(_ReluFunction.apply, z, dim)
