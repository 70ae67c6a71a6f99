"""softmax(z)_i = exp(z_i) / sum_j exp(z_j): the dense map of standard routers.

It is the solution of  argmax_{p in simplex} <p, z> + H(p)  with Shannon
entropy H, and never assigns an exact zero to a finite score: it has no
singleton threshold.
"""

from __future__ import annotations

import torch

from ._core import check_scores, rowwise


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        check_scores(z, "softmax")
        p = torch.softmax(z, dim=-1)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        # J = diag(p) - p p^T  =>  J^T g = p * (g - <g, p>)
        return torch._softmax_backward_data(g, p, -1, p.dtype)


def softmax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``z`` along ``dim``; -inf entries get exactly 0."""
    return rowwise(_SoftmaxFunction.apply, z, dim)
