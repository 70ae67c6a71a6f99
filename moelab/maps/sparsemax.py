"""sparsemax(z) = argmin_{p in simplex} ||p - z||^2, the Euclidean projection
onto the probability simplex (Martins & Astudillo, 2016).

Solution: p_i = (z_i - tau)_+ with tau such that sum_i p_i = 1.
Threshold law: the runner-up gets exactly 0 iff z_(1) - z_(2) >= 1, and any
score at least 1 below the maximum is always 0.
Jacobian: J = diag(s) - s s^T / |S| with s = 1[p > 0].

Studied as an MoE router map in *How Sparse Probability Maps Shape
Mixture-of-Experts Routing* (Brogueira, Treviso, Couceiro, 2026).
"""

from __future__ import annotations

import torch

from ._core import MapImpl, apply_map, check_scores


def sparsemax_threshold_sort(y: torch.Tensor) -> torch.Tensor:
    """Reference threshold by sorting: rows of ``y`` have maximum 0; returns tau
    with sum_i (y_i - tau)_+ = 1. K is the largest j with 1 + j y_(j) > sum_{i<=j} y_(i)."""
    ys = torch.sort(y.clamp_min(-2.0), dim=-1, descending=True).values  # -inf never in support
    csum = ys.cumsum(-1)
    j = torch.arange(1, y.shape[-1] + 1, device=y.device, dtype=y.dtype)
    # NOTE: tau >= -1 (the maximum alone sums to 1), so y <= -1 is never in the
    # support; saying so keeps the threshold law exact at gap == 1 despite rounding.
    # (at least 1 for every valid row; the clamp keeps rows of NaN that pass with
    # the checks off, or under torch.compile, from indexing out of bounds)
    support = ((1 + j * ys > csum) & (ys > -1)).sum(-1, keepdim=True).clamp_min(1)
    return (csum.gather(-1, support - 1) - 1) / support.to(y.dtype)


def _forward_torch(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "sparsemax")
    y = z - z.amax(-1, keepdim=True)
    return (y - sparsemax_threshold_sort(y)).clamp_min(0)


def _backward_torch(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    s = p > 0
    mean = torch.where(s, g, 0).sum(-1, keepdim=True) / s.sum(-1, keepdim=True)
    return torch.where(s, g - mean, 0)  # J^T g = s * (g - mean_S g)


_IMPL = MapImpl("sparsemax", _forward_torch, _backward_torch, kernel="sparsemax")


def sparsemax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax of ``z`` along ``dim`` (exact; -inf entries get exactly 0)."""
    return apply_map(_IMPL, z, dim)
