"""alpha-entmax (Peters, Niculae & Martins, 2019):

    entmax_alpha(z) = argmax_{p in simplex} <p, z> + H_alpha(p),
    H_alpha(p) = sum_i (p_i - p_i^alpha) / (alpha (alpha - 1))   (Tsallis entropy).

Solution: p_i = ((alpha - 1) z_i - tau)_+^(1 / (alpha - 1)), tau such that sum p = 1.
alpha -> 1 approaches softmax, alpha = 2 is sparsemax, alpha = 1.5 has an exact
sort-based (here: sort-free, see csrc/) solution.

Threshold law: the runner-up gets exactly 0 iff z_(1) - z_(2) >= 1 / (alpha - 1)
(2 for 1.5-entmax).
Jacobian: J = diag(s) - s s^T / sum(s) with s_i = p_i^(2 - alpha) on the support.

Studied as an MoE router map in *How Sparse Probability Maps Shape
Mixture-of-Experts Routing* (Brogueira, Treviso, Couceiro, 2026).
"""

from __future__ import annotations

from functools import partial

import torch

from ._core import (
    MapImpl,
    apply_map,
    check_alpha,
    check_scores,
    entmax_offset_weights,
    safe_pow,
    threshold_weights,
)
from .sparsemax import sparsemax

METHODS = ("auto", "exact", "iterative")


def quadratic_threshold_sort(y: torch.Tensor) -> torch.Tensor:
    """Reference threshold by sorting: rows of ``y`` have maximum 0; returns tau
    with sum_i (y_i - tau)_+^2 = 1. For support size j the threshold is
    mean_j - sqrt((1 - j var_j) / j); K is the largest j with tau_j <= y_(j)."""
    ys = torch.sort(y.clamp_min(-2.0), dim=-1, descending=True).values
    j = torch.arange(1, y.shape[-1] + 1, device=y.device, dtype=y.dtype)
    mean = ys.cumsum(-1) / j
    var = (ys * ys).cumsum(-1) / j - mean * mean
    tau = mean - ((1 - j * var) / j).clamp_min(0).sqrt()
    # NOTE: tau >= -1 (the maximum alone gives 1), so y <= -1 is never in the
    # support; saying so keeps the threshold law exact at the boundary gap.
    # (>= 1 for valid rows; clamped for NaN rows that pass with the checks off)
    support = ((tau <= ys) & (ys > -1)).sum(-1, keepdim=True).clamp_min(1)
    return tau.gather(-1, support - 1)


def _entmax15_forward_torch(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "entmax")
    y = (z - z.amax(-1, keepdim=True)) / 2
    return (y - quadratic_threshold_sort(y)).clamp_min(0).square()


def _backward_torch(p: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    """J^T g = s * (g - q), q = <s, g> / sum(s), s_i = p_i^(2 - alpha) on the support.

    For alpha > 2, s is largest at the smallest p of the support and can be
    astronomically large (alpha = 50, p = 0.026: s = 1e76), and s * (g - q)
    cancels to rounding there (or overflows). So q comes from s relative to its
    largest entry m (t = (p / p_m)^(2 - alpha) <= 1), and entry m of J^T g is
    minus the sum of the others (J^T g sums to 0). Differentiable in p and g
    (double backward): no pow sees p = 0, and none forms s_m itself.
    """
    with torch.no_grad():
        m = safe_pow(p, 2 - alpha).argmax(-1, keepdim=True)
    at_m = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, m, True)
    t = safe_pow(p / p.gather(-1, m), 2 - alpha)
    q = (t * g).sum(-1, keepdim=True) / t.sum(-1, keepdim=True)
    r = safe_pow(torch.where(at_m, 0, p), 2 - alpha) * (g - q)  # 0 at m
    return torch.where(at_m, -r.sum(-1, keepdim=True), r)


def _forward_iterative(z: torch.Tensor, alpha: float) -> torch.Tensor:
    check_scores(z, "entmax")
    if alpha > 2:
        # exponent 1/(alpha - 1) < 1: the threshold as an offset from a score
        p = entmax_offset_weights(z, alpha)
    else:
        y = (alpha - 1) * (z - z.amax(-1, keepdim=True))
        p = threshold_weights(y, 1.0 / (alpha - 1), 1.0 / (alpha - 1))
    return p / p.sum(-1, keepdim=True)  # removes the solver's last rounding


_ENTMAX15 = MapImpl(
    "entmax", _entmax15_forward_torch, partial(_backward_torch, alpha=1.5), kernel="entmax15"
)


def entmax(
    z: torch.Tensor, alpha: float = 1.5, dim: int = -1, method: str = "auto"
) -> torch.Tensor:
    """alpha-entmax of ``z`` along ``dim``, for any alpha > 1.

    method: ``"exact"`` uses the closed-form solvers (alpha = 1.5, and alpha = 2,
    which is sparsemax); ``"iterative"`` the monotone Newton/bisection root
    finder for any alpha; ``"auto"`` (default) takes the exact one when it exists.
    For alpha > 2 the iterative solver holds the threshold as an offset from the
    smallest score in the support (:func:`~moelab.maps._core.entmax_offset_weights`):
    there it lies within rounding of that score, and p = u^(1/(alpha - 1))
    magnifies any rounding of u = (alpha - 1) z - tau. alpha must be finite.
    """
    alpha = check_alpha(alpha, "entmax")
    if method not in METHODS:
        raise ValueError(f"entmax: method must be one of {METHODS}, got {method!r}")
    exact = alpha in (1.5, 2.0)
    if method == "exact" and not exact:
        raise ValueError(
            f"entmax: no exact solver for alpha={alpha} (only 1.5 and 2); "
            "use method='iterative' or 'auto'"
        )
    if method != "iterative" and alpha == 2.0:
        return sparsemax(z, dim=dim)
    if method != "iterative" and alpha == 1.5:
        return apply_map(_ENTMAX15, z, dim)
    impl = MapImpl(
        "entmax",
        partial(_forward_iterative, alpha=alpha),
        partial(_backward_torch, alpha=alpha),
        kernel="entmax",
        kernel_args=(alpha,),
    )
    return apply_map(impl, z, dim)
