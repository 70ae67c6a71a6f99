"""LapSum soft top-k (Struski et al., 2025), the router map of *SoftMoE: Soft
Differentiable Routing for Mixture-of-Experts in LLMs*.

With F the Laplace CDF (F(y) = e^y / 2 for y <= 0, 1 - e^-y / 2 for y > 0),
find the threshold x solving

    sum_i F((z_i - x) / t) = k

and return p_i = F((z_i - x) / t): each p_i in [0, 1], summing to k, a smooth
version of the 0/1 top-k mask (t -> 0 recovers it). 0 < k < n is required.

Solver (exact, no sort): F = min(e^y / 2, 1 - e^-y / 2), so splitting the
scores into a group above and a group below any point c and using each
group's branch bounds the sum from above, tightly for the split at x. For a
fixed split the equation is a quadratic in e^(x/t). Starting at c = max(z)
and re-splitting at each solution decreases x monotonically and stops exactly
once the split no longer changes (at most n + 1 rounds, 2-4 in practice).

NOTE: x is never formed as one float. When t is small next to the scores
(below the float spacing of max|z|, e.g. t = 2e-6 at z = 100 in float32, or
scores 1e30 apart), x = c + t * log(u) rounds back to c and the answer is lost.
So each round measures from the scores nearest the split: with lo the largest
score below it and hi the smallest above,
    a = sum_below exp((z - lo)/t) >= 1,   b = sum_above exp((hi - z)/t) >= 1,
    g = (hi - lo)/t,
the quadratic's root is x = lo + t s (k >= n_above) or x = hi + t s
(k < n_above), with s from a, b, g and k - n_above in log space. The threshold
is carried as the pair (ref, s), and outputs use the differences
(z - ref)/t - s, which are exact for the scores near the threshold; scores far
from it get exactly 0 or 1. A final Newton step on s removes the last rounding.

Gradients, with f_i = F'((z_i - x)/t) = min(p_i, 1 - p_i),
gbar = sum f g / sum f and y_i = (z_i - x)/t = F^-1(p_i):
    dL/dz_i = f_i (g_i - gbar) / t,    dL/dk = gbar,
    dL/dt   = -sum_i f_i y_i (g_i - gbar) / t.
They are functions of p, g and t alone, so under create_graph=True they are
computed with differentiable torch ops and double backward is exact.

Input checks that read tensor values (NaN/+inf scores, masked rows, k against
the number of unmasked experts, a tensor temperature) follow the maps' policy:
eager mode with checks on (see ``maps.set_checks``), skipped under
torch.compile. Plain-number k and temperature are always checked.
"""

from __future__ import annotations

import math

import torch

from . import _kernels
from ._core import (
    BAD_K,
    check_scores,
    compiling,
    compute_dtype,
    error_message,
    host_checks,
    note_converged,
    raise_for_status,
)


def _split_root(
    z: torch.Tensor, up: torch.Tensor, k: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The root x = ref + t s of one split's equation (see the module docstring).
    ``z`` is (rows, n), ``up`` marks the group above the split, ``k`` and ``t``
    are (rows, 1). Returns (ref, s), each (rows, 1)."""
    inf = math.inf
    below = ~up & (z > -inf)
    n_above = up.sum(-1, keepdim=True).to(z.dtype)
    lo = torch.where(below, z, -inf).amax(-1, keepdim=True)  # -inf: nothing finite below
    hi = torch.where(up, z, inf).amin(-1, keepdim=True)  # +inf: nothing above
    lo0 = torch.where(torch.isfinite(lo), lo, 0)
    hi0 = torch.where(torch.isfinite(hi), hi, 0)
    a = torch.where(below, torch.exp(((z - lo0) / t).clamp(max=0)), 0).sum(-1, keepdim=True)
    b = torch.where(up, torch.exp(((hi0 - z) / t).clamp(max=0)), 0).sum(-1, keepdim=True)
    log_a, log_b = torch.log(a), torch.log(b)  # -inf for an empty group
    gap = (hi - lo) / t  # > 0; +inf when a group is empty
    # a/2 e^{-v} + n_above - b/2 e^{v - gap} = k with v = (x - lo)/t. With
    # dk = k - n_above and 4AB = a b e^{-gap}, the root, stably for each sign:
    #   dk >= 0: v = log a - log(|dk| + sqrt(dk^2 + 4AB))       (from lo)
    #   dk <= 0: v - gap = log(|dk| + sqrt(dk^2 + 4AB)) - log b  (from hi)
    dk = k - n_above
    log_ad = torch.log(dk.abs())
    log_4ab = log_a + log_b - gap
    log_root = 0.5 * torch.logaddexp(2 * log_ad, log_4ab)
    log_sum = torch.logaddexp(log_ad, log_root)
    from_lo = dk >= 0
    ref = torch.where(from_lo, lo, hi)
    s = torch.where(from_lo, log_a - log_sum, log_sum - log_b)
    # dk = 0 across an overflowing gap: any point inside it is a root
    big = torch.finfo(z.dtype).max
    return ref, torch.nan_to_num(s, nan=0.0, posinf=big, neginf=-big)


FIXED_ROUNDS = 2
"""Rounds of the split iteration after :func:`start_split` in the fixed-count solver
(``lapsum_threshold_torch(fixed=True)``, the one torch.compile traces): the start is
the threshold's own split but where a score lies within rounding of the threshold;
a round that moves the split corrects that, the next confirms it (a row whose split
repeats is done and keeps its value). On 36864 test rows (ties, masked experts,
t = 2e-6, k near n, n up to 257) the start split was already the final one."""


def start_split(z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The split at the threshold x (``up``: the scores above it), by a binary search
    over the sorted scores in ceil(log2(n + 1)) fixed steps: with
    G(c) = sum_i F((z_i - c)/t) - k decreasing, x <= z_(m) iff G(z_(m)) <= 0, and the
    scores above x are the largest j with G(z_(j)) <= 0. ``z`` is (rows, n), ``k``
    and ``t`` (rows, 1). (G near 0 at a score, within rounding of x, may place that
    one score on the wrong side; the split iteration corrects it.)"""
    zs = z.sort(-1, descending=True).values  # -inf last
    n_finite = (zs > -math.inf).sum(-1, keepdim=True)
    lo = torch.zeros_like(n_finite)  # the answer j lies in [lo, hi]
    hi = n_finite
    for _ in range(max(1, math.ceil(math.log2(z.shape[-1] + 1)))):
        mid = (lo + hi) // 2
        c = zs.gather(-1, mid.clamp(max=z.shape[-1] - 1))
        g = _laplace_cdf(torch.where(z > -math.inf, (z - c) / t, -math.inf)).sum(-1, keepdim=True)
        at_or_below = (g - k <= 0) & (mid < hi)  # x <= z_(mid): z_(mid) is above x
        lo = torch.where(at_or_below, mid + 1, lo)
        hi = torch.where(at_or_below | (mid >= hi), hi, mid)
    # the j largest scores: those above the (j + 1)-th
    c = zs.gather(-1, lo.clamp(max=z.shape[-1] - 1))
    return torch.where(lo >= n_finite, z > -math.inf, z > c)


def lapsum_threshold_torch(
    z: torch.Tensor, k: torch.Tensor, t: torch.Tensor, fixed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The threshold x = ref + t * s per row by the split iteration, in plain
    PyTorch. ``z`` is (rows, n); ``k`` and ``t`` are (rows, 1). Returns (ref, s).

    Every split's root bounds x from above (module docstring), so the iteration
    decreases to x from any start. Eager mode (``fixed`` False) starts at max(z), runs
    at most n + 2 rounds and stops once every row's split repeats (a host read per
    round; 2-4 rounds in practice). The fixed-count form (``fixed`` True; the default
    under torch.compile, where a loop cannot stop on the data) starts from
    :func:`start_split` and runs :data:`FIXED_ROUNDS` rounds: log2(n) + 3 cheap
    steps instead of n + 2 rounds, to the same final split and so the same bits."""
    if fixed is None:
        fixed = compiling()
    if fixed:
        up = start_split(z, k, t)
        ref, s = _split_root(z, up, k, t)
        prev = up.sum(-1, keepdim=True).to(z.dtype)
        rounds = FIXED_ROUNDS
    else:
        ref = z.amax(-1, keepdim=True)
        s = torch.zeros_like(ref)
        prev = torch.full_like(ref, -1.0)
        rounds = z.shape[-1] + 2
    done = torch.zeros_like(ref, dtype=torch.bool)
    for _ in range(rounds):
        up = (z - ref) / t > s
        above = up.sum(-1, keepdim=True).to(z.dtype)
        done = done | (above == prev)  # split unchanged: (ref, s) is its exact root
        if not fixed and bool(done.all()):
            break
        prev = above
        new_ref, new_s = _split_root(z, up, k, t)
        ref = torch.where(done, ref, new_ref)
        s = torch.where(done, s, new_s)
    if fixed:  # (eager mode runs to the end: n + 2 rounds always suffice)
        note_converged(done)
    return ref, s


def _laplace_cdf(y: torch.Tensor) -> torch.Tensor:
    """F(y) for the Laplace CDF F, from exp(-|y|) <= 1 (never overflows)."""
    half = 0.5 * torch.exp(-y.abs())
    return torch.where(y > 0, 1 - half, half)


def lapsum_torch(z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """p = F((z - x)/t) with sum p = k, in plain PyTorch (``k``, ``t``: (rows, 1))."""
    ref, s = lapsum_threshold_torch(z, k, t)
    y = (z - ref) / t - s
    p = _laplace_cdf(y)
    # NOTE: s is rounded; one Newton step on it takes the last rounding of the
    # sum off (d sum(p) / ds = -sum f, f = F' = min(p, 1 - p)).
    f = torch.minimum(p, 1 - p)
    fsum = f.sum(-1, keepdim=True)
    delta = torch.where(fsum > 0, (p.sum(-1, keepdim=True) - k) / fsum, 0)
    return _laplace_cdf(y - torch.nan_to_num(delta, nan=0.0, posinf=0.0, neginf=0.0))


def _check_k(z: torch.Tensor, k: torch.Tensor, name: str = "lapsum") -> None:
    finite = (~torch.isneginf(z)).sum(-1, keepdim=True).to(k.dtype)
    bad = ~((k > 0) & (k < finite))
    if bool(bad.any()):
        row = int(torch.nonzero(bad.reshape(-1))[0, 0])
        raise ValueError(
            error_message(BAD_K, name, row) + f" Got k={float(k.reshape(-1)[row]):g} with "
            f"{int(finite.reshape(-1)[row])} unmasked experts."
        )


def _backward_torch(
    p: torch.Tensor, g: torch.Tensor, t: torch.Tensor, need_t: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dz, dk, dt) from p, g and t (rows,) alone, with differentiable ops that
    stay finite where p is 0 or 1 (so that double backward is exact)."""
    t = t[:, None]
    f = torch.minimum(p, 1 - p)  # F'((z - x)/t)
    fsum = f.sum(-1, keepdim=True)
    # every p at 0 or 1 to machine precision: numerically constant, no gradient
    has = fsum > 0
    gbar = torch.where(has, (f * g).sum(-1, keepdim=True) / torch.where(has, fsum, 1), 0)
    centred = g - gbar
    dz = f * centred / t  # dL/dz = f (g - gbar) / t
    dk = gbar[:, 0]  # dL/dk = gbar
    if not need_t:
        return dz, dk, None
    # f y from p: y = log(2f) where p <= 1/2, -log(2f) where p > 1/2 (0 where f = 0)
    pos = f > 0
    f_log = torch.where(pos, f * torch.log(2 * torch.where(pos, f, 1)), 0)
    fy = torch.where(p > 0.5, -f_log, f_log)
    dt = -(fy * centred).sum(-1) / t[:, 0]  # dL/dt = -sum f y (g - gbar) / t
    return dz, dk, dt


class _LapSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        p = _lapsum_forward(z, k, t)
        ctx.save_for_backward(p, t)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        p, t = ctx.saved_tensors
        need_t = ctx.needs_input_grad[2]
        # NOTE: under create_graph=True the torch ops below keep the graph
        # (through the saved output p back into this Function); the kernel would not.
        if _kernels.use_kernels(p) and not need_t and not torch.is_grad_enabled():
            dz, dk = _kernels.ops().lapsum_backward(p, g.contiguous(), t)
            return dz, dk, None
        return _backward_torch(p, g, t, need_t)


def _lapsum_forward(z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """p on a contiguous (rows, n) matrix z, with k and t (rows,), without autograd:
    the fused CPU kernel where it applies (its per-row status checked), else the
    PyTorch solver."""
    if _kernels.use_kernels(z):
        p, _, status = _kernels.ops().lapsum_forward(z, k.contiguous(), t.contiguous())
        # (one reduction and one host read on the common path: no row failed)
        if host_checks() and bool(status.any()):
            if bool((status == BAD_K).any()):
                _check_k(z, k[:, None])
            raise_for_status(status, "lapsum")
        return p
    check_scores(z, "lapsum")
    if host_checks():
        _check_k(z, k[:, None])
    return lapsum_torch(z, k[:, None], t[:, None])


def _per_row(
    value: torch.Tensor | float, lead: torch.Size, name: str, like: torch.Tensor
) -> torch.Tensor:
    """Broadcast a scalar, or a tensor shaped like the leading dims of the
    scores (optionally with a trailing 1), to one value per row of ``like``, the
    scores as a (rows, n) matrix."""
    if isinstance(value, (int, float)):
        # NOTE: the common call, a plain number, in one op: the broadcast below and
        # the copy that makes it contiguous cost about 15 us a call
        return like.new_full((like.shape[0],), float(value))
    v = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if v.dim() == len(lead) + 1 and v.shape[-1] == 1:
        v = v[..., 0]
    try:
        v = v.expand(lead)
    except RuntimeError:
        raise ValueError(
            f"lapsum: {name} of shape {tuple(v.shape)} does not broadcast to the scores' "
            f"leading shape {tuple(lead)} (one value per row, or a scalar)"
        ) from None
    return v.reshape(-1)


def _temperature_message(
    t: object, dtype: torch.dtype, name: str = "lapsum", key: str = "temperature"
) -> str:
    return (
        f"{name}: {key} must be > 0 and finite (in {dtype}), got {t}; pass a positive "
        "finite temperature (small: close to hard top-k, large: close to k/n)"
    )


def check_temperature(
    t: float, dtype: torch.dtype = torch.float64, name: str = "lapsum", key: str = "temperature"
) -> float:
    """A plain-number temperature: positive and finite in ``dtype`` (the dtype the
    map computes in; subnormal values count as positive). Returns it as a float."""
    fi = torch.finfo(dtype)
    if not fi.tiny * fi.eps <= float(t) <= fi.max:  # False for NaN
        raise ValueError(_temperature_message(t, dtype, name, key))
    return float(t)


def check_k(k: float, n_experts: int | None = None, name: str = "lapsum", key: str = "k") -> float:
    """A plain-number k: 0 < k < ``n_experts`` (k > 0 and finite when the number of
    experts is not known yet). Returns it as a float."""
    upper = math.inf if n_experts is None else n_experts
    if not 0 < float(k) < upper:
        if n_experts is None:
            raise ValueError(
                f"{name}: {key} must be a positive finite number (and below the number of "
                f"experts), got {key}={k}"
            )
        raise ValueError(
            f"{name}: {key} must lie strictly between 0 and the number of experts "
            f"({n_experts}), got {key}={k}; lower {key} or unmask experts."
        )
    return float(k)


def lapsum(
    z: torch.Tensor,
    k: torch.Tensor | float,
    temperature: torch.Tensor | float = 1.0,
    dim: int = -1,
) -> torch.Tensor:
    """LapSum soft top-k of ``z`` along ``dim``: values in [0, 1] summing to ``k``.

    ``k`` and ``temperature`` are numbers or tensors broadcastable to the
    scores' shape without ``dim`` (one value per row); both are differentiable.
    """
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
    if isinstance(temperature, torch.Tensor):
        t_c = temperature.detach().to(compute_dtype(z.dtype))
        if host_checks() and not bool((torch.isfinite(t_c) & (t_c > 0)).all()):
            raise ValueError(_temperature_message(temperature, compute_dtype(z.dtype)))
    else:  # a plain number: checked for free, in the dtype the map computes in
        check_temperature(temperature, compute_dtype(z.dtype))
    if isinstance(k, (int, float)):  # a plain number: checked for free
        check_k(k, shape[-1])
    else:
        k_dtype = torch.as_tensor(k).dtype
        if not k_dtype.is_floating_point and k_dtype not in (torch.int32, torch.int64):
            raise TypeError(f"lapsum: k must be a number or a numeric tensor, got {k_dtype}")
    flat = moved.reshape(-1, shape[-1]).to(compute_dtype(z.dtype)).contiguous()
    k_rows = _per_row(k, shape[:-1], "k", flat)
    t_rows = _per_row(temperature, shape[:-1], "temperature", flat)
    if torch.is_grad_enabled() and (
        flat.requires_grad or k_rows.requires_grad or t_rows.requires_grad
    ):
        p = _LapSumFunction.apply(flat, k_rows, t_rows)
    else:  # nothing to differentiate: without autograd.Function's own cost
        p = _lapsum_forward(flat, k_rows, t_rows)
    return p.to(z.dtype).reshape(shape).movedim(-1, dim)
