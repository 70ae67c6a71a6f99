"""alpha-normmax:

    normmax_alpha(z) = argmax_{p in simplex} <p, z> - ||p||_alpha .

Solution (from the KKT conditions): with u_i = (z_i - tau)_+ and tau such
that sum_i u_i^(alpha / (alpha - 1)) = 1,
    p_i = u_i^(1 / (alpha - 1)) / sum_j u_j^(1 / (alpha - 1)).
For alpha = 2: sum_i (z_i - tau)_+^2 = 1 (the equation 1.5-entmax solves on z/2,
here on z) and p = u / sum(u).

Threshold law, for every alpha: the runner-up gets exactly 0 iff
z_(1) - z_(2) >= 1.
Jacobian-vector product: with S = 1 / ||p||_alpha, h = (g - <g, p>) / S and
r_i = (p_i S)^(2 - alpha) / (alpha - 1) on the support,
    J^T g = h * r - <h, r> p .

Studied as an MoE router map (2-normmax) in *How Sparse Probability Maps
Shape Mixture-of-Experts Routing* (Brogueira, Treviso, Couceiro, 2026).
"""

from __future__ import annotations

from functools import partial

import torch

from . import _kernels
from ._core import (
    MapImpl,
    all_converged,
    apply_map,
    check_alpha,
    check_scores,
    collect_converged,
    compiling,
    newton_threshold,
    note_converged,
    offset_weights,
    safe_pow,
    threshold_weights,
)
from .entmax import METHODS, quadratic_threshold_sort


def _normmax2_forward_torch(z: torch.Tensor) -> torch.Tensor:
    check_scores(z, "normmax")
    y = z - z.amax(-1, keepdim=True)
    u = (y - quadratic_threshold_sort(y)).clamp_min(0)
    return u / u.sum(-1, keepdim=True)


def _forward_iterative(z: torch.Tensor, alpha: float) -> torch.Tensor:
    check_scores(z, "normmax")
    if alpha > 2:
        q = _weights_above_two(z, alpha)
    else:
        y = z - z.amax(-1, keepdim=True)
        q = threshold_weights(y, alpha / (alpha - 1), 1.0 / (alpha - 1))
    return q / q.sum(-1, keepdim=True)


def _weights_above_two(z: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weights q = (z - tau)_+^(1/(alpha - 1)) for alpha > 2, whose exponent
    below 1 magnifies the rounding of z - tau near the threshold: by Newton on
    tau, and, for the rows where that rounding could matter (a score within
    rounding of tau, or a weight whose error estimate beta eps q / u passes 1e-13
    of the sum), in the offset form (:func:`~moelab.maps._core.offset_weights`;
    the CPU kernel does the same). Under torch.compile both, for every row."""
    beta = 1.0 / (alpha - 1)
    y = z - z.amax(-1, keepdim=True)
    u = y - newton_threshold(y, alpha / (alpha - 1))
    q = u.clamp_min(0).pow(beta)
    eps = torch.finfo(z.dtype).eps
    worst = torch.where(u > 0, q / u.clamp_min(torch.finfo(z.dtype).tiny), 0).amax(-1)
    risky = ((u.abs() <= 4 * eps).any(-1)) | (beta * 4 * eps * worst > 1e-13 * q.sum(-1))
    if compiling():
        # (converged: Newton's rows, and the offset form's where it is taken)
        with collect_converged() as offset_ok:
            q_offset = offset_weights(z, alpha, "normmax")
        note_converged(~risky | all_converged(offset_ok, z))
        return torch.where(risky[:, None], q_offset, q)
    if bool(risky.any()):
        rows = risky.nonzero()[:, 0]
        q = q.index_copy(0, rows, offset_weights(z[rows], alpha, "normmax"))
    return q


def _backward_torch(p: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    inv_s = p.pow(alpha).sum(-1, keepdim=True).pow(1.0 / alpha)  # 1/S = ||p||_alpha
    h = (g - (g * p).sum(-1, keepdim=True)) * inv_s  # (g - <g, p>) / S
    # differentiable in p and g (double backward): the pow never sees p = 0
    r = safe_pow(p / inv_s, 2 - alpha) / (alpha - 1)
    hr = h * r
    return hr - hr.sum(-1, keepdim=True) * p  # J^T g = h r - <h, r> p


_NORMMAX2 = MapImpl(
    "normmax", _normmax2_forward_torch, partial(_backward_torch, alpha=2.0), kernel="normmax2"
)


def normmax(
    z: torch.Tensor, alpha: float = 2.0, dim: int = -1, method: str = "auto"
) -> torch.Tensor:
    """alpha-normmax of ``z`` along ``dim``, for any alpha > 1.

    method: ``"exact"`` (alpha = 2 only), ``"iterative"`` (monotone Newton on the
    threshold, any alpha) or ``"auto"`` (default: exact when it exists).
    alpha must be finite. For alpha > 2 the exponent 1/(alpha - 1) < 1 magnifies
    the rounding of z - tau near the threshold: the iterative solver holds the
    threshold as an offset from the smallest score in the support
    (:func:`~moelab.maps._core.offset_weights`), in float64 for float32 and
    half-precision scores (returning their dtype; float32 cannot hold it: errors
    up to 7e-5 at alpha = 4, 8 or 64 experts).
    """
    alpha = check_alpha(alpha, "normmax")
    if method not in METHODS:
        raise ValueError(f"normmax: method must be one of {METHODS}, got {method!r}")
    if method == "exact" and alpha != 2.0:
        raise ValueError(
            f"normmax: no exact solver for alpha={alpha} (only 2); use method='iterative' or 'auto'"
        )
    if method != "iterative" and alpha == 2.0:
        return apply_map(_NORMMAX2, z, dim)
    impl = MapImpl(
        "normmax",
        partial(_forward_iterative, alpha=alpha),
        partial(_backward_torch, alpha=alpha),
        kernel="normmax",
        kernel_args=(alpha,),
    )
    # (the CPU kernel computes in double internally for float32 input)
    in_kernel = _kernels.use_kernels(torch.empty(0, device=z.device))
    if alpha > 2 and z.dtype in (torch.float32, torch.float16, torch.bfloat16) and not in_kernel:
        # NOTE: q = (z - tau)^(1/(alpha - 1)) with an exponent below 1 magnifies
        # the threshold's rounding (float32: errors of 1e-6 at alpha = 3, 7e-5 at
        # alpha = 4, 1e-4 at 20, near the threshold): solve in float64 there and
        # return the input's dtype.
        return apply_map(impl, z.double(), dim).to(z.dtype)
    return apply_map(impl, z, dim)
