"""softmax(z)_i = exp(z_i) / sum_j exp(z_j): the dense map of standard routers.

It is the solution of  argmax_{p in simplex} <p, z> + H(p)  with Shannon
entropy H, and never assigns an exact zero to a finite score: it has no
singleton threshold.
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores, host_checks

NARROW = 16
"""Rows shorter than this are mapped by :func:`rows_softmax`'s explicit formula on the
CPU: torch's softmax kernel vectorises along the row and is slow for rows shorter than
one vector (65536 rows, one thread: 13.0 ms at E = 8 against 1.5 ms at E = 16; the
explicit formula takes 4.4 ms at E = 8, and its backward 1.7 ms against torch's 4.7)."""


def _narrow(z: torch.Tensor) -> bool:
    return z.shape[-1] < NARROW and z.device.type == "cpu"


def rows_softmax(z: torch.Tensor) -> torch.Tensor:
    """softmax along the last dim of ``z``, without checks: torch's kernel, or for
    narrow CPU rows (:data:`NARROW`) exp(z - max) / sum, the same function to rounding
    (-inf entries give exactly 0; a row of -inf gives NaN, as torch's)."""
    if not _narrow(z):
        return torch.softmax(z, dim=-1)
    e = (z - z.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _forward(z: torch.Tensor) -> torch.Tensor:
    p = rows_softmax(z)
    # a row gives NaN exactly when it holds a NaN or +inf or is all -inf, the
    # cases check_scores refuses; p lies in [0, 1], so its sum is NaN exactly
    # then: one vectorised sum (torch.isnan(p).any() takes 10x longer, a row
    # reduction of the scores as long), the scores read again only to say which
    if host_checks() and bool(torch.isnan(p.sum())):
        check_scores(z, "softmax")
        raise AssertionError("softmax gave NaN on scores check_scores accepts")
    return p


def _backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # J = diag(p) - p p^T  =>  J^T g = p * (g - <g, p>)
    if _narrow(p):
        return p * (g - (g * p).sum(-1, keepdim=True))
    return torch._softmax_backward_data(g, p, -1, p.dtype)


_IMPL = MapImpl("softmax", _forward, _backward)


def softmax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``z`` along ``dim``; -inf entries get exactly 0."""
    return apply_map(_IMPL, z, dim)
