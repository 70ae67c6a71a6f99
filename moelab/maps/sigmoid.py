"""sigmoid(z)_i = 1 / (1 + exp(-z_i)), applied to each expert on its own.

Used by routers that score experts independently (gate values do not sum to
one; see the gate-normalisation essay). -inf gives exactly 0. No singleton
threshold.
"""

from __future__ import annotations

import torch

from ._core import check_scores, rowwise


class _SigmoidFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        check_scores(z, "sigmoid")
        p = torch.sigmoid(z)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        return g * p * (1 - p)  # d sigmoid / dz = p (1 - p)


def sigmoid(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Elementwise sigmoid; ``dim`` only names the expert axis for the checks."""
    return rowwise(_SigmoidFunction.apply, z, dim)
