"""Numerics at the edges: LapSum with a temperature far below the scores' spacing,
every map at extreme scales (outputs keep their defining constraints), and the
iterative solvers at large alpha in float32, each against an independent reference."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab import maps

from .conftest import ALL, MapSpec
from .test_lapsum import lapsum_bisection
from .test_large_alpha import offset_reference


def laplace_cdf(y: float) -> float:
    return 0.5 * math.exp(y) if y <= 0 else 1 - 0.5 * math.exp(-y)


# ---- LapSum at tiny temperature -------------------------------------------


def test_lapsum_scores_far_apart_in_float64(backend: str) -> None:
    # 1e30 and -1e30 are 0/1; the threshold sits between 1 and 0 at x = 0.5
    # (F(0.5) + F(-0.5) = 1).
    z = torch.tensor([[1e30, -1e30, 1.0, 0.0]], dtype=torch.float64)
    p = maps.lapsum(z, 2.0, 1.0)
    expected = torch.tensor([[1.0, 0.0, laplace_cdf(0.5), laplace_cdf(-0.5)]], dtype=torch.float64)
    torch.testing.assert_close(p, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lapsum_temperature_below_the_score_spacing(dtype: torch.dtype, backend: str) -> None:
    # t = 2e-6 is below float32's spacing at 100 (7.6e-6): the 3rd score is the
    # threshold (p = 1/2), the gaps of 1 are 5e5 temperatures: exactly 1 and 0.
    z = torch.tensor([[100.0, 99.0, 98.0, 0.0]], dtype=dtype)
    p = maps.lapsum(z, 2.5, 2e-6)
    torch.testing.assert_close(p, torch.tensor([[1.0, 1.0, 0.5, 0.0]], dtype=dtype))


def test_lapsum_float32_scores_near_1e5(backend: str) -> None:
    # float32 spacing at 1e5 is 7.8e-3 = 7.8 temperatures: the threshold must not
    # be rounded to a representable score. Reference: float64 bisection on the
    # same (float32) scores.
    g = torch.Generator().manual_seed(0)
    z = (1e5 + torch.randn(64, 8, generator=g, dtype=torch.float64) * 0.05).float()
    for k in (1.0, 2.5, 6.0):
        p = maps.lapsum(z, k, 1e-3)
        torch.testing.assert_close(p.sum(-1), torch.full((64,), k), rtol=0, atol=2e-5 * k)
        expected = lapsum_bisection(z.double(), k, 1e-3)
        torch.testing.assert_close(p.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lapsum_subnormal_temperature(dtype: torch.dtype, backend: str) -> None:
    # 1/t overflows: still hard top-k, and the tie at the threshold shares k
    t = torch.finfo(dtype).tiny / 64
    z = torch.tensor([[3.0, 1.0, 1.0, -2.0]], dtype=dtype)
    p = maps.lapsum(z, 2.0, t)
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.5, 0.5, 0.0]], dtype=dtype))


# ---- every map at extreme scales -------------------------------------------


@st.composite
def extreme_rows(draw, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose magnitudes range over 10^lo..10^hi (lo, hi drawn from the
    dtype's range), with ties, mixed signs and masked (-inf) entries, leaving
    at least two finite scores per row."""
    rows, n = draw(st.integers(1, 3)), draw(st.integers(2, 10))
    top = 35 if dtype == torch.float32 else 300
    lo = draw(st.integers(-top, top))
    hi = draw(st.integers(lo, top))
    mant = draw(hnp.arrays("float64", (rows, n), elements=st.floats(-1, 1, width=64)))
    expo = draw(hnp.arrays("int64", (rows, n), elements=st.integers(lo, hi)))
    z = mant * np.power(10.0, expo)
    masked = draw(hnp.arrays("bool", (rows, n)))
    masked[:, :2] = False  # two finite scores per row
    z[masked] = -np.inf
    perm = draw(st.permutations(range(n)))
    return torch.from_numpy(z[:, list(perm)]).to(dtype)


def check_constraints(kind: str, p: torch.Tensor, k: torch.Tensor | None, name: str) -> None:
    eps = torch.finfo(p.dtype).eps
    assert torch.isfinite(p).all(), f"{name}: non-finite output {p}"
    assert (p >= 0).all(), f"{name}: negative output {p}"
    if kind == "elementwise":
        return
    assert (p <= 1).all(), f"{name}: output above 1 {p}"
    total = p.double().sum(-1)
    target = torch.ones_like(total) if k is None else k.double()
    tol = 64 * eps * target.clamp_min(1)
    assert ((total - target).abs() <= tol).all(), f"{name}: sums {total} != {target}"


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", [s for s in ALL if s.kind != "topk"], ids=str)
@given(data=st.data())
def test_maps_keep_their_constraints_at_extreme_scales(
    spec: MapSpec, dtype: torch.dtype, data, backend: str
) -> None:
    z = data.draw(extreme_rows(dtype))
    # relu and sqrtsoftplus are unbounded above: finite and non-negative only
    kind = "elementwise" if spec.name in ("relu", "sqrtsoftplus") else spec.kind
    if spec.name == "sigmoid":
        kind = "range"
    p = spec.fn(z)
    assert p.shape == z.shape and p.dtype == z.dtype
    if kind == "range":
        assert torch.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()
    else:
        check_constraints(kind, p, None, spec.name)


@settings(max_examples=60, deadline=None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(data=st.data())
def test_lapsum_sums_to_k_at_extreme_scales(dtype: torch.dtype, data, backend: str) -> None:
    z = data.draw(extreme_rows(dtype))
    low, top = (-44, 37) if dtype == torch.float32 else (-300, 300)  # subnormal t too
    t = 10.0 ** data.draw(st.floats(low, top))
    finite = torch.isfinite(z).sum(-1).to(dtype)
    if data.draw(st.booleans()):  # integer k, 1 .. finite - 1
        frac = data.draw(st.floats(0, 1))
        k = torch.floor(1 + frac * (finite - 1.0)).clamp(max=finite - 1)
    else:
        frac = data.draw(st.floats(1e-3, 1 - 1e-3))
        k = frac * finite
    p = maps.lapsum(z, k, temperature=t)
    check_constraints("topk", p, k, f"lapsum(t={t:g})")


# ---- large alpha in float32 ------------------------------------------------


@pytest.mark.parametrize(
    ("which", "alpha"),
    [("entmax", 3.0), ("entmax", 5.0), ("entmax", 10.0), ("normmax", 6.0), ("normmax", 20.0)],
)
def test_large_alpha_float32_matches_float64_reference(which: str, alpha: float) -> None:
    # float32 solves used to be off by 3e-5 (entmax, alpha 3) to 0.12 (entmax, alpha 10).
    # The reference holds the threshold as an offset from a score in the support: a
    # float64 bisection on tau itself is off by up to 4e-5 here (entmax, alpha 5),
    # where tau lies within rounding of a score (test_large_alpha.py).
    z = torch.randn(20000, 8, generator=torch.Generator().manual_seed(3))
    p = getattr(maps, which)(z, alpha)
    assert p.dtype == torch.float32
    expected = offset_reference(z, alpha, which)
    torch.testing.assert_close(p.double(), expected, rtol=0, atol=1e-5)
