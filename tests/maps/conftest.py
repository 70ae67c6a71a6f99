"""Shared fixtures: every map as a (name, callable, kind) spec, and both backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from moelab import maps


@dataclass(frozen=True)
class MapSpec:
    name: str
    fn: Callable[..., torch.Tensor]  # fn(z, dim=...)
    kind: str  # "simplex" | "elementwise" | "topk"
    k: float = 0.0  # sum of the outputs for "topk"
    threshold: float | None = None

    def __str__(self) -> str:
        return self.name


SIMPLEX = [
    MapSpec("softmax", lambda z, dim=-1: maps.softmax(z, dim=dim), "simplex"),
    MapSpec("sparsemax", lambda z, dim=-1: maps.sparsemax(z, dim=dim), "simplex", threshold=1.0),
    MapSpec("entmax1.5", lambda z, dim=-1: maps.entmax(z, 1.5, dim=dim), "simplex", threshold=2.0),
    MapSpec(
        "entmax1.5-iter",
        lambda z, dim=-1: maps.entmax(z, 1.5, dim=dim, method="iterative"),
        "simplex",
        threshold=2.0,
    ),
    MapSpec(
        "entmax1.25", lambda z, dim=-1: maps.entmax(z, 1.25, dim=dim), "simplex", threshold=4.0
    ),
    MapSpec("entmax3", lambda z, dim=-1: maps.entmax(z, 3.0, dim=dim), "simplex", threshold=0.5),
    MapSpec("normmax2", lambda z, dim=-1: maps.normmax(z, 2.0, dim=dim), "simplex", threshold=1.0),
    MapSpec(
        "normmax2-iter",
        lambda z, dim=-1: maps.normmax(z, 2.0, dim=dim, method="iterative"),
        "simplex",
        threshold=1.0,
    ),
    MapSpec(
        "normmax1.5", lambda z, dim=-1: maps.normmax(z, 1.5, dim=dim), "simplex", threshold=1.0
    ),
    MapSpec("normmax4", lambda z, dim=-1: maps.normmax(z, 4.0, dim=dim), "simplex", threshold=1.0),
]
ELEMENTWISE = [
    MapSpec("sigmoid", lambda z, dim=-1: maps.sigmoid(z, dim=dim), "elementwise"),
    MapSpec("relu", lambda z, dim=-1: maps.relu(z, dim=dim), "elementwise"),
    MapSpec("sqrtsoftplus", lambda z, dim=-1: maps.sqrtsoftplus(z, dim=dim), "elementwise"),
]
TOPK = [
    MapSpec("lapsum-k2", lambda z, dim=-1: maps.lapsum(z, 2.0, dim=dim), "topk", k=2.0),
    MapSpec(
        "lapsum-k1.5-t0.3",
        lambda z, dim=-1: maps.lapsum(z, 1.5, temperature=0.3, dim=dim),
        "topk",
        k=1.5,
    ),
]
ALL = SIMPLEX + ELEMENTWISE + TOPK
SPARSE = [s for s in SIMPLEX if s.threshold is not None]


@pytest.fixture(params=["auto", "torch"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test through the fused CPU kernels and through the PyTorch path."""
    with maps.use_backend(request.param):
        yield request.param
