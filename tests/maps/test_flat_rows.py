"""sparsemax, 1.5-entmax and 2-normmax on flat and nearly flat rows, at widths 1 to
65536 and score scales 1e-30 to 1e3, against an exact reference: both backends,
float32 and float64, forward and backward.

A zero-initialised router gives exactly these rows. Before (the CPU kernels):
``entmax(zeros(1, E), 1.5)`` summed to 1.0000038 at E = 64, 0.9996 at 1024 and 0.373
at 65536, ``sparsemax(zeros(1, 1024))`` to 1.0005 (1.0586 at 65536), float64 rows
were off by up to 5e-9: the threshold's closed form was taken from a point far below
it (the start, -1/2 on a flat row), where every term summed is about 1/2 while the
outputs are 1/E.

The reference (``exact_reference``): the scores are float32 numbers, so y = z - max z
(halved for 1.5-entmax) and y^2 are exact in float64 and are exact integers times
2^-150 and 2^-300. The support's sums are Python integers, the threshold is solved
from them in mpmath at 100 digits, and the outputs are rounded from it once (an
error-free difference y - tau in float64). It is checked against a map written
entirely in mpmath on smaller rows (``mp_reference``). The gradients' reference is
the closed-form Jacobian-vector product in float64 on the reference outputs.

Bounds: a row sums to 1 within 2 eps (sqrt(E) + 1) (the rounding of summing E
outputs), and every output is within 2 eps (sqrt(E) + 1) max(p) of the reference
(on a flat row, one error in the threshold moves every output by the row's error in
the sum); a gradient within eps (sqrt(E) + 4) max|g|, times ||p||_2 for 2-normmax.
"""

from __future__ import annotations

import functools
import itertools
import math

import mpmath as mp
import numpy as np
import pytest
import torch

from moelab import maps

KINDS = ("sparsemax", "entmax15", "normmax2")
MAPS = {
    "sparsemax": lambda z: maps.sparsemax(z),
    "entmax15": lambda z: maps.entmax(z, 1.5),
    "normmax2": lambda z: maps.normmax(z, 2.0),
}
WIDTHS = [1, 2, 7, 16, 33, 64, 100, 127, 128, 129, 256, 1024, 4096]
SCALES = [1e-30, 1e-6, 1e-2, 1.0, 1e3]
SHIFT = 150  # y * 2^150 is an integer for float32 scores (halved: 2^-150 steps)


@functools.cache
def rows(n: int) -> dict[str, torch.Tensor]:
    """The test rows of width n, as float64 tensors of float32 numbers: zeros, randn
    times each scale, half zeros and half -0.5, and zeros with one masked score."""
    g = torch.Generator().manual_seed(n)
    out = {"zeros": torch.zeros(n, dtype=torch.float64)}
    for s in SCALES:
        out[f"randn*{s:g}"] = (torch.randn(n, generator=g, dtype=torch.float64) * s).float()
    half = torch.zeros(n, dtype=torch.float64)
    half[n // 2 :] = -0.5
    out["half 0, half -0.5"] = half
    if n > 1:
        masked = torch.zeros(n, dtype=torch.float64)
        masked[n // 3] = -math.inf
        out["zeros, one -inf"] = masked
    return {name: row.double() for name, row in out.items()}


def exact_reference(z: np.ndarray, kind: str) -> np.ndarray:
    """The map of one row of float32 scores (float64 array, -inf allowed), each output
    rounded once from the exact threshold (see the module docstring)."""
    half = 0.5 if kind == "entmax15" else 1.0
    finite = np.isfinite(z)
    y = np.where(finite, (z - z[finite].max()) * half, -np.inf)  # exact
    ys = np.sort(y[finite])[::-1]
    scaled = [int(v) for v in ys * 2.0**SHIFT]  # exact integers
    sums = list(itertools.accumulate(scaled))
    squares = list(itertools.accumulate(v * v for v in scaled))
    with mp.workdps(100):
        unit = mp.mpf(2) ** -SHIFT

        def threshold(k: int) -> mp.mpf:  # of the k largest scores
            s1 = mp.mpf(sums[k - 1]) * unit
            if kind == "sparsemax":  # sum (y - tau) = 1
                return (s1 - 1) / k
            s2 = mp.mpf(squares[k - 1]) * unit**2  # sum (y - tau)^2 = 1
            disc = s1 * s1 - k * (s2 - 1)  # < 0: no threshold keeps all k
            return (s1 - mp.sqrt(disc)) / k if disc >= 0 else mp.inf

        # the support: the largest k whose k-th score lies above the threshold on the
        # k largest; from the float64 count, moved to where that holds exactly
        j = np.arange(1, len(ys) + 1)
        if kind == "sparsemax":
            k = int(((1 + j * ys > np.cumsum(ys)) & (ys > -1)).sum())
        else:
            mean = np.cumsum(ys) / j
            var = np.cumsum(ys * ys) / j - mean * mean
            t = mean - np.sqrt(np.clip((1 - j * var) / j, 0, None))
            k = int(((t < ys) & (ys > -1)).sum())
        k = max(k, 1)
        while k > 1 and not ys[k - 1] > threshold(k):
            k -= 1
        while k < len(ys) and ys[k] > threshold(k + 1):
            k += 1
        tau = threshold(k)
        assert ys[k - 1] > tau and (k == len(ys) or ys[k] <= tau)
        hi = float(tau)
        lo = float(tau - hi)
        total = float(mp.mpf(sums[k - 1]) * unit - k * tau)  # sum over S of (y - tau)
    # u = y - tau: y - hi exactly (a two-sum), then - lo, rounded once
    with np.errstate(invalid="ignore"):  # (-inf - -inf at masked scores)
        s = y - hi
        b = s - y
        err = (y - (s - b)) + (-hi - b)
    u = np.where(y > tau, s + (err - lo), 0.0)
    if kind == "entmax15":
        return u * u
    if kind == "normmax2":
        return u / total
    return u


def mp_reference(z: list[float], kind: str) -> list[float]:
    """The same map written directly in mpmath: bisection on the threshold (slow)."""
    with mp.workdps(60):
        half = mp.mpf(0.5) if kind == "entmax15" else mp.mpf(1)
        zs = [mp.mpf(v) for v in z if v != -math.inf]
        top = max(zs)
        y = [(v - top) * half if v != -math.inf else None for v in z]
        power = 1 if kind == "sparsemax" else 2
        lo, hi = mp.mpf(-1), mp.mpf(0)
        for _ in range(220):
            mid = (lo + hi) / 2
            if mp.fsum((v - mid) ** power for v in y if v is not None and v > mid) >= 1:
                lo = mid
            else:
                hi = mid
        u = [v - lo if v is not None and v > lo else mp.mpf(0) for v in y]
        if kind == "entmax15":
            u = [v * v for v in u]
        if kind == "normmax2":
            total = mp.fsum(u)
            u = [v / total for v in u]
        return [float(v) for v in u]


def jvp(p: np.ndarray, g: np.ndarray, kind: str) -> np.ndarray:
    """J^T g in float64 from the outputs p (closed forms, see docs/maps.md)."""
    s = p > 0
    if kind == "sparsemax":  # s (g - mean_S g)
        return np.where(s, g - g[s].mean(), 0.0)
    if kind == "entmax15":  # r (g - <r, g> / sum r), r = sqrt(p)
        r = np.sqrt(p)
        return r * (g - (r * g).sum() / r.sum())
    inv_s = math.sqrt(float((p * p).sum()))  # 2-normmax: 1/S = ||p||_2
    h = (g - (g * p).sum()) * inv_s
    return np.where(s, h, 0.0) - h[s].sum() * p


@functools.cache
def reference(n: int, kind: str, name: str) -> np.ndarray:
    return exact_reference(rows(n)[name].numpy(), kind)


def check_rows(kind: str, dtype: torch.dtype, n: int, names: list[str] | None = None) -> None:
    """The map of every test row of width n (all in one batch) and its gradient
    against the references, within the bounds of the module docstring."""
    eps = torch.finfo(dtype).eps
    table = rows(n)
    names = list(table) if names is None else names
    z = torch.stack([table[name] for name in names]).to(dtype).requires_grad_()
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(n + 1), dtype=torch.float64)
    p = MAPS[kind](z)
    p.backward(g.to(dtype))
    assert z.grad is not None
    bound = 2 * eps * (math.sqrt(n) + 1)
    for i, name in enumerate(names):
        want = reference(n, kind, name)
        got = p[i].detach().double().numpy()
        where = f"{kind}, {dtype}, {n} experts, row {name!r}"
        total = math.fsum(got.tolist())
        assert abs(total - 1) <= bound, f"{where}: sums to 1 {total - 1:+.3g}"
        err = float(np.abs(got - want).max())
        assert err <= bound * want.max(), f"{where}: off the reference by {err:.3g}"
        gi = g[i].numpy()
        expected = jvp(want, gi, kind)
        # (1.5-entmax on the torch path gives one entry minus the sum of the others,
        # whose rounding is that of a sum of E terms of size sqrt(p) |g|: about
        # eps |g| on a flat row)
        scale = math.sqrt(float((want * want).sum())) if kind == "normmax2" else 1.0
        gbound = eps * (math.sqrt(n) + 4) * float(np.abs(gi).max()) * scale
        gerr = float(np.abs(z.grad[i].double().numpy() - expected).max())
        assert gerr <= gbound, f"{where}: gradient off by {gerr:.3g} (bound {gbound:.3g})"


# ---- the reference ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_exact_reference_matches_mpmath(kind: str, n: int) -> None:
    for name, row in rows(n).items():
        want = mp_reference(row.tolist(), kind)
        got = exact_reference(row.numpy(), kind)
        np.testing.assert_allclose(got, want, rtol=5e-16, atol=1e-300, err_msg=name)


def test_exact_reference_closed_forms() -> None:
    # flat rows: 1/E; half 0 / half -0.5 at 4096 experts: 2/E on the zeros for all three
    for kind in KINDS:
        np.testing.assert_allclose(reference(65536, kind, "zeros"), 2.0**-16, rtol=3e-16)
        half = reference(4096, kind, "half 0, half -0.5")
        np.testing.assert_allclose(half[:2048], 2.0**-11, rtol=3e-16)
        assert np.all(half[2048:] == 0)


# ---- the maps ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_flat_and_scaled_rows_at_every_width(kind: str, dtype: torch.dtype, backend: str) -> None:
    # the widths straddle the kernels' two layouts (blocks of rows across the
    # lanes below 32-128 experts, along the row above) and their vector widths
    for n in WIDTHS:
        check_rows(kind, dtype, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_65536_experts(kind: str, dtype: torch.dtype, backend: str) -> None:
    # before: zeros summed to 0.373 (1.5-entmax) and 1.0586 (sparsemax) in float32
    check_rows(kind, dtype, 65536, ["zeros", "randn*1e-30", "randn*1e-06", "zeros, one -inf"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("kind", "alpha"), [("entmax", 1.25), ("entmax", 3.0), ("normmax", 1.5), ("normmax", 4.0)]
)
def test_general_alpha_on_flat_rows(kind: str, alpha: float, dtype: torch.dtype, backend: str):
    # the general-alpha solvers (Newton over the candidates, and the offset form)
    # sum in double over the candidates: a flat row gives 1/E within the same
    # bound, at both layouts' widths and at 65536 (they never had the flaw; kept)
    eps = torch.finfo(dtype).eps
    for n in (7, 64, 129, 4096, 65536):
        p = getattr(maps, kind)(torch.zeros(2, n, dtype=dtype), alpha).double()
        bound = 2 * eps * (math.sqrt(n) + 1)
        assert float((p - 1 / n).abs().max()) <= bound / n
        assert float((p.sum(-1) - 1).abs().max()) <= bound
