"""Lipschitz bound of the softmax gate and the certified top-1 radius."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelab.routing.certification import (
    certified_radius,
    gate_lipschitz,
    spectral_norm,
    top1_margin,
)

f64 = torch.float64


def gate(x: torch.Tensor, w_ED: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.softmax(x @ w_ED.t() / tau, dim=-1)


problem = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "n_experts": st.integers(2, 10),
        "d_model": st.integers(1, 12),
        "tau": st.floats(0.05, 5.0),
        "w_scale": st.floats(0.1, 5.0),
        "x_scale": st.floats(0.01, 3.0),
    }
)


def draw(p: dict, n_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(p["seed"])
    w_ED = p["w_scale"] * torch.randn(p["n_experts"], p["d_model"], generator=gen, dtype=f64)
    x_TD = p["x_scale"] * torch.randn(n_tokens, p["d_model"], generator=gen, dtype=f64)
    return w_ED, x_TD, gen


def test_spectral_norm_matches_svd() -> None:
    w_ED = torch.randn(6, 9, dtype=f64)
    assert float(spectral_norm(w_ED)) == pytest.approx(float(torch.linalg.svdvals(w_ED)[0]))


def test_softmax_jacobian_norm_at_most_half() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        z = 3 * torch.randn(7, generator=gen, dtype=f64)
        jac = torch.autograd.functional.jacobian(lambda t: torch.softmax(t, -1), z)
        assert float(torch.linalg.matrix_norm(jac, ord=2)) <= 0.5 + 1e-12


@given(problem)
def test_gate_is_lipschitz(p: dict) -> None:
    w_ED, x_TD, gen = draw(p)
    y_TD = x_TD + p["x_scale"] * torch.randn(x_TD.shape, generator=gen, dtype=f64)
    lip = float(gate_lipschitz(w_ED, p["tau"]))
    assert lip == pytest.approx(float(torch.linalg.svdvals(w_ED)[0]) / (2 * p["tau"]))
    lhs_T = (gate(x_TD, w_ED, p["tau"]) - gate(y_TD, w_ED, p["tau"])).norm(dim=-1)
    rhs_T = lip * (x_TD - y_TD).norm(dim=-1) + 1e-12
    assert (lhs_T <= rhs_T).all(), (lhs_T - rhs_T).max()


@given(problem)
def test_top1_is_constant_inside_certified_radius(p: dict) -> None:
    w_ED, x_TD, gen = draw(p)
    tau = p["tau"]
    radius_T = certified_radius(x_TD, w_ED, tau)
    assert radius_T.dtype == f64 and (radius_T >= 0).all()
    gates_TE = gate(x_TD, w_ED, tau)
    top_T = gates_TE.argmax(-1)
    runner_T = gates_TE.topk(2, dim=-1).indices[:, 1]
    # random directions, plus the direction that closes the top-2 gap fastest
    dirs = [torch.randn(x_TD.shape, generator=gen, dtype=f64) for _ in range(8)]
    dirs.append(w_ED[runner_T] - w_ED[top_T])
    for d_TD in dirs:
        unit_TD = d_TD / d_TD.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        y_TD = x_TD + 0.99 * radius_T[:, None] * unit_TD
        moved = radius_T > 0
        assert torch.equal(gate(y_TD, w_ED, tau).argmax(-1)[moved], top_T[moved])


def test_radius_by_hand() -> None:
    # W = 2 I, tau = 2, x = (ln 3, 0): z = (ln 3, 0), gates (3/4, 1/4), margin 1/2,
    # ||W||_2 = 2  =>  r = sqrt(2) * 2 * (1/2) / 2 = sqrt(2) / 2.
    w_ED = 2 * torch.eye(2, dtype=f64)
    x_TD = torch.tensor([[math.log(3.0), 0.0]], dtype=f64)
    torch.testing.assert_close(gate(x_TD, w_ED, 2.0), torch.tensor([[0.75, 0.25]], dtype=f64))
    assert float(gate_lipschitz(w_ED, 2.0)) == pytest.approx(0.5)
    assert float(certified_radius(x_TD, w_ED, 2.0)[0]) == pytest.approx(math.sqrt(2) / 2)
    # a tensor temperature gives the same answer
    radius = certified_radius(x_TD, w_ED, torch.tensor(2.0, dtype=f64))
    assert float(radius[0]) == pytest.approx(math.sqrt(2) / 2)


def test_top1_margin_by_hand() -> None:
    gates_TE = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.45, 0.45], [0.4, 0.4, 0.2]])
    torch.testing.assert_close(top1_margin(gates_TE), torch.tensor([0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="2 experts"):
        top1_margin(torch.ones(3, 1))


def test_tied_or_zero_weight_gives_zero_radius() -> None:
    x_TD = torch.randn(4, 3)
    assert torch.equal(certified_radius(x_TD, torch.zeros(5, 3), 1.0), torch.zeros(4))
    w_ED = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # identical rows: always tied
    assert torch.equal(certified_radius(x_TD, w_ED, 1.0), torch.zeros(4))
