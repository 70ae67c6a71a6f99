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
Sums are kept in log space, so scores far apart (say k-th and (k+1)-th score
100 / t apart) keep their exact weights instead of underflowing.

Gradients, with f_i = F'((z_i - x)/t) = min(p_i, 1 - p_i) and
gbar = sum f g / sum f:
    dL/dz_i = f_i (g_i - gbar) / t,    dL/dk = gbar,
    dL/dt   = -sum_i f_i (z_i - x)(g_i - gbar) / t^2.
"""

from __future__ import annotations

import math

import torch

from . import _kernels
from ._core import BAD_K, _message, check_scores, compute_dtype, raise_for_status


def lapsum_threshold_torch(z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The threshold x per row by the split iteration, in plain PyTorch.
    ``z`` is (rows, n); ``k`` and ``t`` are (rows, 1)."""
    c = z.amax(-1, keepdim=True)
    prev = torch.full_like(c, -1.0)
    done = torch.zeros_like(c, dtype=torch.bool)
    for _ in range(z.shape[-1] + 2):
        up = z > c
        above = up.sum(-1, keepdim=True).to(z.dtype)
        done = done | (above == prev)
        if bool(done.all()):
            break
        prev = above
        d = (z - c) / t
        # log A = log(1/2 sum_below e^{(z-c)/t}),  log B = log(1/2 sum_above e^{(c-z)/t})
        log_a = torch.logsumexp(torch.where(up, -math.inf, d), -1, keepdim=True) - math.log(2)
        log_b = torch.logsumexp(torch.where(up, -d, -math.inf), -1, keepdim=True) - math.log(2)
        # Solve A/u + n_above - B u = k for log u, stably for each sign of dk = k - n_above.
        dk = k - above
        ad = dk.abs()
        w = torch.exp((log_a + log_b - 2 * torch.log(ad)).clamp(max=700.0))
        log_sum = torch.log(ad + ad * torch.sqrt(1 + 4 * w))  # log(|dk| + sqrt(dk^2 + 4AB))
        logu = torch.where(
            dk > 0,
            math.log(2) + log_a - log_sum,
            torch.where(dk < 0, log_sum - math.log(2) - log_b, 0.5 * (log_a - log_b)),
        )
        c = torch.where(done, c, c + t * logu)
    return c


def _laplace_cdf(d: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """F(d / t) for the Laplace CDF F, from exp(-|d|/t) <= 1 (never overflows)."""
    half = 0.5 * torch.exp(-d.abs() / t)
    return torch.where(d > 0, 1 - half, half)


def _check_k(z: torch.Tensor, k: torch.Tensor, name: str = "lapsum") -> None:
    finite = (~torch.isneginf(z)).sum(-1, keepdim=True).to(k.dtype)
    bad = ~((k > 0) & (k < finite))
    if bool(bad.any()):
        row = int(torch.nonzero(bad.reshape(-1))[0, 0])
        raise ValueError(
            _message(BAD_K, name, row) + f" Got k={float(k.reshape(-1)[row]):g} with "
            f"{int(finite.reshape(-1)[row])} unmasked experts."
        )


class _LapSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # z: (rows, n); k, t: (rows,)
        if _kernels.use_kernels(z):
            p, x, status = _kernels.ops().lapsum_forward(z, k.contiguous(), t.contiguous())
            if bool((status == BAD_K).any()):
                _check_k(z, k[:, None])
            raise_for_status(status, "lapsum")
            x = x[:, None]
        else:
            check_scores(z, "lapsum")
            _check_k(z, k[:, None])
            x = lapsum_threshold_torch(z, k[:, None], t[:, None])
            p = _laplace_cdf(z - x, t[:, None])
            # NOTE: x is rounded to the precision of the scores; when they are
            # large (|z| ~ 1e4 in float32) that alone moves sum(p) off k. One
            # Newton step gives a correction applied to the differences z - x
            # (carrying the threshold as x + delta in two numbers).
            f = torch.minimum(p, 1 - p)
            delta = (p.sum(-1, keepdim=True) - k[:, None]) * t[:, None] / f.sum(-1, keepdim=True)
            delta = torch.nan_to_num(delta, nan=0.0, posinf=0.0, neginf=0.0)
            p = _laplace_cdf((z - x) - delta, t[:, None])
            x = x + delta
        ctx.save_for_backward(p, t, z if ctx.needs_input_grad[2] else None, x)
        return p

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        p, t, z, x = ctx.saved_tensors
        if _kernels.use_kernels(p) and not ctx.needs_input_grad[2]:
            dz, dk = _kernels.ops().lapsum_backward(p, g.contiguous(), t)
            return dz, dk, None
        f = torch.minimum(p, 1 - p)  # F'((z - x)/t)
        fsum = f.sum(-1, keepdim=True)
        # every p at 0 or 1 to machine precision: numerically constant, no gradient
        gbar = torch.where(fsum > 0, (f * g).sum(-1, keepdim=True) / fsum, 0)
        centred = g - gbar
        dz = f * centred / t[:, None]
        dk = gbar[:, 0]
        dt = None
        if ctx.needs_input_grad[2]:
            dt = -(f * (z - x) * centred).sum(-1) / t.square()
        return dz, dk, dt


def _per_row(
    value: torch.Tensor | float, lead: torch.Size, name: str, like: torch.Tensor
) -> torch.Tensor:
    """Broadcast a scalar, or a tensor shaped like the leading dims of the
    scores (optionally with a trailing 1), to one value per row."""
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
    t_check = torch.as_tensor(temperature)
    if bool(torch.isnan(t_check).any()) or not bool((t_check > 0).all()):
        raise ValueError(f"lapsum: temperature must be > 0, got {temperature}")
    k_check = torch.as_tensor(k)
    if not torch.is_floating_point(k_check) and k_check.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"lapsum: k must be a number or a numeric tensor, got {k_check.dtype}")
    dim = dim % z.dim()
    moved = z.movedim(dim, -1)
    shape = moved.shape
    flat = moved.reshape(-1, shape[-1]).to(compute_dtype(z.dtype)).contiguous()
    k_rows = _per_row(k, shape[:-1], "k", flat)
    t_rows = _per_row(temperature, shape[:-1], "temperature", flat)
    p = _LapSumFunction.apply(flat, k_rows, t_rows)
    return p.to(z.dtype).reshape(shape).movedim(-1, dim)
