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
from functools import partial

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


_FIXED = {"on": False}  # the compiled path's fixed iteration counts, in eager mode
# Collectors of the solvers' per-row convergence flags (innermost last): see
# :func:`collect_converged`.
_CONVERGED: list[list[torch.Tensor]] = []


def compiling() -> bool:
    """True while torch.compile traces the code (host reads are not allowed there), and
    inside :func:`fixed_counts`, which runs that path in eager mode."""
    return _FIXED["on"] or torch.compiler.is_compiling()


@contextlib.contextmanager
def fixed_counts() -> Iterator[None]:
    """Run the maps' PyTorch solvers as torch.compile traces them: every loop its fixed
    count, no early stop and no host-read check (for :func:`moelab.maps.certificate`)."""
    before = _FIXED["on"]
    _FIXED["on"] = True
    try:
        yield
    finally:
        _FIXED["on"] = before


@contextlib.contextmanager
def collect_converged() -> Iterator[list[torch.Tensor]]:
    """Collect, into the list yielded, the per-row flags (bool, (rows,)) the solvers
    called inside report through :func:`note_converged`: True where an iteration met
    its stopping rule within its count. A row converged when every flag is True."""
    flags: list[torch.Tensor] = []
    _CONVERGED.append(flags)
    try:
        yield flags
    finally:
        _CONVERGED.pop()


def note_converged(done: torch.Tensor) -> None:
    """Report a solver's per-row convergence flags ((rows,) or (rows, 1)) to the
    innermost :func:`collect_converged`; nothing happens outside one."""
    if _CONVERGED:
        _CONVERGED[-1].append(done.reshape(-1))


def all_converged(flags: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The rows of ``like`` ((rows, n)) whose every flag is True (True without flags)."""
    ok = torch.ones(like.shape[0], dtype=torch.bool, device=like.device)
    for flag in flags:
        ok = ok & flag
    return ok


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


_AS_IS = (torch.float32, torch.float64)  # the dtypes a map computes in as they are


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply ``fn`` (which maps a contiguous (rows, n) matrix row by row) along
    ``dim`` of ``z``, in float32 for half-precision input, returning z's dtype."""
    if z.dtype in _AS_IS and z.dim() == 2 and dim in (-1, 1) and z.shape[1] > 0:
        # NOTE: the common call (a router's (tokens, E) scores) as it is: the views
        # and no-op conversions below cost about 10 us a call, which at 16k rows
        # of 16 experts is several percent of the map itself
        return fn(z.contiguous())
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
    # (OK is 0: one reduction and one host read on the common path)
    if not host_checks() or not bool(status.any()):
        return
    bad = int(torch.nonzero(status != OK)[0, 0])
    raise ValueError(error_message(int(status[bad]), name, bad))


def check_scores(z: torch.Tensor, name: str) -> None:
    """The checks the kernels make, for the plain-PyTorch path: scores must be
    finite or -inf, with at least one finite entry per row (z is (rows, n)).

    First one vectorised pass over the whole tensor: its maximum is finite
    exactly when no entry is NaN or +inf, and when its minimum is above -inf no
    row can be all -inf (torch's row reductions are slow on short rows: 10x
    longer at 16 experts). Only otherwise, the row maximum, which is NaN, +inf
    or -inf exactly when the row holds a NaN, holds a +inf, or is entirely -inf.
    Skipped when the host-read checks are off or under torch.compile."""
    if not host_checks() or z.numel() == 0:
        return
    lo, hi = torch.aminmax(z)
    if bool(torch.isfinite(hi) & (lo > -torch.inf)):
        return
    zmax = z.amax(-1)
    if bool(torch.isfinite(zmax).all()):
        return
    bad = torch.isnan(z).any(-1) | torch.isposinf(z).any(-1)
    if bool(bad.any()):
        raise ValueError(error_message(BAD_VALUE, name, int(torch.nonzero(bad)[0, 0])))
    masked = torch.isneginf(zmax)
    raise ValueError(error_message(ALL_MASKED, name, int(torch.nonzero(masked)[0, 0])))


def error_message(code: int, name: str, row: int) -> str:
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


def check_alpha(alpha: float, name: str, key: str = "alpha") -> float:
    """``alpha`` as a float, > 1 and finite, else a ValueError that says what to
    change; ``key`` is the parameter as the caller's user spells it."""
    alpha = float(alpha)
    if not alpha > 1.0:
        # NOTE: the message also reaches command-line users (--alpha 1, --set
        # router.alpha=1): it names the map, which both the library and a
        # router config take, not a Python function
        if name == "entmax":
            limit = (
                f"; or, for {key} = 1, the map 'softmax', which entmax tends to as "
                f"{key} -> 1 (maps.softmax, or map=softmax in a router config)"
            )
        else:
            limit = f"; {name} tends to a one-hot argmax as {key} -> 1"
        default = {"entmax": 1.5, "normmax": 2.0}.get(name)
        raise ValueError(
            f"{name}: {key} must be > 1, got {alpha}. Set {key} above 1"
            + (f" ({default:g} is the default)" if default else "")
            + limit
            + "."
        )
    if alpha == float("inf"):
        raise ValueError(
            f"{name}: {key} must be a finite number > 1, got inf; pass a finite {key} "
            "(large alpha approaches a one-hot argmax, which top-1 selection gives directly)."
        )
    return alpha


COMPILED_NEWTON_STEPS = 32
"""Newton steps :func:`newton_threshold` runs under torch.compile for power >= 1
without ``settle`` (the iterative entmax for alpha < 2 and normmax for alpha <= 2),
where a loop cannot stop on the data (eager mode: up to ``max_iter``, stopping once
every row has; power < 1 and ``settle``, where bisection steps can occur, keep
``max_iter`` under torch.compile too). Measured: every row of a battery (entmax
alpha 1.01-1.7, normmax 1.01-2; 2 to 16384 experts; scores 0 to 10 apart, all tied
included; float32 and float64) had stopped after 16 steps: Newton from the left on
a convex f takes about log(n) steps to reach the root's neighbourhood, then converges
quadratically."""
COMPILED_FRAME_STEPS = 32
"""Newton steps per frame of :func:`offset_weights` under torch.compile (eager: up to
``max_iter``, stopping once every row has): G is convex and increasing on the frame's
segment and the iterates decrease to its root. Measured: every row of the battery
above at alpha 3, 10 and 50 (entmax and normmax) had stopped after 20 steps."""


def newton_threshold(
    y: torch.Tensor,
    power: float,
    max_iter: int = 100,
    settle: bool = False,
    offset: bool = False,
) -> torch.Tensor:
    """Solve sum_i (y_i - tau)_+^power = 1 for tau, row-wise, where each row of
    ``y`` has maximum 0 (y = z - max z; -inf allowed).

    f(tau) = sum_i (y_i - tau)_+^power - 1 is decreasing, f(-1) >= 0 (the
    maximum alone contributes 1) and f(0) = -1, so the root lies in [-1, 0).
    Each step takes Newton's step from the lower end of the bracket: for
    power >= 1, f is convex and the step never passes the root, so the lower
    end climbs to the root quadratically. For power < 1 a step may pass the
    root; it then becomes the upper end, and a step that would leave the
    bracket is replaced by bisection. A row stops once f at its lower end, or
    the Newton step from there, is within rounding of 0, or its bracket has closed;
    with ``settle``, also once at most one score lies strictly inside its
    bracket (the support is then known up to that score:
    :func:`offset_weights` takes it from there). A stopped row keeps its
    value, so a row's result does not depend on the other rows of the batch.
    In eager mode the loop ends when every row has stopped (a host read per
    step); under torch.compile it runs a fixed count (no host read): ``max_iter``,
    or :data:`COMPILED_NEWTON_STEPS` where that is smaller, for power >= 1 without
    ``settle`` (convex f: Newton from the left, never a bisection step).

    With ``offset`` the iteration runs on s = tau + 1 in [0, 1) instead, each
    term (y - tau)^power as exp(power log1p(y - s)), and returns s: as alpha -> 1
    the power is large (1/(alpha - 1) for entmax), the terms near the maximum
    are (1 - small)^power, and u = y - tau formed as one number near 1 keeps only
    its absolute rounding, which the power magnifies (entmax at alpha = 1.0001
    was 4e-5 off in float32); y - s keeps its relative one. See
    :func:`threshold_weights`.

    Returns the lower end of the bracket (tau itself, to rounding, without
    ``settle``), or with ``offset`` its s = tau + 1.
    """
    lo = torch.full_like(y[:, :1], 0.0 if offset else -1.0)
    hi = lo + 1
    eps = torch.finfo(y.dtype).eps
    tiny = torch.finfo(y.dtype).tiny

    def f_and_slope(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # NOTE: f sums the K positive terms, so it is known to about K * eps. A
        # point within that of the root counts as a lower end: else a Newton step
        # that lands on the root to rounding (f = -1e-16) becomes the upper end,
        # and the bracket then closes by bisection, 20-50 steps instead of 5-10.
        # (K, not the row length: at 16384 experts in float32, 4 n eps is 8e-3.)
        if offset:
            e = y - t  # > -1 on the support
            k = (e > -1).sum(-1, keepdim=True)
            v = powered(e, power)
            u = (1 + e).clamp_min_(tiny)
        else:
            u = (y - t).clamp_min_(0)
            k = torch.count_nonzero(u, -1).unsqueeze(-1)
            v = u.pow(power)
        tol = (4 * eps) * k.to(y.dtype)
        f = v.sum(-1, keepdim=True) - 1
        slope = power * v.div_(u.clamp_min_(tiny)).sum(-1, keepdim=True)  # u^(power - 1)
        return f, slope, tol

    def finished(f_lo: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        # lo at the root to rounding (0 >= f_lo >= -tol), a Newton step that cannot
        # move lo (below half its spacing), or a closed bracket
        stop = (f_lo <= 0) | ((f_lo <= 0.5 * eps * lo.abs() * slope) & torch.isfinite(slope))
        stop = stop | (hi - lo <= 4 * eps * (hi if offset else 1))
        if settle:
            inside = (y - lo > -1) & (y - hi < -1) if offset else (y > lo) & (y < hi)
            stop = stop | (inside.sum(-1, keepdim=True) <= 1)
        return stop

    f_lo, slope, _ = f_and_slope(lo)
    done = finished(f_lo, slope)
    if compiling() and power >= 1 and not settle:
        max_iter = min(max_iter, COMPILED_NEWTON_STEPS)
    for _ in range(max_iter):
        if not compiling() and bool(done.all()):
            break
        step = lo + f_lo / slope
        inside = (step > lo) & (step < hi) & torch.isfinite(step)
        cand = torch.where(inside, step, 0.5 * (lo + hi))
        f_c, slope_c, tol_c = f_and_slope(cand)
        up = ~done & (f_c >= -tol_c)
        down = ~done & ~up
        lo = torch.where(up, cand, lo)
        f_lo = torch.where(up, f_c, f_lo)
        slope = torch.where(up, slope_c, slope)
        hi = torch.where(down, cand, hi)
        done = done | finished(f_lo, slope)
    note_converged(done)
    return lo


# From this power of the threshold equation on (alpha < 1.07), the threshold is
# solved as s = tau + 1 and the weights through log1p (see newton_threshold).
S_FORM_POWER = 16.0


def threshold_weights(y: torch.Tensor, power: float, exponent: float) -> torch.Tensor:
    """(y - tau)_+^exponent with tau the root of sum_i (y_i - tau)_+^power = 1
    (:func:`newton_threshold`), row-wise; in the s = tau + 1 form for large powers,
    where y - tau near 1 would keep only its absolute rounding."""
    if power >= S_FORM_POWER:
        return powered(y - newton_threshold(y, power, offset=True), exponent)
    return (y - newton_threshold(y, power)).clamp_min(0).pow(exponent)


def powered(e: torch.Tensor, exponent: float) -> torch.Tensor:
    """(1 + e)_+^exponent as exp(exponent log1p(e)), 0 where e <= -1: the weights
    (y - tau)_+^exponent from e = y - s, s = tau + 1 (see :func:`newton_threshold`)."""
    # (log1p(-1) = -inf and exp(-inf) = 0: e <= -1, -inf included, gives 0)
    return e.clamp_min(-1).log1p_().mul_(exponent).exp_()


def entmax_offset_weights(
    z: torch.Tensor, alpha: float, max_iter: int = 50, bracket_iter: int = 100
) -> torch.Tensor:
    """alpha-entmax for alpha > 2 by :func:`offset_weights`: the weights
    p_i = ((alpha - 1) z_i - tau)_+^(1/(alpha - 1)), summing to 1."""
    return offset_weights(z, alpha, "entmax", max_iter, bracket_iter)


def offset_weights(
    z: torch.Tensor, alpha: float, kind: str, max_iter: int = 50, bracket_iter: int = 100
) -> torch.Tensor:
    """The unnormalised weights q_i = (y_i - tau)_+^beta, beta = 1/(alpha - 1) < 1,
    row-wise on a (rows, n) matrix ``z`` (-inf allowed), with the threshold held as
    an offset from a score: alpha-entmax (``kind="entmax"``: y = (alpha - 1) z,
    sum q = 1, so q is the map) or alpha-normmax (``"normmax"``: y = z,
    sum (y - tau)_+^(alpha/(alpha - 1)) = 1, and the map is q / sum q), alpha > 2.

    Why: at large alpha the threshold lies within rounding of a score in the
    support. With entmax's y = (alpha - 1) z and alpha = 50, a runner-up weight of
    0.026 needs y_2 - tau = 0.026^49 = 1e-77, so y_2 - tau from a float tau is pure
    rounding (normmax alike: ``[[0, -0.9999999999999999]]`` at alpha = 50 needs
    y_2 - tau = 7e-17 next to tau = -1). Instead tau = y_r - w with y_r the
    smallest score in the support (the frame), and the unknown is the frame
    score's own weight x = w^beta (w = x^(alpha - 1) underflows long before x
    does). Every other weight is (d_i + w)^beta with d_i = y_i - y_r > 0: a sum
    of two non-negative numbers, nothing cancels. With P the power of the
    threshold equation (1/(alpha - 1) for entmax, alpha/(alpha - 1) for normmax),
    G(x) = ties x^((alpha - 1) P) + sum_{d_i > 0} (d_i + x^(alpha - 1))^P - 1 is
    increasing and convex on the frame's segment 0 <= x <= x_b (tau between y_r
    and the next lower score y_b, and tau >= max(y) - 1) and nearly linear for
    large alpha, so Newton's iteration from the right of the root decreases to
    it in a few steps, and a step from the left lands on its right.

    The frame and the start come from :func:`newton_threshold` with ``settle``:
    r is the smallest score above its lower end. If the root lies outside the
    segment (the score left inside the bracket, or one within rounding of tau),
    Newton stops at an end and the frame moves to the next score up (r is not in
    the support) or down (y_b is); in eager mode only those rows are solved
    again. Rows stop on their own (a step that no longer decreases x, one within
    rounding, or G within rounding of 0) and keep their value from then on, so a
    row's weights do not depend on the other rows. Under torch.compile every
    loop runs its fixed bound (``bracket_iter`` steps of the search, two frames of
    ``max_iter`` or :data:`COMPILED_FRAME_STEPS` Newton steps, the smaller), which
    covers everything but several distinct scores within rounding of tau.

    float32 rows with a score within 1e-30 of the frame are solved in float64 from
    the frame on (all rows, under torch.compile; the start and the frame are found
    in float32, as the scores' differences the caller sees): there, in float32,
    w = x^(alpha - 1) reaches the subnormal range while the d_i are as small, and
    d_i + w then kept a few bits (errors of 1.8e-5 at alpha = 50). The weights
    come back in z's dtype.
    """
    a = alpha - 1
    scale, power, _ = _offset_constants(a, kind)
    zmax = z.amax(-1, keepdim=True)
    y = scale * (z - zmax)
    lo = newton_threshold(y, power, bracket_iter, settle=True)
    zr = torch.where(y > lo, z, torch.inf).amin(-1, keepdim=True)
    start = (scale * (zr - zmax) - lo).clamp_min(0).pow(1.0 / a)
    dtype = z.dtype
    # (eager mode: only when some row's frame lies within 1e-30 of a higher score)
    if dtype == torch.float32 and (
        compiling() or bool((((z - zr) * scale < 1e-30) & (z > zr)).any())
    ):
        z, zmax, zr, start = z.double(), zmax.double(), zr.double(), start.double()
    solve = partial(_frame_solve, a=a, max_iter=max_iter, kind=kind)
    if compiling():
        x, up, down, zb, ok1 = solve(z, zmax, zr, start, None)
        new_zr, start = _next_frame(z, zr, x, up, down, zb)
        x2, up2, down2, _, ok2 = solve(z, zmax, new_zr, start, ~(up | down))
        # converged: a row that stayed in its first frame, by that frame's iteration;
        # one that moved, by the second's, which must not need a third frame
        moved = up | down
        note_converged(torch.where(moved, ok2 & ~(up2 | down2), ok1))
        return _frame_weights(scale * (z - new_zr), x2, a).to(dtype)
    x, up, down, zb, _ = solve(z, zmax, zr, start, None)
    rows = torch.arange(z.shape[0], device=z.device)
    for _ in range(z.shape[-1]):
        moved = (up | down)[:, 0]
        if not bool(moved.any()):
            break
        # NOTE: only the rows whose frame moves are solved again
        rows, sel = rows[moved], moved.nonzero()[:, 0]
        zs, zmax_s = z[rows], zmax[rows]
        zr_s, start_s = _next_frame(zs, zr[rows], x[rows], up[sel], down[sel], zb[sel])
        x_s, up, down, zb, _ = solve(zs, zmax_s, zr_s, start_s, None)
        zr = zr.index_copy(0, rows, zr_s)
        x = x.index_copy(0, rows, x_s)
    return _frame_weights(scale * (z - zr), x, a).to(dtype)


def _frame_solve(
    z: torch.Tensor,
    zmax: torch.Tensor,
    zr: torch.Tensor,
    start: torch.Tensor,
    done: torch.Tensor | None,
    a: float,
    max_iter: int,
    kind: str = "entmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Newton's iteration on G(x) in the frame of the score ``zr`` (see
    :func:`offset_weights`; a = alpha - 1), clamped to the segment [0, x_b], from
    ``start``; rows already ``done`` keep ``start``. Returns x, whether the frame
    must move up or down, the next lower score z_b, and whether the iteration
    stopped on its own (within its count)."""
    scale, power, c = _offset_constants(a, kind)
    d = scale * (z - zr)
    zb = torch.where(d < 0, z, -torch.inf).amax(-1, keepdim=True)
    # tau >= y_b, tau >= max(y) - 1
    wb = torch.minimum(scale * (zr - zb), 1 + scale * (zr - zmax))
    xb = wb.clamp_min(0).pow(1.0 / a)
    above = d > 0
    dz, mask = torch.where(above, d, 1), above.to(d.dtype)
    ties = (d == 0).sum(-1, keepdim=True).to(d.dtype)
    # NOTE: the maximum's terms (d_top + w)^P, with d_top = 1 - h, enter G as
    # expm1(P log1p(w - h)), their difference from 1, computed without
    # cancellation: near the threshold law's boundary (the frame within rounding
    # of max(y) - 1, h tiny) G is decided by w ~ h, which 1 - h + w rounds away
    # (normmax [[0, -0.9999999999999999]] at alpha = 50 gave 0.3209 for 0.3192)
    # (only where h <= 1/2, where h = 1 + y_r is exact: a small d_top is lost in h)
    h = 1 + scale * (zr - zmax)
    top = above & (z == zmax) & (h <= 0.5)
    n_top = top.sum(-1, keepdim=True).to(d.dtype)
    others = mask * ~top

    wb0 = wb.clamp_min(0)

    def g_and_slope(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # NOTE: w_b itself at the segment's end, not x_b^a: x_b = w_b^(1/a) rounds (at
        # w_b = 1 - 2e-16 and alpha = 100, to 1, where G was 0 and the frame stayed
        # one score too high: a one-hot row for [0.42, 0.29, 0.29])
        w = torch.where(x >= xb, wb0, x.pow(a))
        u = dz + w
        v = u.pow(power).mul_(mask)
        tied = ties * (x if kind == "entmax" else w.pow(power))  # ties x^c
        rest = (v * others).sum(-1, keepdim=True) + tied
        em = torch.expm1(power * torch.log1p(w - h)) * n_top  # (0 without a maximum above)
        g = rest + em + (n_top - 1)
        mag = rest + em.abs() + (n_top - 1).abs()  # what G's rounding is relative to
        # d/dx (d + x^a)^P = c (d + w)^P (w / (d + w)) / x, d/dx x^c = c x^c / x
        # NOTE: w / u <= 1 first: v / u alone overflows where u is tiny (scores
        # within 1e-38 of the frame in float32 give v / u = 1e39 = inf, and the
        # underflowed w / x = 0 then made inf * 0 = NaN: rows of NaN at alpha >= 50)
        pos = x > 0
        slope = c * ((v * (w / u)).sum(-1, keepdim=True) + tied) / torch.where(pos, x, 1)
        # at x = 0: the ties' 1 (entmax, c = 1), else 0
        return g, torch.where(pos, slope, ties if kind == "entmax" else 0), mag

    x = torch.minimum(start, xb)
    eps = torch.finfo(d.dtype).eps
    done = torch.zeros_like(ties, dtype=torch.bool) if done is None else done
    g, slope, mag = g_and_slope(x)
    if compiling():
        max_iter = min(max_iter, COMPILED_FRAME_STEPS)
    for _ in range(max_iter if compiling() or not bool(done.all()) else 0):
        # (a zero slope, normmax at x = 0: the tangent runs off to the right end)
        step = torch.where(slope > 0, g / torch.where(slope > 0, slope, 1), -torch.inf)
        x_new = (x - step).clamp_min(0).minimum(xb)
        stalled = (g >= 0) & (x_new >= x)  # from the right the iterates decrease
        tiny = (x_new - x).abs() <= 4 * eps * x  # within rounding (also: stuck at an end)
        move = ~done & ~stalled & ~tiny
        x = torch.where(move, x_new, x)
        # |G| within rounding: this was the last step that can help
        done = done | stalled | tiny | (g.abs() <= 4 * eps * mag)
        if not compiling() and bool(done.all()):
            break
        g_new, slope_new, mag_new = g_and_slope(x)
        g = torch.where(move, g_new, g)
        slope = torch.where(move, slope_new, slope)
        mag = torch.where(move, mag_new, mag)
    # the root outside the segment: r is not in the support (up), or y_b is (down)
    up = (x <= 0) & (g > 0)
    down = (x >= xb) & (g < 0) & (scale * (zr - zb) <= wb)
    return x, up, down, zb, done


def _offset_constants(a: float, kind: str) -> tuple[float, float, float]:
    """(scale of y = scale z, power P of the threshold equation, exponent c of the
    ties' term ties x^c = (alpha - 1) P) of :func:`offset_weights`."""
    if kind == "entmax":
        return a, 1.0 / a, 1.0
    return 1.0, (a + 1) / a, a + 1


def _next_frame(
    z: torch.Tensor,
    zr: torch.Tensor,
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    zb: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frame score and start after a move. Up: the next score above, from
    tau = y_r (the right end of its segment); down: z_b, from tau = y_b (x = 0)."""
    z_up = torch.where(z > zr, z, torch.inf).amin(-1, keepdim=True)
    new_zr = torch.where(up, z_up, torch.where(down, zb, zr))
    return new_zr, torch.where(up, torch.inf, torch.where(down, 0.0, x))


def _frame_weights(d: torch.Tensor, x: torch.Tensor, a: float) -> torch.Tensor:
    """(d_i + x^a)_+^(1/a) in a frame (d_i = y_i - y_r), and x itself at the
    frame's score and its ties (never from an underflowed x^a)."""
    above = d > 0
    q = (torch.where(above, d, 1) + x.pow(a)).pow(1.0 / a)
    return torch.where(above, q, torch.where(d == 0, x, 0))


@dataclass(frozen=True)
class MapImpl:
    """How to compute one simplex map whose backward needs only its output p."""

    name: str  # for error messages
    forward: Callable[[torch.Tensor], torch.Tensor]  # PyTorch solver on (rows, n)
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p, g) -> J^T g
    kernel: str | None = None  # fused CPU kernel pair <kernel>_forward / _backward
    # extra arguments of both kernel ops after the tensors (alpha for the general maps)
    kernel_args: tuple[float, ...] = ()


def map_forward(impl: MapImpl, z: torch.Tensor) -> torch.Tensor:
    """p = map(z) on a contiguous (rows, n) matrix, without autograd: the fused CPU
    kernel where it applies (its per-row status checked), else the PyTorch solver."""
    if impl.kernel is not None and _kernels.use_kernels(z):
        p, status = getattr(_kernels.ops(), f"{impl.kernel}_forward")(z, *impl.kernel_args)
        raise_for_status(status, impl.name)
        return p
    return impl.forward(z)


class MapFunction(torch.autograd.Function):
    """p = map(z) on a (rows, n) matrix with the closed-form backward of ``impl``:
    through the fused CPU kernels where they apply, else the PyTorch solvers."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, impl: MapImpl) -> torch.Tensor:  # type: ignore[override]
        p = map_forward(impl, z)
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
            op = getattr(_kernels.ops(), f"{impl.kernel}_backward")
            return op(p, g.contiguous(), *impl.kernel_args), None
        return impl.backward(p, g), None


def apply_map(impl: MapImpl, z: torch.Tensor, dim: int) -> torch.Tensor:
    """``impl`` along ``dim`` of ``z`` (any leading shape, half precision in float32)."""
    if torch.is_grad_enabled() and z.requires_grad:
        return rowwise(lambda m: MapFunction.apply(m, impl), z, dim)
    # NOTE: nothing to differentiate: the forward without autograd.Function's own
    # cost (about 15 us a call in Python)
    return rowwise(partial(map_forward, impl), z, dim)
