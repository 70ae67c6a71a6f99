"""alpha-entmax and alpha-normmax against high-precision references at every
alpha in (1, 100], both backends, float64 and float32.

At large alpha the threshold lies within rounding of the smallest score in the
support: with y = (alpha - 1) z and alpha = 50, a runner-up weight of 0.026 needs
y_2 - tau = 0.026^49 = 1e-77, so a threshold held as one float cancels (a solver
that did gave [0.66, 0.34] for [0.9737, 0.0263], both summing to 1).

References, written here and independent of the library's solver:

- ``mp_plain``: bisection on tau itself in mpmath, with enough digits to resolve
  the smallest support weight (the definition, slow: a few rows);
- ``mp_offset``: the support from the exact membership test in mpmath (score k
  is in it iff sum_{y_i > y_k} (y_i - y_k)^power < 1), then bisection on the
  weight x of the smallest support score y_r, with tau = y_r - x^c (fast: every
  small row); checked against ``mp_plain``;
- ``offset_reference``: the same in float64 torch (sort, a binary search over the
  support size, bisection), for many rows and 16384 experts; checked against
  ``mp_offset``.
"""

from __future__ import annotations

import functools
import math

import mpmath as mp
import pytest
import torch

from moelab import maps
from moelab.maps._core import _frame_solve, _next_frame, entmax_offset_weights

ALPHAS = [1.01, 1.3, 1.5, 2.0, 3.0, 10.0, 50.0, 100.0]
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def _constants(alpha: float, kind: str) -> tuple[float, float, float]:
    """(scale of y = scale * z, power of the threshold equation, c with w = x^c)."""
    if kind == "entmax":
        return alpha - 1, 1 / (alpha - 1), max(alpha - 1, 1.0)
    return 1.0, alpha / (alpha - 1), 1.0


def mp_offset(z: list, alpha: float, kind: str, dps: int = 40, iters: int = 120) -> list:
    """The map of one row (floats or mpf, -inf allowed) in mpmath, as mpf values."""
    with mp.workdps(dps):
        a = mp.mpf(alpha)
        scale = a - 1 if kind == "entmax" else mp.mpf(1)
        power = 1 / (a - 1) if kind == "entmax" else a / (a - 1)
        c = a - 1 if kind == "entmax" and alpha > 2 else mp.mpf(1)
        finite = [mp.mpf(v) for v in z if v != -math.inf]
        y = sorted((scale * v for v in finite), reverse=True)
        k = 1  # the support is the k largest scores
        while k < len(y) and mp.fsum((v - y[k]) ** power for v in y[:k] if v > y[k]) < 1:
            k += 1
        r = y[k - 1]
        d = [v - r for v in y[:k]]
        w_hi = 1 + r - y[0]  # tau >= max(y) - 1
        if k < len(y):
            w_hi = min(w_hi, r - y[k])  # tau >= the next score
        lo, hi = mp.mpf(0), w_hi ** (1 / c)
        for _ in range(iters):
            mid = (lo + hi) / 2
            if mp.fsum((di + mid**c) ** power for di in d) >= 1:
                hi = mid
            else:
                lo = mid
        w = ((lo + hi) / 2) ** c
        q = []
        for v in z:
            u = scale * mp.mpf(v) - r + w if v != -math.inf else mp.mpf(-1)
            q.append(u ** (1 / (a - 1)) if u > 0 else mp.mpf(0))
        total = mp.fsum(q)
        return [v / total for v in q]


def mp_plain(z: list, alpha: float, kind: str, dps: int) -> list[float]:
    """The map of one row by bisection on tau in [max(y) - 1, max(y)] at ``dps`` digits."""
    with mp.workdps(dps):
        a = mp.mpf(alpha)
        scale = a - 1 if kind == "entmax" else mp.mpf(1)
        power = 1 / (a - 1) if kind == "entmax" else a / (a - 1)
        y = [scale * mp.mpf(v) if v != -math.inf else None for v in z]
        top = max(v for v in y if v is not None)
        lo, hi = top - 1, top
        for _ in range(int(dps * 3.33) + 20):
            mid = (lo + hi) / 2
            if mp.fsum((v - mid) ** power for v in y if v is not None and v > mid) >= 1:
                lo = mid
            else:
                hi = mid
        q = [(v - lo) ** (1 / (a - 1)) if v is not None and v > lo else mp.mpf(0) for v in y]
        total = mp.fsum(q)
        return [float(v / total) for v in q]


def offset_reference(z: torch.Tensor, alpha: float, kind: str, iters: int = 80) -> torch.Tensor:
    """The map of every row of ``z`` (rows, n) in float64, in offset form (see above)."""
    z = z.double()
    scale, power, c = _constants(alpha, kind)
    n = z.shape[-1]
    zs = z.sort(-1, descending=True).values

    def in_support(k: torch.Tensor) -> torch.Tensor:  # k 1-based, (rows, 1)
        zk = zs.gather(-1, k - 1)
        d = scale * (zs - zk)
        f = torch.where(d > 0, d.clamp_min(0) ** power, 0).sum(-1, keepdim=True)
        return (f < 1) & (zk > -math.inf)

    lo = torch.ones(z.shape[0], 1, dtype=torch.long)  # the support size, by binary search
    hi = torch.full_like(lo, n)
    for _ in range(math.ceil(math.log2(n)) + 1):
        mid = (lo + hi + 1) // 2
        ok = in_support(mid)
        lo, hi = torch.where(ok & (lo < hi), mid, lo), torch.where(~ok & (lo < hi), mid - 1, hi)
    zr = zs.gather(-1, lo - 1)
    znext = torch.where(lo < n, zs.gather(-1, lo.clamp(max=n - 1)), -math.inf)
    w_hi = torch.minimum(scale * (zr - znext), 1 + scale * (zr - zs[:, :1]))
    top = zs[:, : int(lo.max())]  # the support: the first lo sorted scores of each row
    dt = scale * (top - zr)
    above = (dt > 0) & (torch.arange(top.shape[-1]) < lo)
    da = torch.where(above, dt, 0)
    ties = ((dt == 0) & (torch.arange(top.shape[-1]) < lo)).sum(-1, keepdim=True).double()
    xl, xh = torch.zeros_like(w_hi), w_hi ** (1 / c)
    for _ in range(iters):
        x = (xl + xh) / 2
        g = torch.where(above, (da + x**c) ** power, 0).sum(-1, keepdim=True)
        big = g + ties * x ** (c * power) >= 1
        xl, xh = torch.where(big, xl, x), torch.where(big, x, xh)
    x = (xl + xh) / 2
    beta = 1 / (alpha - 1)
    d = scale * (z - zr)
    q = torch.where(d > 0, (d.clamp_min(0) + x**c) ** beta, torch.where(d == 0, x ** (c * beta), 0))
    return q / q.sum(-1, keepdim=True)


def sample(kind: str, alpha: float, rows: int, n: int, seed: int) -> torch.Tensor:
    """Scores whose supports hold 1 to n experts: entmax sees (alpha - 1) z, so its
    scores are scaled by 1/(alpha - 1); spreads 0.3, 1 and 3 in turn."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, n, generator=g, dtype=torch.float64)
    spread = torch.tensor([0.3, 1.0, 3.0], dtype=torch.float64).repeat(rows)[:rows, None]
    return z * spread / (alpha - 1 if kind == "entmax" else 1.0)


@functools.cache
def mp_case(kind: str, alpha: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 12 scores in ``dtype`` and their map by ``mp_offset`` (float64).
    In the last, two scores lead the rest by the map's threshold; for entmax the
    runner-up's weight is 0.03 (y_2 - tau = 0.03^(alpha - 1): 2e-75 at alpha = 50)."""
    z = sample(kind, alpha, 4, 12, seed=int(alpha * 100))
    a = alpha - 1
    lead, gap = (1 / a, (0.97**a - 0.03**a) / a) if kind == "entmax" else (1.0, 0.5)
    z[-1, :2] = torch.tensor([z[-1].max() + lead, z[-1].max() + lead - gap])
    z = z.to(dtype)
    ref = [[float(v) for v in mp_offset(row.double().tolist(), alpha, kind)] for row in z]
    return z, torch.tensor(ref, dtype=torch.float64)


# ---- the references ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "alpha"),
    [
        *[("entmax", a) for a in (1.01, 1.3, 3.0, 10.0, 50.0)],
        *[("normmax", a) for a in (1.3, 4.0, 50.0)],
    ],
)
def test_mp_offset_matches_plain_bisection(kind: str, alpha: float) -> None:
    for row in sample(kind, alpha, 3, 8, seed=1).tolist():
        p = [float(v) for v in mp_offset(row, alpha, kind)]
        smallest = min(v for v in p if v > 0)
        # tau to 30 digits below the smallest (y - tau) of the support
        dps = 30 + math.ceil((alpha - 1) * -math.log10(smallest))
        assert dps < 400
        expected = mp_plain(row, alpha, kind, dps)
        assert max(abs(a - b) for a, b in zip(p, expected, strict=True)) < 1e-15


@pytest.mark.parametrize("kind", ["entmax", "normmax"])
@pytest.mark.parametrize("alpha", [1.01, 1.3, 3.0, 10.0, 50.0, 100.0])
def test_offset_reference_matches_mp(kind: str, alpha: float) -> None:
    z = sample(kind, alpha, 4, 12, seed=2)
    z[0, 3] = -math.inf
    z[1, 5] = z[1].max()  # a tie at the top
    expected = [[float(v) for v in mp_offset(row, alpha, kind)] for row in z.tolist()]
    got = offset_reference(z, alpha, kind)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-13)


# ---- the maps ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("kind", ["entmax", "normmax"])
def test_matches_mpmath(kind: str, alpha: float, dtype: torch.dtype, backend: str) -> None:
    # before: entmax off by 1e-2 at alpha = 10, 0.3 at 50, 0.4 at 100 (float64)
    z, expected = mp_case(kind, alpha, dtype)
    methods = ["auto", "iterative"] if (kind, alpha) in {("entmax", 1.5), ("entmax", 2.0)} else []
    methods += ["iterative"] if (kind, alpha) == ("normmax", 2.0) else []
    for method in methods or ["auto"]:
        p = getattr(maps, kind)(z, alpha, method=method)
        assert p.dtype == dtype
        torch.testing.assert_close(p.double(), expected, rtol=0, atol=TOL[dtype])


def issue_batch() -> tuple[torch.Tensor, int]:
    """randn(64, 32) * 3 with row 17 replaced by the reported row: top scores
    5.5393, 5.5337, 5.2446, 5.0732 (to 4 digits; the first two 0.0055294 apart,
    within that rounding, so that the exact answer is the reported 0.9737, 0.0263)
    and 28 lower ones."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 32, generator=g, dtype=torch.float64) * 3
    lower = torch.rand(28, generator=g, dtype=torch.float64) * 9 - 4  # in [-4, 5)
    row = torch.cat([torch.tensor([5.53927, 5.53927 - 0.0055294, 5.2446, 5.0732]), lower])
    z[17] = row[torch.randperm(32, generator=g)]
    return z, 17


def test_alpha50_reported_row(backend: str) -> None:
    z, r = issue_batch()
    exact = mp_plain(z[r].tolist(), 50.0, "entmax", dps=150)  # y_2 - tau = 3e-78
    top2 = sorted(exact, reverse=True)[:2]
    assert abs(top2[0] - 0.9737) < 5e-5 and abs(top2[1] - 0.0263) < 5e-5
    p = maps.entmax(z, 50.0)  # with the threshold as one float: [0.66, 0.34]
    torch.testing.assert_close(p[r], torch.tensor(exact, dtype=torch.float64), rtol=0, atol=1e-12)
    p32 = maps.entmax(z.float(), 50.0)[r].double()
    exact32 = mp_plain(z[r].float().double().tolist(), 50.0, "entmax", dps=150)
    torch.testing.assert_close(p32, torch.tensor(exact32, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "alpha"),
    [*[("entmax", a) for a in (1.3, 3.0, 10.0, 50.0)], *[("normmax", a) for a in (1.3, 4.0, 30.0)]],
)
def test_row_does_not_depend_on_the_batch(kind: str, alpha: float) -> None:
    # before: a row alone and the same row among others differed by up to 3e-3
    # (entmax, alpha = 10): the solver iterated until every row of the batch was done
    z = torch.cat([sample(kind, alpha, 48, 32, seed=4), issue_batch()[0][:16] * 3 / alpha])
    fn = getattr(maps, kind)
    together = fn(z, alpha)
    alone = torch.cat([fn(z[i : i + 1], alpha) for i in range(z.shape[0])])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("kind", "alpha"), [("normmax", 4.0), ("normmax", 1.3), ("entmax", 10.0)])
def test_float32_with_many_experts(kind: str, alpha: float) -> None:
    # before: normmax, alpha = 4, float32, 16384 experts: off by 1e-3 (its
    # tolerance was 4 n eps = 8e-3 on f, n the row length)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 16384, generator=g) * 3 / (alpha - 1 if kind == "entmax" else 1.0)
    p = getattr(maps, kind)(z, alpha)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p.double(), offset_reference(z, alpha, kind), rtol=0, atol=1e-5)


def test_frame_solver_compiles_with_its_fixed_bounds() -> None:
    # torch.compile: every loop runs its bound (two frames), no host read; with
    # these bounds one row's first frame is not in its support and moves up
    z = sample("entmax", 10.0, 6, 8, seed=7)
    z[2, :2] = z[2].max()  # ties at the top
    solve = functools.partial(entmax_offset_weights, alpha=10.0, max_iter=4, bracket_iter=10)
    torch._dynamo.reset()
    compiled = torch.compile(solve, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(z), solve(z), rtol=0, atol=1e-15)


@pytest.mark.parametrize("move", ["up", "down"])
def test_frame_moves_to_the_smallest_score_in_the_support(move: str) -> None:
    # a frame whose score is not in the support (up), or above a score that is
    # (down): Newton stops at the segment's end, and the next frame has the root
    alpha, a = 3.0, 2.0
    z = torch.tensor([[0.0, -0.02, -0.05, -0.3, -1.0]], dtype=torch.float64)
    expected = offset_reference(z, alpha, "entmax")
    assert (expected > 0).sum() == 3  # the smallest score in the support is -0.05
    zr = torch.tensor([[-0.3 if move == "up" else -0.02]], dtype=torch.float64)
    zmax, start = z.amax(-1, keepdim=True), torch.tensor([[0.5]], dtype=torch.float64)
    x, up, down, zb, done = _frame_solve(z, zmax, zr, start, None, a, 50)
    assert (bool(up), bool(down)) == (move == "up", move == "down")
    zr, start = _next_frame(z, zr, x, up, down, zb)
    assert float(zr) == -0.05
    x, up, down, _, done = _frame_solve(z, zmax, zr, start, None, a, 50)
    assert not (bool(up) or bool(down)) and bool(done)  # converged in the right frame
    q = (torch.where(z > zr, a * (z - zr) + x**a, 0) ** (1 / a)).where(z != zr, x)
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-15)


def test_entmax_gradient_at_large_alpha(backend: str) -> None:
    # J^T g = s (g - <s, g>/sum s), s = p^(2 - alpha): s = 1e76 at the runner-up
    # of the reported row, where the plain formula cancels (it gave 0, not -5.39)
    z, r = issue_batch()
    row = z[r : r + 1].clone().requires_grad_(True)
    g = torch.linspace(-1, 1, 32, dtype=torch.float64)[None]
    (maps.entmax(row, 50.0) * g).sum().backward()
    assert row.grad is not None
    # d<g, p>/dz_j by central differences of the mpmath map (h = 1e-30, 80 digits)
    with mp.workdps(80):
        h = mp.mpf("1e-30")
        base = [mp.mpf(v) for v in z[r].tolist()]
        gs = [mp.mpf(v) for v in g[0].tolist()]

        def value(j: int, step: mp.mpf) -> mp.mpf:
            zz = list(base)
            zz[j] += step
            p = mp_offset(zz, 50.0, "entmax", 80, 300)
            return mp.fsum(a * b for a, b in zip(gs, p, strict=True))

        support = [j for j in range(32) if float(base[j]) > 5.5]
        expected = torch.zeros(32, dtype=torch.float64)
        for j in support:
            expected[j] = float((value(j, h) - value(j, -h)) / (2 * h))
    torch.testing.assert_close(row.grad[0], expected, rtol=1e-9, atol=1e-9)
    assert abs(float(expected[support].sum())) < 1e-9 and float(expected.abs().max()) > 1


# ---- scores at the ends of the float range, and rows at the threshold ---------------


@pytest.mark.parametrize("alpha", [50.0, 100.0])
@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e-36])
def test_subnormal_float32_scores(scale: float, alpha: float, backend: str) -> None:
    # before (torch path): NaN rows, without an error, for 205 of 300 rows at 1e-40
    # and alpha = 50 (a slope of inf * 0 when scores lie within 1e-38 of the frame),
    # and after that, errors of 1.8e-5 at 1e-45 (w = x^(alpha - 1) subnormal in float32)
    g = torch.Generator().manual_seed(int(alpha))
    z = (torch.randn(300, 9, generator=g, dtype=torch.float64) * scale).float()
    p = maps.entmax(z, alpha)
    assert bool(torch.isfinite(p).all())
    torch.testing.assert_close(
        p.double().sum(-1), torch.ones(300, dtype=torch.float64), rtol=0, atol=1e-6
    )
    expected = [
        [float(v) for v in mp_offset(row.double().tolist(), alpha, "entmax", 80, 300)]
        for row in z[:8]
    ]
    torch.testing.assert_close(
        p[:8].double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=TOL[torch.float32]
    )


@pytest.mark.parametrize("kind", ["entmax", "normmax"])
def test_subnormal_float64_scores(kind: str, backend: str) -> None:
    g = torch.Generator().manual_seed(1)
    z = (
        torch.randn(6, 9, generator=g, dtype=torch.float64)
        * torch.tensor([1e-320, 1e-310, 1e-300]).repeat(2)[:, None]
    )
    for alpha in (3.0, 50.0):
        p = getattr(maps, kind)(z, alpha)
        expected = [[float(v) for v in mp_offset(row.tolist(), alpha, kind, 80, 300)] for row in z]
        torch.testing.assert_close(
            p, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=TOL[torch.float64]
        )


def threshold_rows(kind: str, alpha: float) -> torch.Tensor:
    """Rows whose runner-up lies k half-ulps inside the map's threshold (k = 0, 1, 2,
    5, 1000, 10^6), alone above -5 or tied with a third score among random others."""
    thr = 1.0 if kind == "normmax" else 1 / (alpha - 1)
    g = torch.Generator().manual_seed(9)
    rows = []
    for k in (0, 1, 2, 5, 1000, 10**6):
        second = -thr + k * math.ulp(thr) / 2
        rows.append([0.0, second] + [-5.0] * 4)
        rest = (torch.rand(4, generator=g, dtype=torch.float64) * -2 * thr).tolist()
        rows.append([0.0, second, second, *rest[:3]])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("alpha", [3.0, 10.0, 50.0, 100.0])
@pytest.mark.parametrize("kind", ["normmax", "entmax"])
def test_runner_up_at_the_threshold(kind: str, alpha: float, backend: str) -> None:
    # before: normmax [[0, -0.9999999999999999]] gave 0.320880 for the runner-up at
    # alpha = 50, exact 0.319201 (2.7e-5 off at alpha = 10), both backends: the top's
    # (1 - h + w)^P rounded away the w ~ h that decides G; with a tie at the
    # runner-up, alpha = 100 gave a one-hot row for [0.42, 0.29, 0.29] (torch path)
    z = threshold_rows(kind, alpha)
    expected = [[float(v) for v in mp_offset(row.tolist(), alpha, kind, 120, 500)] for row in z]
    p = getattr(maps, kind)(z, alpha)
    torch.testing.assert_close(
        p, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=TOL[torch.float64]
    )


def test_normmax_reported_row(backend: str) -> None:
    z = torch.tensor([[0.0, -0.9999999999999999]], dtype=torch.float64)
    p = maps.normmax(z, 50.0)
    assert abs(float(p[0, 1]) - 0.319201) < 1e-6
    exact = [float(v) for v in mp_offset(z[0].tolist(), 50.0, "normmax", 120, 500)]
    torch.testing.assert_close(p[0], torch.tensor(exact, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("alpha", [1.0001, 1 + 1e-6, 1 + 1e-10])
@pytest.mark.parametrize("kind", ["entmax", "normmax"])
def test_alpha_near_one(kind: str, alpha: float, dtype: torch.dtype, backend: str) -> None:
    # before: entmax at alpha = 1.0001 was 4e-5 off in float32 on the torch path
    # (1e-2 at 1 + 1e-6), and float64 7e-10 off at 1 + 1e-8 (7e-8 at 1 + 1e-10) on
    # both: (y - tau)^(1/(alpha - 1)) magnified the rounding of y - tau near 1.
    # Scores where the maps are far from one-hot: entmax -> softmax as alpha -> 1,
    # normmax -> argmax, so normmax's scores are spread on the scale alpha - 1
    g = torch.Generator().manual_seed(11)
    spread = 2.0 if kind == "entmax" else 3 * (alpha - 1)
    z = (torch.randn(6, 12, generator=g, dtype=torch.float64) * spread).to(dtype)
    expected = [
        [float(v) for v in mp_offset(row.double().tolist(), alpha, kind, 60, 300)] for row in z
    ]
    p = getattr(maps, kind)(z, alpha)
    assert p.dtype == dtype
    torch.testing.assert_close(
        p.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=TOL[dtype]
    )
