"""Invariants every map must keep: simplex / sum-to-k, masks, dims, dtypes,
ties and large scores."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelab import maps

from .conftest import ALL, SIMPLEX, TOPK, MapSpec

scores = hnp.arrays(
    dtype="float64",
    shape=st.tuples(st.integers(1, 6), st.integers(3, 20)),
    elements=st.floats(-8, 8, allow_nan=False, width=64),
)


def check_output(spec: MapSpec, z: torch.Tensor, p: torch.Tensor, atol: float) -> None:
    assert p.shape == z.shape and p.dtype == z.dtype
    assert torch.isfinite(p).all()
    assert (p >= 0).all()
    if spec.kind == "simplex":
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), atol=atol, rtol=0)
    elif spec.kind == "topk":
        assert (p <= 1).all()
        torch.testing.assert_close(
            p.sum(-1), torch.full_like(p.sum(-1), spec.k), atol=atol * spec.k, rtol=0
        )


@pytest.mark.parametrize("spec", ALL, ids=str)
@given(arr=scores)
def test_output_invariants_float64(spec: MapSpec, arr, backend: str) -> None:
    z = torch.from_numpy(arr)
    check_output(spec, z, spec.fn(z), atol=1e-10)


@pytest.mark.parametrize("spec", ALL, ids=str)
@given(arr=scores)
def test_output_invariants_float32(spec: MapSpec, arr, backend: str) -> None:
    z = torch.from_numpy(arr).float()
    check_output(spec, z, spec.fn(z), atol=2e-5)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_any_dim_and_leading_shape(spec: MapSpec, backend: str) -> None:
    z = torch.randn(3, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    last = spec.fn(z.transpose(1, 2), dim=-1)  # experts moved last by hand
    torch.testing.assert_close(spec.fn(z, dim=1), last.transpose(1, 2))
    torch.testing.assert_close(spec.fn(z, dim=-2), last.transpose(1, 2))
    one_row = spec.fn(z[0, :, 0], dim=0)
    torch.testing.assert_close(one_row, last[0, 0])


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_masked_experts_get_exact_zero_and_no_gradient(spec: MapSpec, backend: str) -> None:
    z = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z[:, [2, 5]] = -torch.inf
    z.requires_grad_(True)
    p = spec.fn(z)
    assert (p[:, [2, 5]] == 0).all()
    assert torch.isfinite(p).all()
    p.backward(torch.randn_like(p))
    assert torch.isfinite(z.grad).all()
    assert (z.grad[:, [2, 5]] == 0).all()


@pytest.mark.parametrize("spec", ALL, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_in_float32(spec: MapSpec, dtype: torch.dtype, backend: str) -> None:
    z = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)) * 3
    zh = z.to(dtype)
    p = spec.fn(zh)
    assert p.dtype == dtype
    # computed in float32 from the rounded scores, then rounded once
    expected = spec.fn(zh.float()).to(dtype)
    torch.testing.assert_close(p, expected, atol=0, rtol=0)
    zh.requires_grad_(True)
    spec.fn(zh).sum().backward()
    assert zh.grad.dtype == dtype and torch.isfinite(zh.grad.float()).all()


@pytest.mark.parametrize("spec", ALL, ids=str)
@pytest.mark.parametrize("scale", [1e4, 1e-4])
def test_extreme_magnitudes(spec: MapSpec, scale: float, backend: str) -> None:
    z = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)) * scale
    z.requires_grad_(True)
    p = spec.fn(z)
    check_output(spec, z.detach(), p.detach(), atol=1e-4)
    p.backward(torch.randn_like(p))
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("spec", SIMPLEX, ids=str)
def test_ties_are_shared_equally(spec: MapSpec, backend: str) -> None:
    z = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, -3.0, -3.0]], dtype=torch.float64)
    p = spec.fn(z)
    torch.testing.assert_close(p[0], torch.full((4,), 0.25, dtype=torch.float64))
    assert p[1, 0] == p[1, 1] and p[1, 2] == p[1, 3]
    if spec.threshold is not None:  # gap 6 >= every threshold tested: a pure split
        torch.testing.assert_close(p[1], torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("spec", TOPK, ids=str)
def test_lapsum_ties(spec: MapSpec, backend: str) -> None:
    z = torch.zeros(2, 6, dtype=torch.float64)
    torch.testing.assert_close(spec.fn(z), torch.full_like(z, spec.k / 6))


def test_sparse_maps_shift_invariant(backend: str) -> None:
    z = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for fn in (maps.sparsemax, maps.entmax, maps.normmax, maps.softmax):
        torch.testing.assert_close(fn(z + 123.25), fn(z))
    torch.testing.assert_close(maps.lapsum(z + 123.25, 3.0), maps.lapsum(z, 3.0))
