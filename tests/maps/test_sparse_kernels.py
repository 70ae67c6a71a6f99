"""The fused kernels of sparsemax, 1.5-entmax and 2-normmax (``<map>_forward`` and
``_backward`` in csrc/maps_cpu.cpp) at every row width their code paths split on,
against the sort-based PyTorch solvers in float64 (the slow reference), forward and
backward.

The kernels take a row along the vector (whole vectors of the build's register width,
its half or quarter, and a scalar remainder) or blocks of a vector's lanes of rows
(16 / 8 rows in float32 / float64 with AVX-512, 8 / 4 with AVX2; transposed by squares,
with a scalar remainder), chosen by the row's width and the map; the backward goes
along the row (tests/maps/test_march.py runs this file on the AVX2 and SSE2 builds).
So the widths here straddle every vector and square size, and the row counts leave
partial blocks. Each batch mixes the awkward rows: -inf masks (in the vector part and
in the remainder), ties at the maximum, near-uniform rows, one-hot rows, runner-ups
exactly at the threshold, a NaN row, a +inf row and a fully masked row (status and
zeros, without touching their neighbours)."""

from __future__ import annotations

import pytest
import torch

from moelab import maps

pytestmark = pytest.mark.skipif(
    maps.backend() != "cpu-kernels", reason="the CPU kernels are not built on this machine"
)

WIDTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 47, 48, 63, 64, 65, 100, 128,
          129, 256, 300]
ROWS = 37  # two whole blocks of 16 rows and a partial one (four and a partial of 8)
MAPS = {
    "sparsemax": lambda z: maps.sparsemax(z),
    "entmax15": lambda z: maps.entmax(z, 1.5),
    "normmax2": lambda z: maps.normmax(z, 2.0),
}
# the gap of the runner-up at which its weight becomes exactly zero
THRESHOLD = {"sparsemax": 1.0, "entmax15": 2.0, "normmax2": 1.0}


def _scores(n: int, name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(ROWS, n, generator=g, dtype=torch.float64) * 2
    z[0] *= 0.01  # near-uniform
    z[1] = torch.round(z[1])  # ties
    if n > 1:
        z[2, n - 1] = z[2].max() + 30.0  # one-hot, its winner in the remainder
        z[3, :] = -THRESHOLD[name] - 1.0
        z[3, 0] = 0.0
        z[3, n - 1] = -THRESHOLD[name]  # runner-up exactly at the threshold: zero
        z[4, :] = -5.0
        z[4, 0] = 0.0
        z[4, n - 1] = -THRESHOLD[name] + 1e-6  # just inside: positive
        z[5::3, n - 1] = -torch.inf  # masked in the remainder
        z[6::3, 0] = -torch.inf  # masked in the vector part
    z[7] = z[7, 0]  # the whole row tied
    return z


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", WIDTHS)
def test_forward_and_backward_against_float64(name: str, dtype: torch.dtype, n: int) -> None:
    fn = MAPS[name]
    z64 = _scores(n, name, seed=n)
    z = z64.to(dtype)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    # the kernel op itself is what the map runs
    p_op, status = getattr(torch.ops.moelab_maps, f"{name}_forward")(z)
    assert bool((status == 0).all())
    x = z.clone().requires_grad_()
    p = fn(x)
    assert torch.equal(p.detach(), p_op)
    p.backward(g)
    # reference: the PyTorch solver in float64 on the same (rounded) scores
    with maps.use_backend("torch"):
        xr = z.double().requires_grad_()
        want = fn(xr)
        want.backward(g.double())
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(p.detach().double(), want.detach(), **tol)
    # float32 gradients: test_reference's tolerance, plus, on wide near-uniform rows,
    # the forward's float32 rounding of p ~ 1/n carried into sqrt(p) (1.5-entmax; the
    # kernels before this layout were off by 6.8e-6 at n = 256 there too)
    gtol = tol if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-6 + 2e-8 * n)
    torch.testing.assert_close(x.grad.double(), xr.grad, **gtol)
    assert torch.equal(p > 0, want > 0)  # the same support, exactly
    if n > 1:
        assert p[3, n - 1] == 0 and p[3, 0] == 1  # at the threshold: zero
        assert p[4, n - 1] > 0  # just inside it: not
        assert p[2, n - 1] == 1 and p[2, : n - 1].eq(0).all()
    if dtype == torch.float64:
        # (in float32 a row's sum is off by up to K eps / tau from the threshold's
        # rounding, in the kernels as in the reference: the comparison above covers it)
        ones = torch.ones(ROWS, dtype=torch.float64)
        torch.testing.assert_close(p.sum(-1).detach(), ones, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [5, 16, 17, 64, 100])
def test_bad_rows_report_status_and_leave_neighbours_alone(
    name: str, dtype: torch.dtype, n: int
) -> None:
    z = _scores(n, name, seed=100 + n).to(dtype)
    good, _ = getattr(torch.ops.moelab_maps, f"{name}_forward")(z)
    bad = z.clone()
    bad[9, n // 2] = float("nan")
    bad[10, n - 1] = float("inf")
    bad[11] = -torch.inf
    p, status = getattr(torch.ops.moelab_maps, f"{name}_forward")(bad)
    want = torch.zeros(ROWS, dtype=torch.int32)
    want[9], want[10], want[11] = 1, 1, 2
    assert torch.equal(status, want)
    assert p[9:12].eq(0).all()
    rest = torch.ones(ROWS, dtype=torch.bool)
    rest[9:12] = False
    assert torch.equal(p[rest], good[rest])
