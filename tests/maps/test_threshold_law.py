"""The singleton threshold law: the runner-up gets exactly zero weight iff the
top-2 score gap is at least the map's threshold (sparsemax and every
alpha-normmax: 1; alpha-entmax: 1/(alpha - 1))."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelab import maps

from .conftest import SPARSE, MapSpec

rows = hnp.arrays(
    dtype="float64",
    shape=st.tuples(st.integers(1, 8), st.integers(2, 16)),
    elements=st.floats(-6, 6, allow_nan=False, width=64),
)


def runner_up_is_zero(z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top2 = z.topk(2, dim=-1)
    gap = top2.values[:, 0] - top2.values[:, 1]
    return gap, p.gather(-1, top2.indices[:, 1:2])[:, 0] == 0


@pytest.mark.parametrize("spec", SPARSE, ids=str)
@given(arr=rows)
def test_threshold_law_property(spec: MapSpec, arr: np.ndarray, backend: str) -> None:
    z = torch.from_numpy(arr)
    gap, zero = runner_up_is_zero(z, spec.fn(z))
    clear = (gap - spec.threshold).abs() > 1e-9  # the law is about the exact gap
    assert torch.equal(zero[clear], (gap >= spec.threshold)[clear])


@pytest.mark.parametrize("spec", SPARSE, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_threshold_law_on_random_scores(spec: MapSpec, dtype: torch.dtype, backend: str) -> None:
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(20000, 8, generator=g) * 1.5 * spec.threshold).to(dtype)
    gap, zero = runner_up_is_zero(z, spec.fn(z))
    # the rates agree exactly, row for row, and both sides occur
    assert torch.equal(zero, gap >= spec.threshold)
    assert 0.02 < zero.double().mean() < 0.98


@pytest.mark.parametrize(
    ("name", "alpha", "expected"),
    [
        ("sparsemax", None, 1.0),
        ("normmax", 2.0, 1.0),
        ("normmax", 1.3, 1.0),
        ("normmax", 5.0, 1.0),
        ("entmax", 1.5, 2.0),
        ("entmax", None, 2.0),
        ("entmax", 1.25, 4.0),
        ("entmax", 2.0, 1.0),
        ("softmax", None, None),
        ("sigmoid", None, None),
        ("relu", None, None),
        ("sqrtsoftplus", None, None),
        ("lapsum", None, None),
    ],
)
def test_threshold_values(name: str, alpha: float | None, expected: float | None) -> None:
    assert maps.threshold(name, alpha) == expected


def test_exact_boundary(backend: str) -> None:
    # gap exactly at the threshold: runner-up zero (the law is "gap >= threshold")
    z = torch.tensor([[1.0, 0.0, -0.5], [2.0, 0.0, -3.0]])
    assert maps.sparsemax(z)[0, 1] == 0 and maps.normmax(z)[0, 1] == 0
    assert maps.entmax(z)[1, 1] == 0
    assert maps.entmax(z)[0, 1] > 0
