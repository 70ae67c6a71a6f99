"""Second-order gradients (create_graph=True) of every map, on both backends,
against finite differences of the first gradient (float64 gradgradcheck)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradgradcheck

from moelab import maps

from .conftest import ALL, MapSpec
from .test_gradients import general_position


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_gradgradcheck(spec: MapSpec, backend: str) -> None:
    # general position: the sparse maps' outputs have zeros, but no score sits
    # near a support change (where the map is not twice differentiable)
    z = general_position(3, 6, seed=21)
    assert gradgradcheck(spec.fn, (z,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_gradgradcheck_with_masked_experts(spec: MapSpec, backend: str) -> None:
    z = general_position(4, 7, seed=5).detach()
    z[:, 2] = -torch.inf
    z.requires_grad_(True)
    assert gradgradcheck(spec.fn, (z,), eps=1e-6, atol=1e-6)


def test_lapsum_gradgradcheck_in_k_and_temperature(backend: str) -> None:
    z = general_position(4, 6, seed=8)
    k = torch.tensor([1.0, 2.5, 3.0, 0.4], dtype=torch.float64, requires_grad=True)
    t = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    assert gradgradcheck(
        lambda a, b, c: maps.lapsum(a, b, temperature=c), (z, k, t), eps=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    "fn",
    [lambda z: maps.entmax(z, 1.5), lambda z: maps.normmax(z, 2.0), lambda z: maps.lapsum(z, 2.5)],
    ids=["entmax1.5", "normmax2", "lapsum"],
)
def test_hessian_vector_product_agrees_across_backends(fn) -> None:
    # The fused kernels' forward with create_graph: the same second-order term
    # as the PyTorch path (a gradient penalty's gradient), not zero.
    z0 = general_position(5, 8, seed=13).detach()
    v = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = []
    for name in ("auto", "torch"):
        with maps.use_backend(name):
            z = z0.clone().requires_grad_(True)
            (gz,) = torch.autograd.grad((fn(z) * v).sum(), z, create_graph=True)
            assert gz.requires_grad
            (hv,) = torch.autograd.grad((gz * w).sum(), z)
            results.append(hv)
    torch.testing.assert_close(results[0], results[1])
