"""Shared plumbing of the maps: moving ``dim`` last, half-precision handling,
input checks with messages that say what to change, and the monotone Newton
solver used by the iterative maps.

Input checks. Checks of argument values given as Python numbers (alpha, a
number k or temperature, the number of experts) always run: they cost nothing.
Checks that read tensor values on the host (NaN or +inf scores, fully masked
rows, k out of range for a tensor k, a tensor temperature, the kernels' per-row
status) run in eager mode only while :func:`checks_enabled` is true; they are
skipped under ``torch.compile`` (``torch.compiler.is_compiling()``), and
``set_checks(False)`` / ``with checks(False):`` turn them off for speed. With
them off, bad input gives NaN (PyTorch path) or zero rows (kernels) instead of
an error. Solver loops stop early on a host-read test in eager mode only; under
``torch.compile`` they run their fixed iteration bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import _kernels

# Status codes written by the CPU kernels, one per row.
OK, BAD_VALUE, ALL_MASKED, BAD_K = 0, 1, 2, 3

_CHECKS = {"enabled": True}


def set_checks(enabled: bool) -> None:
    """Turn the maps' host-read input checks on (default) or off, process-wide.

    Off, no map reads a tensor value on the host to validate it (no device
    sync): NaN/+inf scores, fully masked rows or a tensor k out of range then
    give NaN or zero rows instead of a ValueError. Checks of plain-number
    arguments (alpha, a float k or temperature, shapes) still run.
    """
    _CHECKS["enabled"] = bool(enabled)


def checks_enabled() -> bool:
    """Whether the host-read input checks are on (see :func:`set_checks`)."""
    return _CHECKS["enabled"]


@contextlib.contextmanager
def checks(enabled: bool) -> Iterator[None]:
    """Context manager form of :func:`set_checks`: ``with maps.checks(False): ...``."""
    before = _CHECKS["enabled"]
    set_checks(enabled)
    try:
        yield
    finally:
        _CHECKS["enabled"] = before


def compiling() -> bool:
    """True while torch.compile traces the code (host reads are not allowed there)."""
    return torch.compiler.is_compiling()


def host_checks() -> bool:
    """Whether to run the checks that read tensor values on the host: eager mode
    with checks enabled."""
    return _CHECKS["enabled"] and not compiling()


def safe_pow(p: torch.Tensor, exponent: float) -> torch.Tensor:
    """p ** exponent on p > 0 and 0 where p == 0, with a gradient that is 0 (not
    inf or NaN) at the zeros: the pow never sees a zero (double-where)."""
    pos = p > 0
    return torch.where(pos, torch.where(pos, p, 1).pow(exponent), 0)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision scores are mapped in float32; float32/64 as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply ``fn`` (which maps a contiguous (rows, n) matrix row by row) along
    ``dim`` of ``z``, in float32 for half-precision input, returning z's dtype."""
    if not torch.is_floating_point(z):
        raise TypeError(f"scores must be a floating-point tensor, got {z.dtype}")
    if z.dim() == 0:
        raise ValueError("scores must have at least one dimension (the experts)")
    dim = dim % z.dim()
    moved = z.movedim(dim, -1)
    shape = moved.shape
    if shape[-1] == 0:
        raise ValueError(
            f"scores have no experts along dim {dim} (size 0); pass at least one expert score "
            "per row, or check which dim holds the experts"
        )
    flat = moved.reshape(-1, shape[-1]).to(compute_dtype(z.dtype)).contiguous()
    out = fn(flat)
    return out.to(z.dtype).reshape(shape).movedim(-1, dim)


def raise_for_status(status: torch.Tensor, name: str) -> None:
    """Turn the kernels' per-row status codes into a ValueError (skipped when the
    host-read checks are off or under torch.compile)."""
    if not host_checks() or not bool((status != OK).any()):
        return
    bad = int(torch.nonzero(status != OK)[0, 0])
    raise ValueError(_message(int(status[bad]), name, bad))


def check_scores(z: torch.Tensor, name: str) -> None:
    """The checks the kernels make, for the plain-PyTorch path: scores must be
    finite or -inf, with at least one finite entry per row (z is (rows, n)).

    One reduction pass: the row maximum is NaN, +inf or -inf exactly when the
    row holds a NaN, holds a +inf, or is entirely -inf. Skipped when the
    host-read checks are off or under torch.compile."""
    if not host_checks():
        return
    zmax = z.amax(-1)
    if bool(torch.isfinite(zmax).all()):
        return
    bad = torch.isnan(z).any(-1) | torch.isposinf(z).any(-1)
    if bool(bad.any()):
        raise ValueError(_message(BAD_VALUE, name, int(torch.nonzero(bad)[0, 0])))
    masked = torch.isneginf(zmax)
    raise ValueError(_message(ALL_MASKED, name, int(torch.nonzero(masked)[0, 0])))


def _message(code: int, name: str, row: int) -> str:
    if code == BAD_VALUE:
        return (
            f"{name}: scores contain NaN or +inf (first at flattened row {row}); "
            "scores must be finite, or -inf to mask an expert. Check the router's "
            "inputs and weights for overflow."
        )
    if code == ALL_MASKED:
        return (
            f"{name}: every score of flattened row {row} is -inf (all experts masked); "
            "leave at least one expert unmasked in each row."
        )
    if code == BAD_K:
        return (
            f"{name}: k must lie strictly between 0 and the number of unmasked experts "
            f"(flattened row {row} breaks this); lower k or unmask experts."
        )
    return f"{name}: unknown kernel status {code} at flattened row {row}"


def check_alpha(alpha: float, name: str) -> float:
    alpha = float(alpha)
    if not alpha > 1.0:
        raise ValueError(
            f"{name}: alpha must be > 1, got {alpha}. alpha -> 1 approaches softmax; "
            f"use maps.softmax for alpha = 1."
        )
    if alpha == float("inf"):
        raise ValueError(
            f"{name}: alpha must be a finite number > 1, got inf; pass a finite alpha "
            "(large alpha approaches a one-hot argmax, which top-1 selection gives directly)."
        )
    return alpha


def newton_threshold(y: torch.Tensor, power: float, max_iter: int = 100) -> torch.Tensor:
    """Solve sum_i (y_i - tau)_+^power = 1 for tau, row-wise, where each row of
    ``y`` has maximum 0 (y = z - max z; -inf allowed).

    f(tau) = sum_i (y_i - tau)_+^power - 1 is decreasing, f(-1) >= 0 (the
    maximum alone contributes 1) and f(0) = -1, so the root lies in [-1, 0).
    Each step takes Newton's step from the lower end of the bracket: for
    power >= 1, f is convex and the step never passes the root, so the lower
    end climbs to the root quadratically. For power < 1 a step may pass the
    root; it then becomes the upper end, and a step that would leave the
    bracket is replaced by bisection. In eager mode it iterates until every
    row's bracket has closed to rounding (a host read per step); under
    torch.compile it runs all ``max_iter`` steps (no host read); further steps
    keep a converged row within rounding of the root.
    """
    lo = torch.full_like(y[:, :1], -1.0)
    hi = torch.zeros_like(lo)
    eps = torch.finfo(y.dtype).eps
    # NOTE: f sums n terms, so it is known to about n * eps. A point within that
    # of the root counts as a lower end: else a Newton step that lands on the
    # root to rounding (f = -1e-16) becomes the upper end, and the bracket then
    # closes by bisection, 20-50 steps instead of 5-10.
    tol = 4 * eps * y.shape[-1]

    def f_and_slope(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = (y - tau).clamp_min(0)
        f = u.pow(power).sum(-1, keepdim=True) - 1
        slope = (power * torch.where(u > 0, u.pow(power - 1), 0)).sum(-1, keepdim=True)
        return f, slope

    f_lo, slope = f_and_slope(lo)
    for _ in range(max_iter):
        step = lo + f_lo / slope
        inside = (step > lo) & (step < hi) & torch.isfinite(step)
        cand = torch.where(inside, step, 0.5 * (lo + hi))
        f_c, slope_c = f_and_slope(cand)
        up = f_c >= -tol
        lo = torch.where(up, cand, lo)
        f_lo = torch.where(up, f_c, f_lo)
        slope = torch.where(up, slope_c, slope)
        hi = torch.where(up, hi, cand)
        if not compiling() and bool(((f_lo <= tol) | (hi - lo <= 4 * eps)).all()):
            break
    return lo


@dataclass(frozen=True)
class MapImpl:
    """How to compute one simplex map whose backward needs only its output p."""

    name: str  # for error messages
    forward: Callable[[torch.Tensor], torch.Tensor]  # PyTorch solver on (rows, n)
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p, g) -> J^T g
    kernel: str | None = None  # fused CPU kernel pair <kernel>_forward / _backward


class MapFunction(torch.autograd.Function):
    """p = map(z) on a (rows, n) matrix with the closed-form backward of ``impl``:
    through the fused CPU kernels where they apply, else the PyTorch solvers."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, impl: MapImpl) -> torch.Tensor:  # type: ignore[override]
        if impl.kernel is not None and _kernels.use_kernels(z):
            p, status = getattr(_kernels.ops(), f"{impl.kernel}_forward")(z)
            raise_for_status(status, impl.name)
        else:
            p = impl.forward(z)
        ctx.impl = impl
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        impl: MapImpl = ctx.impl
        # NOTE: with grad mode on (create_graph=True: double backward, gradient
        # penalties), the closed form runs as differentiable torch ops on the
        # saved output p, whose graph leads back through this Function; the
        # kernel's result would be a constant and second-order terms would vanish.
        if impl.kernel is not None and _kernels.use_kernels(p) and not torch.is_grad_enabled():
            return getattr(_kernels.ops(), f"{impl.kernel}_backward")(p, g.contiguous()), None
        return impl.backward(p, g), None


def apply_map(impl: MapImpl, z: torch.Tensor, dim: int) -> torch.Tensor:
    """``impl`` along ``dim`` of ``z`` (any leading shape, half precision in float32)."""
    return rowwise(lambda m: MapFunction.apply(m, impl), z, dim)
