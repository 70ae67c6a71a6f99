"""The sort-based dispatch/combine against a plain per-token loop, in float64, for outputs
and gradients; the MoE layer's shapes and dtypes with a fake router; MoEConfig checks.

Shape suffixes: B, S, T, D, E, K, N (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from moelab.moe import MoE, MoEConfig, SwiGLUExperts, dispatch_combine
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput

D, F, E = 6, 10, 5


@dataclass
class Case:
    x_TD: torch.Tensor
    ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    computed_TK: torch.Tensor
    experts: SwiGLUExperts


def make_experts(seed: int = 0, dtype: torch.dtype = torch.float64) -> SwiGLUExperts:
    torch.manual_seed(seed)
    experts = SwiGLUExperts(E, D, F).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)  # O(1) outputs, so the comparison is not trivially small
    return experts


def make_case(
    T: int,
    K: int,
    *,
    seed: int = 0,
    fillers: bool = False,
    dropped: bool = False,
    unselected: bool = False,
    empty_expert: int | None = None,
) -> Case:
    """Random routing of T tokens to K distinct experts each, with optional fillers
    (selected, weight exactly 0), dropped slots, unselected slots (expert 0, weight 0)
    and one expert that no computed slot names."""
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(E) if e != empty_expert]
    assert K <= len(pool)
    perm = torch.stack([torch.randperm(len(pool), generator=g)[:K] for _ in range(T)])
    ids_TK = torch.tensor(pool)[perm]
    weights_TK = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    selected_TK = torch.ones(T, K, dtype=torch.bool)
    dropped_TK = torch.zeros(T, K, dtype=torch.bool)
    if fillers:
        weights_TK[torch.rand(T, K, generator=g) < 0.25] = 0.0
    if dropped:
        dropped_TK = torch.rand(T, K, generator=g) < 0.2
    if unselected:
        unsel_TK = torch.rand(T, K, generator=g) < 0.2
        selected_TK &= ~unsel_TK
        ids_TK[unsel_TK] = 0
        weights_TK[unsel_TK] = 0.0
    out = RouterOutput(
        scores_TE=torch.zeros(T, E),
        logits_TE=torch.zeros(T, E),
        probs_TE=torch.zeros(T, E),
        ids_TK=ids_TK,
        weights_TK=weights_TK,
        selected_TK=selected_TK,
        dropped_TK=dropped_TK,
        aux_loss=torch.zeros(()),
    )
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64)
    return Case(x_TD, ids_TK, weights_TK, out.computed_TK, make_experts(seed))


def reference(case: Case, x_TD: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """y[t] = sum over computed slots k of w[t, k] * expert_{ids[t, k]}(x[t]), token by token."""
    rows = []
    for t in range(x_TD.shape[0]):
        y_D = x_TD.new_zeros(x_TD.shape[1])
        for k in range(case.ids_TK.shape[1]):
            if case.computed_TK[t, k]:
                e = int(case.ids_TK[t, k])
                y_D = y_D + weights_TK[t, k] * case.experts.forward_expert(e, x_TD[t : t + 1])[0]
        rows.append(y_D)
    return torch.stack(rows)


def outputs_and_grads(case: Case, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn's output and the gradients of <y, G> w.r.t. x, weights and the expert weights."""
    x_TD = case.x_TD.clone().requires_grad_(True)
    weights_TK = case.weights_TK.clone().requires_grad_(True)
    y_TD = fn(x_TD, weights_TK)
    G_TD = torch.randn(y_TD.shape, generator=torch.Generator().manual_seed(1), dtype=y_TD.dtype)
    inputs = [x_TD, weights_TK, *case.experts.parameters()]
    grads = torch.autograd.grad((y_TD * G_TD).sum(), inputs, materialize_grads=True)
    return y_TD.detach(), list(grads)


def fast(case: Case):
    return lambda x, w: dispatch_combine(x, case.ids_TK, w, case.computed_TK, case.experts)


def slow(case: Case):
    return lambda x, w: reference(case, x, w)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize(
    "kind", ["plain", "fillers", "dropped", "unselected", "empty_expert", "all"]
)
def test_matches_per_token_reference(K: int, kind: str) -> None:
    everything = kind == "all"
    case = make_case(
        T=23,
        K=K,
        seed=K,
        fillers=kind == "fillers" or everything,
        dropped=kind == "dropped" or everything,
        unselected=kind == "unselected" or everything,
        empty_expert=2 if kind == "empty_expert" or everything else None,
    )
    y_fast, g_fast = outputs_and_grads(case, fast(case))
    y_slow, g_slow = outputs_and_grads(case, slow(case))
    torch.testing.assert_close(y_fast, y_slow)
    names = ["x", "weights", *(n for n, _ in case.experts.named_parameters())]
    for name, a, b in zip(names, g_fast, g_slow, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad {name}: {m}")


def test_skipped_slots_get_zero_gradient_and_no_compute() -> None:
    case = make_case(T=40, K=3, seed=7, fillers=True, dropped=True, unselected=True)
    skipped_TK = ~case.computed_TK
    assert skipped_TK.any() and case.computed_TK.any()
    seen: dict[str, object] = {}

    class Recording(nn.Module):
        n_experts = E

        def forward(self, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
            seen["rows"], seen["counts"] = x_ND.shape[0], counts_E
            return case.experts(x_ND, counts_E)

    x_TD = case.x_TD.clone().requires_grad_(True)
    weights_TK = case.weights_TK.clone().requires_grad_(True)
    y_TD = dispatch_combine(x_TD, case.ids_TK, weights_TK, case.computed_TK, Recording())
    y_TD.square().sum().backward()
    # A filler's weight is exactly 0 and its expert is not run: the gradient reaching that
    # weight is 0 (and likewise for dropped and unselected slots).
    assert weights_TK.grad is not None
    assert (weights_TK.grad[skipped_TK] == 0).all()
    assert (weights_TK.grad[case.computed_TK] != 0).all()
    # Only computed slots reach the experts, grouped per expert.
    assert seen["rows"] == int(case.computed_TK.sum())
    expected = torch.bincount(case.ids_TK[case.computed_TK], minlength=E).tolist()
    assert seen["counts"] == expected


def test_expert_without_tokens_gets_zero_gradient() -> None:
    case = make_case(T=30, K=2, seed=3, empty_expert=4)
    y_TD = dispatch_combine(case.x_TD, case.ids_TK, case.weights_TK, case.computed_TK, case.experts)
    y_TD.sum().backward()
    for p in case.experts.parameters():
        assert p.grad is not None
        assert (p.grad[4] == 0).all()
        assert (p.grad[:4] != 0).any()


def test_nothing_computed_gives_zeros() -> None:
    case = make_case(T=5, K=2)
    none_TK = torch.zeros_like(case.computed_TK)
    y_TD = dispatch_combine(case.x_TD, case.ids_TK, case.weights_TK, none_TK, case.experts)
    assert y_TD.shape == (5, D)
    assert (y_TD == 0).all()


def test_order_of_tokens_within_an_expert_does_not_matter() -> None:
    """Permuting the tokens permutes the output (dispatch has no cross-token effect)."""
    case = make_case(T=17, K=2, seed=5, fillers=True)
    y_TD = dispatch_combine(case.x_TD, case.ids_TK, case.weights_TK, case.computed_TK, case.experts)
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(0))
    y_perm = dispatch_combine(
        case.x_TD[perm],
        case.ids_TK[perm],
        case.weights_TK[perm],
        case.computed_TK[perm],
        case.experts,
    )
    torch.testing.assert_close(y_perm, y_TD[perm])


def test_rejects_bad_inputs() -> None:
    case = make_case(T=4, K=2)
    bad_ids = case.ids_TK.clone()
    bad_ids[0, 0] = E  # out of range at a computed slot
    with pytest.raises(ValueError, match="n_experts"):
        dispatch_combine(case.x_TD, bad_ids, case.weights_TK, case.computed_TK, case.experts)
    bad_ids[0, 0] = -1
    with pytest.raises(ValueError, match="n_experts"):
        dispatch_combine(case.x_TD, bad_ids, case.weights_TK, case.computed_TK, case.experts)
    # An out-of-range id at a skipped slot is never used, so it is no error.
    skipped_TK = case.computed_TK.clone()
    skipped_TK[0, 0] = False
    dispatch_combine(case.x_TD, bad_ids, case.weights_TK, skipped_TK, case.experts)
    with pytest.raises(ValueError, match="same shape"):
        dispatch_combine(
            case.x_TD, case.ids_TK, case.weights_TK[:, :1], case.computed_TK, case.experts
        )
    with pytest.raises(ValueError, match=r"\(T, D\)"):
        dispatch_combine(
            case.x_TD[None], case.ids_TK, case.weights_TK, case.computed_TK, case.experts
        )


# --- the MoE layer, with a fake router -------------------------------------------------


class FakeRouter(nn.Module):
    """Linear scores, softmax, top-K; records the keyword arguments it was called with."""

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, n_experts, bias=False)
        self.top_k = top_k
        self.calls: list[dict[str, object]] = []

    def forward(self, x_TD: torch.Tensor, **kwargs: object) -> RouterOutput:
        self.calls.append(kwargs)
        k = kwargs.get("top_k") or self.top_k
        assert isinstance(k, int)
        scores_TE = self.proj(x_TD).float()  # routers compute in float32
        probs_TE = scores_TE.softmax(-1)
        weights_TK, ids_TK = probs_TE.topk(k, dim=-1)
        return RouterOutput(
            scores_TE=scores_TE,
            logits_TE=scores_TE,
            probs_TE=probs_TE,
            ids_TK=ids_TK,
            weights_TK=weights_TK,
            selected_TK=torch.ones_like(ids_TK, dtype=torch.bool),
            dropped_TK=torch.zeros_like(ids_TK, dtype=torch.bool),
            aux_loss=scores_TE.new_zeros(()),
        )


def make_moe(top_k: int = 2) -> MoE:
    torch.manual_seed(0)
    config = MoEConfig(d_model=16, d_ff=32, router=RouterConfig(d_model=16, n_experts=4))
    return MoE(config, router=FakeRouter(16, 4, top_k))


def test_moe_accepts_bsd_and_td() -> None:
    moe = make_moe()
    x_BSD = torch.randn(2, 5, 16)
    y_BSD, out = moe(x_BSD)
    assert y_BSD.shape == (2, 5, 16)
    assert out.ids_TK.shape == (10, 2)
    y_TD, _ = moe(x_BSD.reshape(10, 16))
    assert y_TD.shape == (10, 16)
    torch.testing.assert_close(y_BSD.reshape(10, 16), y_TD)
    with pytest.raises(ValueError, match="shape"):
        moe(torch.randn(10, 8))


def test_moe_passes_top_k_only_when_given() -> None:
    moe = make_moe()
    router = moe.router
    assert isinstance(router, FakeRouter)
    _, out = moe(torch.randn(6, 16))
    assert router.calls[-1] == {} and out.ids_TK.shape == (6, 2)
    _, out = moe(torch.randn(6, 16), top_k=3)
    assert router.calls[-1] == {"top_k": 3} and out.ids_TK.shape == (6, 3)


def test_moe_output_dtype_and_gradients() -> None:
    moe = make_moe().to(torch.bfloat16)
    x = torch.randn(3, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    y, out = moe(x)
    assert y.dtype == torch.bfloat16 and out.weights_TK.dtype == torch.float32
    y.float().square().sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_moe_matches_reference_float64() -> None:
    moe = make_moe(top_k=2).double()
    x_TD = torch.randn(9, 16, dtype=torch.float64)
    y_TD, out = moe(x_TD)
    expected = torch.zeros_like(x_TD)
    for t in range(9):
        for k in range(2):
            e = int(out.ids_TK[t, k])
            expected[t] += out.weights_TK[t, k] * moe.experts.forward_expert(e, x_TD[t : t + 1])[0]
    torch.testing.assert_close(y_TD, expected)


def test_moe_config_validation() -> None:
    rc = RouterConfig(d_model=16, n_experts=4)
    assert MoEConfig(d_model=16, d_ff=8, router=rc).n_experts == 4
    with pytest.raises(ValueError, match=r"router\.d_model"):
        MoEConfig(d_model=32, d_ff=8, router=rc)
    with pytest.raises(ValueError, match="d_ff"):
        MoEConfig(d_model=16, d_ff=0, router=rc)
    with pytest.raises(ValueError, match="d_model"):
        MoEConfig(d_model=0, d_ff=8, router=rc)


def test_moe_default_router_contract() -> None:
    """With the library's Router (DESIGN.md section 3): y has x's shape."""
    pytest.importorskip("moelab.routing.router")
    rc = RouterConfig(d_model=16, n_experts=4, top_k=2)
    moe = MoE(MoEConfig(d_model=16, d_ff=32, router=rc))
    y, out = moe(torch.randn(2, 3, 16))
    assert y.shape == (2, 3, 16)
    assert out.ids_TK.shape == (6, 2)
