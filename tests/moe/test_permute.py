"""The three dispatch steps, permute -> experts -> unpermute, each against a plain
per-token loop in float64, forward and backward; and the seam between them.

Shape suffixes: T, D, E, K, N (moelab.shapes).
"""

from __future__ import annotations

import pytest
import torch

from moelab.moe import SwiGLUExperts, dispatch_combine, permute, unpermute

T, D, E, K = 19, 5, 4, 3
f64 = torch.float64


def make_slots(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, ids (repeats allowed), weights and a computed mask with skipped slots whose ids
    are out of range (never read) and one expert (3) that no computed slot names."""
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, dtype=f64)
    ids_TK = torch.randint(0, E - 1, (T, K), generator=g)
    weights_TK = torch.rand(T, K, generator=g, dtype=f64) + 0.1
    computed_TK = torch.rand(T, K, generator=g) < 0.7
    ids_TK = torch.where(computed_TK, ids_TK, 99)
    return x_TD, ids_TK, weights_TK, computed_TK


def permute_reference(x_TD, ids_TK, weights_TK, computed_TK):
    """Expert by expert, token by token: the rows, weights and tokens of the computed slots."""
    rows, weights, tokens, counts = [], [], [], []
    for e in range(E):
        counts.append(0)
        for t in range(T):
            for k in range(K):
                if computed_TK[t, k] and int(ids_TK[t, k]) == e:
                    rows.append(x_TD[t])
                    weights.append(weights_TK[t, k])
                    tokens.append(t)
                    counts[e] += 1
    return torch.stack(rows), counts, tokens, torch.stack(weights)


def unpermute_reference(y_ND, token_N, weight_N):
    """y[t] = sum over rows n of token t of weight[n] * y_N[n], one row at a time."""
    y_TD = y_ND.new_zeros(T, y_ND.shape[1])
    for n in range(y_ND.shape[0]):
        y_TD[token_N[n]] = y_TD[token_N[n]] + weight_N[n] * y_ND[n]
    return y_TD


def grads(out: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of sum_i <out_i, G_i> for fixed random G_i."""
    g = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out)
    return list(torch.autograd.grad(loss, inputs, materialize_grads=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permute_matches_loop(seed: int) -> None:
    x_TD, ids_TK, weights_TK, computed_TK = make_slots(seed)
    x_TD.requires_grad_(True)
    weights_TK.requires_grad_(True)
    x_ND, counts_E, plan = permute(x_TD, ids_TK, weights_TK, computed_TK, E)
    ref_x_ND, ref_counts, ref_tokens, ref_w_N = permute_reference(
        x_TD, ids_TK, weights_TK, computed_TK
    )
    assert counts_E == ref_counts and counts_E[3] == 0
    assert plan.token_N.tolist() == ref_tokens
    assert plan.n_tokens == T
    torch.testing.assert_close(x_ND, ref_x_ND, rtol=0, atol=0)
    torch.testing.assert_close(plan.weight_N, ref_w_N, rtol=0, atol=0)
    got = grads([x_ND, plan.weight_N], [x_TD, weights_TK])
    want = grads([ref_x_ND, ref_w_N], [x_TD, weights_TK])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # skipped slots get exactly zero gradient
    assert (got[1][~computed_TK] == 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_unpermute_matches_loop(seed: int) -> None:
    x_TD, ids_TK, weights_TK, computed_TK = make_slots(seed)
    _, _, plan = permute(x_TD, ids_TK, weights_TK, computed_TK, E)
    n = plan.token_N.shape[0]
    y_ND = torch.randn(n, 7, dtype=f64, generator=torch.Generator().manual_seed(seed))
    y_ND.requires_grad_(True)
    weight_N = plan.weight_N.clone().requires_grad_(True)
    plan = plan._replace(weight_N=weight_N)
    y_TD = unpermute(y_ND, plan)
    ref_TD = unpermute_reference(y_ND, plan.token_N.tolist(), weight_N)
    assert y_TD.shape == (T, 7)
    torch.testing.assert_close(y_TD, ref_TD)
    for a, b in zip(
        grads([y_TD], [y_ND, weight_N]), grads([ref_TD], [y_ND, weight_N]), strict=True
    ):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="one row per permuted row"):
        unpermute(y_ND[1:], plan)


def test_the_seam_takes_any_row_order_preserving_exchange() -> None:
    """What goes between the steps only has to return rows in x_ND's order: sending each
    expert's block away and back in another block order (a stand-in for an all-to-all)
    gives dispatch_combine's result."""
    x_TD, ids_TK, weights_TK, computed_TK = make_slots(4)
    torch.manual_seed(0)
    experts = SwiGLUExperts(E, D, 8).to(f64)
    x_ND, counts_E, plan = permute(x_TD, ids_TK, weights_TK, computed_TK, E)
    blocks = list(torch.split(x_ND, counts_E))
    # "remote" side: blocks arrive in reverse expert order, each expert runs on its own
    remote = [experts.forward_expert(e, blocks[e]) for e in reversed(range(E))]
    y_ND = torch.cat(remote[::-1])  # and come back in expert order
    y_TD = unpermute(y_ND, plan)
    expected = dispatch_combine(x_TD, ids_TK, weights_TK, computed_TK, experts)
    torch.testing.assert_close(y_TD, expected)
