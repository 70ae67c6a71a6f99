"""The fused CPU kernels of alpha-entmax and alpha-normmax for general alpha
(``entmax_forward``/``_backward``, ``normmax_forward``/``_backward`` in
csrc/maps_cpu.cpp) against the PyTorch solvers in float64 (the slow reference),
forward and backward: -inf masks, ties, large gaps, the threshold law, gradcheck,
the per-row status errors, and the MOELAB_KERNELS=0 / torch-backend fallback."""

from __future__ import annotations

import pytest
import torch

from moelab import maps
from moelab.maps import _kernels

pytestmark = pytest.mark.skipif(
    maps.backend() != "cpu-kernels", reason="the CPU kernels are not built on this machine"
)

ALPHAS = [1.1, 1.25, 1.3, 1.7, 2.5, 3.0, 4.0, 8.0, 20.0]
EXPERTS = [1, 2, 8, 64, 128]
KINDS = ["entmax", "normmax"]


def _map(kind: str, z: torch.Tensor, alpha: float) -> torch.Tensor:
    return getattr(maps, kind)(z, alpha, method="iterative")


def _reference(kind: str, z: torch.Tensor, alpha: float) -> torch.Tensor:
    with maps.use_backend("torch"):
        return _map(kind, z.double(), alpha)


def _scores(rows: int, e: int, seed: int) -> torch.Tensor:
    """Random scores with -inf masks, exact ties and wide gaps mixed in."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, e, generator=g, dtype=torch.float64) * 2
    if e > 1:
        z[::5, -1] = -torch.inf  # a masked expert
        z[1::5, 1] = z[1::5, 0]  # a tie with another score
        z[2::5, 0] += 10.0  # a winner far ahead: one-hot
        z[3::5, : e // 2] = 0.5  # a block of ties
    return z


def _kernel_was_used(kind: str, z: torch.Tensor, alpha: float) -> bool:
    """The kernel op itself gives what the map gives (the map takes the kernel)."""
    p, status = getattr(torch.ops.moelab_maps, f"{kind}_forward")(z, alpha)
    return bool((status == 0).all()) and torch.equal(p, _map(kind, z, alpha))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("e", EXPERTS)
def test_kernel_matches_float64_reference(kind: str, alpha: float, e: int) -> None:
    z = _scores(40, e, seed=e)
    assert _kernel_was_used(kind, z, alpha)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype)
    zk = z.clone().requires_grad_()
    p = _map(kind, zk, alpha)
    p.backward(g)
    zr = z.clone().requires_grad_()
    with maps.use_backend("torch"):
        want = _map(kind, zr, alpha)
        want.backward(g)
    torch.testing.assert_close(p, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(zk.grad, zr.grad, rtol=0, atol=1e-9)
    assert torch.equal(p == 0, want == 0)  # the same support
    # float32 scores: computed in double inside, against float64 on the same scores
    z32 = z.float()
    torch.testing.assert_close(
        _map(kind, z32, alpha).double(), _reference(kind, z32, alpha), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_threshold_law(kind: str, alpha: float) -> None:
    # runner-up exactly 0 iff the top-2 gap reaches the threshold
    thr = 1.0 if kind == "normmax" else 1.0 / (alpha - 1)
    gaps = torch.tensor([0.5, 0.9, 0.999, 1.0, 1.001, 1.5, 4.0], dtype=torch.float64) * thr
    z = torch.stack([torch.zeros_like(gaps), -gaps, torch.full_like(gaps, -50.0)], -1)
    p = _map(kind, z, alpha)
    assert torch.equal(p[:, 1] == 0, gaps >= thr)
    assert bool((p[gaps >= thr, 0] == 1).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", [1.3, 3.0])
def test_gradcheck(kind: str, alpha: float) -> None:
    z = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    z = z.requires_grad_()
    assert torch.autograd.gradcheck(lambda v: _map(kind, v, alpha), (z,))


@pytest.mark.parametrize("kind", KINDS)
def test_status_errors(kind: str) -> None:
    z = torch.zeros(3, 4)
    z[1, 2] = torch.nan
    with pytest.raises(ValueError, match="NaN"):
        _map(kind, z, 1.3)
    z = torch.zeros(3, 4)
    z[2] = -torch.inf
    with pytest.raises(ValueError, match="masked"):
        _map(kind, z, 3.0)
    p, status = getattr(torch.ops.moelab_maps, f"{kind}_forward")(z, 3.0)
    assert status.tolist() == [0, 0, 2] and bool((p[2] == 0).all())


@pytest.mark.parametrize("kind", KINDS)
def test_torch_backend_and_fake(kind: str) -> None:
    z = _scores(6, 8, seed=4)
    with maps.use_backend("torch"):
        assert not _kernels.use_kernels(z)
    torch.library.opcheck(getattr(torch.ops.moelab_maps_opaque, f"{kind}_forward"), (z, 1.7))
    p = _map(kind, z, 1.7)
    g = torch.randn_like(z)
    torch.library.opcheck(getattr(torch.ops.moelab_maps_opaque, f"{kind}_backward"), (p, g, 1.7))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", [1.01, 1.3, 1.99, 2.01, 3.0])
@pytest.mark.parametrize("e", [3, 9, 33, 257, 2048])
@pytest.mark.parametrize("scale", [0.01, 1.0, 50.0])
def test_odd_and_wide_rows(kind: str, alpha: float, e: int, scale: float) -> None:
    # widths that are not a multiple of the kernel's vector padding (8), and wide rows,
    # at nearly uniform, ordinary and widely spread scores (a few candidates or all)
    g = torch.Generator().manual_seed(e)
    z = torch.randn(24, e, generator=g, dtype=torch.float64) * scale
    z[::7, 0] = z[::7, 1]
    z[::5, -1] = -torch.inf
    assert _kernel_was_used(kind, z, alpha)
    up = torch.randn(z.shape, generator=g, dtype=z.dtype)
    zk, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    _map(kind, zk, alpha).backward(up)
    with maps.use_backend("torch"):
        want = _map(kind, zr, alpha)
        want.backward(up)
    torch.testing.assert_close(_map(kind, z, alpha), want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(zk.grad, zr.grad, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    ("kind", "alpha"),
    [("entmax", a) for a in (1.01, 1.3, 1.7, 2.0, 2.5)]
    + [("normmax", a) for a in (1.1, 1.5, 2.0, 3.0, 4.0, 6.0)],
)
@pytest.mark.parametrize("e", [3, 16, 128, 1000])
def test_float32_backward_against_double(kind: str, alpha: float, e: int) -> None:
    # float32 gradients take their powers in float (pow_unit_f): entmax with
    # alpha <= 2 its t^(2 - alpha), bases below 1e-30 the double power; normmax with
    # alpha <= 4 its p^alpha, p below exp(-80 / alpha) the double formula's std::pow.
    # The same p and g through the double backward are the reference; the float
    # powers add about a float rounding of the gradient's scale.
    g = torch.Generator().manual_seed(e)
    z = torch.randn(48, e, generator=g) * 2
    z[::5, -1] = -torch.inf
    z[1::6] *= 1e4  # nearly one-hot
    z[2::6] *= 0.01  # nearly flat
    z[3::6, 1:] -= 60.0  # a tail of tiny weights
    forward = getattr(torch.ops.moelab_maps, f"{kind}_forward")
    backward = getattr(torch.ops.moelab_maps, f"{kind}_backward")
    p, status = forward(z, alpha)
    assert bool((status == 0).all())
    tiny = e > 1 and ((kind == "entmax" and alpha < 2.0) or (kind == "normmax" and alpha <= 4.0))
    if tiny:
        # weights below the float powers' floor, which take the double power
        # (normmax with alpha > 2 weights a small p by p^(2 - alpha): 1e-14, not
        # smaller, keeps its gradient inside float's range)
        small = 1e-35 if kind == "entmax" else (1e-30 if alpha <= 2.0 else 1e-14)
        p[4::6, 1] = p[4::6].max(-1).values * small
    up = torch.randn(z.shape, generator=g)
    got = backward(p, up, alpha).double()
    want = backward(p.double(), up.double(), alpha)
    # per row: normmax with alpha > 2 gives a small p a large gradient
    scale = torch.maximum(up.abs().amax(-1), want.abs().amax(-1)).double()
    assert bool(((got - want).abs() <= 2e-6 * scale[:, None]).all())
    assert bool((got[p == 0] == 0).all())  # off the support: exactly 0
    if tiny:  # the small weights' terms, far below atol, kept to a float rounding
        torch.testing.assert_close(got[4::6, 1], want[4::6, 1], rtol=1e-5, atol=0)
        assert int((want[4::6, 1] != 0).sum()) >= want[4::6, 1].numel() // 2
