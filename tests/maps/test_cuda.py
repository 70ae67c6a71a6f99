"""The maps on CUDA: every map on the GPU against the CPU in float64, their constraints
at extreme scales, second-order gradients and torch.compile. Skipped where no GPU is
present (CI); run on a GPU machine with ``pytest tests/maps/test_cuda.py
tests/moe/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradgradcheck

from moelab import maps

from .conftest import ALL, SPARSE, MapSpec
from .test_gradients import general_position

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def _scores(rows: int, n: int, seed: int, masked: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, n, generator=g, dtype=torch.float64) * 2
    if masked:
        z[::3, 1] = -torch.inf  # a masked expert in every third row
    return z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("spec", ALL, ids=str)
def test_map_on_gpu_matches_cpu_float64(spec: MapSpec, dtype: torch.dtype) -> None:
    z64 = _scores(257, 16, seed=3)
    g64 = torch.randn(z64.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    a = z64.clone().requires_grad_(True)
    p_ref = spec.fn(a)
    (grad_ref,) = torch.autograd.grad(p_ref, a, g64)
    b = z64.to(CUDA, dtype).requires_grad_(True)
    p = spec.fn(b)
    (grad,) = torch.autograd.grad(p, b, g64.to(CUDA, dtype))
    assert p.dtype == dtype and p.device.type == "cuda"
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(p.double().cpu(), p_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad.double().cpu(), grad_ref, atol=10 * tol, rtol=10 * tol)
    # masked experts get exactly zero weight on the GPU too
    assert bool((p[::3, 1] == 0).all())


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_map_half_precision_on_gpu(spec: MapSpec) -> None:
    z = _scores(64, 8, seed=5)
    p = spec.fn(z.to(CUDA, torch.bfloat16))
    assert p.dtype == torch.bfloat16
    ref = spec.fn(z.to(torch.bfloat16).double())  # the same rounded scores, mapped exactly
    torch.testing.assert_close(p.double().cpu(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, 1e5])
@pytest.mark.parametrize("spec", ALL, ids=str)
def test_constraints_at_extreme_scales_on_gpu(spec: MapSpec, scale: float) -> None:
    z = (_scores(512, 16, seed=6, masked=False) * scale).to(CUDA, torch.float32)
    p = spec.fn(z).double()
    assert bool(torch.isfinite(p).all())
    assert bool((p >= 0).all())
    if spec.name not in ("relu", "sqrtsoftplus"):  # the maps without an upper bound
        assert bool((p <= 1).all())
    if spec.kind == "simplex":
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p[:, 0]), atol=1e-5, rtol=0)
    if spec.kind == "topk":
        torch.testing.assert_close(p.sum(-1), torch.full_like(p[:, 0], spec.k), atol=1e-4, rtol=0)


def test_lapsum_far_apart_scores_on_gpu() -> None:
    # the temperature far below the scores' float spacing: the definition still holds
    z = torch.tensor([[1e30, -1e30, 1.0, 0.0]], dtype=torch.float64, device=CUDA)
    torch.testing.assert_close(
        maps.lapsum(z, 2.0, 1.0).cpu(),
        torch.tensor([[1.0, 0.0, 0.6967, 0.3033]], dtype=torch.float64),
        atol=1e-4,
        rtol=0,
    )
    z = torch.tensor([[100.0, 99.0, 98.0, 0.0]], device=CUDA)
    torch.testing.assert_close(
        maps.lapsum(z, 2.5, 2e-6).cpu(), torch.tensor([[1.0, 1.0, 0.5, 0.0]]), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_gradgradcheck_on_gpu(spec: MapSpec) -> None:
    z = general_position(3, 6, seed=21).detach().to(CUDA).requires_grad_(True)
    assert gradgradcheck(spec.fn, (z,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", [s for s in SPARSE if s.name in ("sparsemax", "entmax1.5")])
def test_compiled_map_on_gpu(spec: MapSpec) -> None:
    z = _scores(128, 16, seed=7).to(CUDA, torch.float32).requires_grad_(True)
    fn = torch.compile(lambda x: spec.fn(x), backend="inductor")
    p = fn(z)
    (grad,) = torch.autograd.grad(p, z, torch.ones_like(p).cumsum(-1))
    z2 = z.detach().clone().requires_grad_(True)
    p2 = spec.fn(z2)
    (grad2,) = torch.autograd.grad(p2, z2, torch.ones_like(p2).cumsum(-1))
    torch.testing.assert_close(p, p2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, grad2, atol=1e-5, rtol=1e-5)
