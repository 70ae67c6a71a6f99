"""Softmax over rows narrower than one vector (E < 16 on the CPU) takes an explicit
exp / sum path: it must be torch's softmax to rounding, forward and backward, with the
float64 softmax as the reference."""

from __future__ import annotations

import pytest
import torch

from moelab import maps
from moelab.maps.softmax import NARROW, rows_softmax


def _scores(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    z = torch.randn(257, n, generator=g, dtype=torch.float64) * 3
    if n > 1:
        z[1::5] = z[1::5, :1]  # ties
        z[::4, 0] = -torch.inf  # masked experts
    return z.to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 12, 15, NARROW, 24])
def test_forward_and_backward_match_the_float64_reference(n: int) -> None:
    z64 = _scores(n, torch.float64)
    g64 = torch.randn(z64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = z64.clone().requires_grad_()
    p_ref = torch.softmax(ref, -1)
    (grad_ref,) = torch.autograd.grad(p_ref, ref, g64)
    for fn in (lambda z: maps.softmax(z, dim=-1), rows_softmax):
        z = z64.float().requires_grad_()
        p = fn(z)
        (grad,) = torch.autograd.grad(p, z, g64.float())
        torch.testing.assert_close(p.double(), p_ref, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(grad.double(), grad_ref, atol=1e-6, rtol=1e-5)
        assert bool((p[z == -torch.inf] == 0).all())


@pytest.mark.parametrize("n", [2, 8, 20])
def test_gradcheck_and_double_backward(n: int) -> None:
    z = _scores(n, torch.float64)[:9].requires_grad_()
    assert torch.autograd.gradcheck(lambda a: maps.softmax(a, dim=-1), (z,))
    assert torch.autograd.gradgradcheck(lambda a: maps.softmax(a, dim=-1), (z,))


def test_a_fully_masked_row_is_nan_as_torch_gives_it() -> None:
    z = torch.full((1, 8), -torch.inf)
    assert torch.isnan(rows_softmax(z)).all() and torch.isnan(torch.softmax(z, -1)).all()
