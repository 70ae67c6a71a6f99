"""Every fast path against a slow, obvious reference, in float64: the fused CPU
kernels against the sort-based PyTorch solvers, exact against iterative
solvers, and moelab against the `entmax` package."""

from __future__ import annotations

import pytest
import torch

from moelab import maps

entmax_pkg = pytest.importorskip("entmax")


def hard_scores(seed: int, rows: int = 512, n: int = 24) -> torch.Tensor:
    """Random scores with the awkward cases mixed in: ties, masks, wide and
    narrow spreads, singleton rows."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, n, generator=g, dtype=torch.float64)
    z[: rows // 4] *= 6.0  # mostly singletons
    z[rows // 4 : rows // 2] *= 0.05  # near-uniform
    z[rows // 2 : rows // 2 + 16] = torch.round(z[rows // 2 : rows // 2 + 16])  # ties
    z[-32:, :5] = -torch.inf  # masked experts
    z[-8:, 6] = 1e4  # one dominant score
    return z


MAPS = {
    "sparsemax": lambda z: maps.sparsemax(z),
    "entmax15": lambda z: maps.entmax(z, 1.5),
    "normmax2": lambda z: maps.normmax(z, 2.0),
    "lapsum": lambda z: maps.lapsum(z, 3.0, temperature=0.5),
}


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernels_match_pytorch_path(name: str, dtype: torch.dtype) -> None:
    if maps.backend() != "cpu-kernels":
        pytest.skip("the CPU kernels are not built on this machine")
    fn = MAPS[name]
    z = hard_scores(1).to(dtype)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    grads = []
    outs = []
    for backend in ("auto", "torch"):
        with maps.use_backend(backend):
            x = z.clone().requires_grad_(True)
            p = fn(x)
            p.backward(g)
            outs.append(p.detach())
            grads.append(x.grad)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    torch.testing.assert_close(grads[0], grads[1], **tol)
    # same support, exactly
    assert torch.equal(outs[0] > 0, outs[1] > 0) or name == "lapsum"


@pytest.mark.parametrize(
    ("exact", "iterative"),
    [
        (lambda z: maps.entmax(z, 1.5), lambda z: maps.entmax(z, 1.5, method="iterative")),
        (lambda z: maps.sparsemax(z), lambda z: maps.entmax(z, 2.0, method="iterative")),
        (lambda z: maps.normmax(z, 2.0), lambda z: maps.normmax(z, 2.0, method="iterative")),
    ],
    ids=["entmax1.5", "entmax2=sparsemax", "normmax2"],
)
def test_exact_and_iterative_solvers_agree(exact, iterative, backend: str) -> None:
    z = hard_scores(3).requires_grad_(True)
    g = torch.randn(z.shape, dtype=torch.float64)
    p1 = exact(z)
    (d1,) = torch.autograd.grad(p1, z, g)
    p2 = iterative(z)
    (d2,) = torch.autograd.grad(p2, z, g)
    torch.testing.assert_close(p1, p2, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(d1, d2, atol=1e-9, rtol=1e-7)


def finite_rows(z: torch.Tensor) -> torch.Tensor:
    return z[torch.isfinite(z).all(-1)]  # the entmax package's bisection dislikes -inf


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda z: maps.sparsemax(z), lambda z: entmax_pkg.sparsemax(z, dim=-1)),
        (lambda z: maps.entmax(z, 1.5), lambda z: entmax_pkg.entmax15(z, dim=-1)),
        (lambda z: maps.entmax(z, 1.5), lambda z: entmax_pkg.entmax_bisect(z, 1.5, n_iter=100)),
        (lambda z: maps.entmax(z, 1.25), lambda z: entmax_pkg.entmax_bisect(z, 1.25, n_iter=100)),
        (lambda z: maps.entmax(z, 3.0), lambda z: entmax_pkg.entmax_bisect(z, 3.0, n_iter=100)),
        (lambda z: maps.normmax(z, 2.0), lambda z: entmax_pkg.normmax_bisect(z, 2.0, n_iter=100)),
        (lambda z: maps.normmax(z, 1.5), lambda z: entmax_pkg.normmax_bisect(z, 1.5, n_iter=100)),
        (lambda z: maps.normmax(z, 4.0), lambda z: entmax_pkg.normmax_bisect(z, 4.0, n_iter=100)),
    ],
    ids=[
        "sparsemax",
        "entmax15-sort",
        "entmax15-bisect",
        "entmax1.25-bisect",
        "entmax3-bisect",
        "normmax2-bisect",
        "normmax1.5-bisect",
        "normmax4-bisect",
    ],
)
def test_agrees_with_entmax_package(ours, theirs, backend: str) -> None:
    z = finite_rows(hard_scores(5)).requires_grad_(True)
    g = torch.randn(z.shape, dtype=torch.float64)
    p1 = ours(z)
    (d1,) = torch.autograd.grad(p1, z, g)
    p2 = theirs(z)
    (d2,) = torch.autograd.grad(p2, z, g)
    torch.testing.assert_close(p1, p2, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(d1, d2, atol=1e-7, rtol=1e-6)
