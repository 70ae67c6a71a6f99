"""Closed-form backward passes against finite differences (float64 gradcheck),
along more than one dim, through both backends."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from moelab import maps

from .conftest import ALL, MapSpec


def general_position(*shape: int, seed: int) -> torch.Tensor:
    # Spread-out scores keep every entry away from the kinks of the sparse maps
    # (support boundaries) by far more than gradcheck's step.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 1.5).requires_grad_(True)


@pytest.mark.parametrize("spec", ALL, ids=str)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_gradcheck(spec: MapSpec, dim: int, backend: str) -> None:
    z = general_position(3, 5, 4, seed=10 + dim)
    assert gradcheck(lambda x: spec.fn(x, dim=dim), (z,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_gradcheck_with_masked_experts(spec: MapSpec, backend: str) -> None:
    z = general_position(4, 7, seed=3).detach()
    z[:, 1] = -torch.inf
    z.requires_grad_(True)
    assert gradcheck(lambda x: spec.fn(x), (z,), eps=1e-6, atol=1e-6)


def test_lapsum_gradcheck_in_k_and_temperature(backend: str) -> None:
    z = general_position(5, 8, seed=4)
    k = torch.tensor([1.0, 2.5, 3.0, 6.5, 0.4], dtype=torch.float64, requires_grad=True)
    t = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    assert gradcheck(
        lambda a, b, c: maps.lapsum(a, b, temperature=c), (z, k, t), eps=1e-6, atol=1e-6
    )
    # per-row temperature, k broadcast from a scalar tensor, along dim 0
    t_rows = torch.rand(8, dtype=torch.float64).add(0.2).requires_grad_(True)
    k0 = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    assert gradcheck(
        lambda a, b, c: maps.lapsum(a, b, temperature=c, dim=0),
        (z, k0, t_rows),
        eps=1e-6,
        atol=1e-6,
    )


def test_sparse_gradient_vanishes_beyond_threshold(backend: str) -> None:
    # A singleton row is locally constant: no gradient reaches any score.
    z = torch.tensor([[3.0, 0.5, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    for fn in (maps.sparsemax, maps.normmax):
        (fn(z) * torch.randn(1, 4, dtype=torch.float64)).sum().backward()
        assert (z.grad == 0).all()
        z.grad = None
    # gap 2.5 < 4 = threshold of 1.25-entmax: still a gradient
    (maps.entmax(z, 1.25)[0, 0]).backward()
    assert (z.grad != 0).any()
