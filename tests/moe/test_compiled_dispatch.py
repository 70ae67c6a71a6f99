"""The dispatch that compiles without a host read (`permute_padded` +
`SwiGLUExperts.forward_offsets`, the path `MoE` takes under ``torch.compile``) against
today's `permute` + loop over experts in float64, forward and backward; and the compiled
MoE layer: no graph break, one graph per input shape whatever the routing."""

from __future__ import annotations

import pytest
import torch

from moelab.moe import MoE, MoEConfig, SwiGLUExperts
from moelab.moe.dispatch import dispatch_combine, permute_padded, unpermute
from moelab.routing.config import RouterConfig

E, D, F = 4, 8, 12


def slots(T: int, K: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random slots with dropped ones, fillers of weight exactly 0 and ids >= E (null
    experts) at slots that are not computed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    computed = torch.rand(T, K, generator=g) > 0.3  # dropped slots
    weights[0, 0] = 0.0  # a filler: selected, weight 0
    ids[1, -1] = E + 1  # a null expert's id, never computed
    computed[1, -1] = False
    return ids, weights, computed


def padded(x, ids, w, computed, experts):  # type: ignore[no-untyped-def]
    p = permute_padded(x, ids, w, computed, E)
    return unpermute(experts.forward_offsets(p.x_JD, p.offs_E, p.expert_J), p.plan)


def grads(fn, x, w, experts):  # type: ignore[no-untyped-def]
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fn(x, w)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    out = (y.detach(), x.grad, w.grad, *(p.grad.clone() for p in experts.parameters()))
    experts.zero_grad()
    return out


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_dispatch_equals_loop(K: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ex64 = SwiGLUExperts(E, D, F, impl="loop").double()
    ex = SwiGLUExperts(E, D, F, impl="loop").to(dtype)
    ex.load_state_dict(ex64.state_dict())
    T = 10
    ids, w, computed = slots(T, K, seed=K)
    x = torch.randn(T, D, dtype=torch.float64)
    ref = grads(lambda x, w: dispatch_combine(x, ids, w, computed, ex64), x, w, ex64)
    got = grads(lambda x, w: padded(x, ids, w, computed, ex), x.to(dtype), w.to(dtype), ex)
    # float64: every expert on every row, masked (no grouped GEMM kernel); float32:
    # the moelab::grouped_mm custom op, at float32's resolution
    tol = {} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-4}
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b.double(), a, **tol)
    assert got[2][~computed].abs().max() == 0  # skipped slots: exactly zero gradient


@pytest.fixture(scope="module")
def layers() -> tuple[MoE, MoE]:
    torch.manual_seed(0)
    rc = RouterConfig(
        d_model=16,
        n_experts=4,
        top_k=2,
        capacity_factor=1.0,
        n_null_experts=1,
        null_expert="identity",
    )
    eager = MoE(MoEConfig(d_model=16, d_ff=32, router=rc))
    compiled = MoE(MoEConfig(d_model=16, d_ff=32, router=rc))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def test_compiled_layer_one_graph_per_shape(layers: tuple[MoE, MoE]) -> None:
    eager, layer = layers
    torch._dynamo.reset()
    x = torch.randn(2, 8, 16)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = torch.compile(layer, backend="aot_eager")
    for seed, shape in [(1, (2, 8, 16)), (2, (2, 8, 16)), (3, (3, 8, 16)), (4, (5, 8, 16))]:
        torch.manual_seed(seed)  # another routing outcome each time
        xi = torch.randn(shape) * seed
        ref = grads(lambda x, _: eager(x)[0], xi, torch.zeros(1), eager)
        got = grads(lambda x, _: fn(x)[0], xi, torch.zeros(1), layer)
        for a, b in zip(ref, got, strict=True):
            if a is not None:
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    # one graph for the first shape, one with a dynamic token count for the others (dynamo's
    # automatic dynamic shapes), none for a new routing outcome
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


def test_the_padded_path_only_where_grouped_gemm_runs() -> None:
    aligned, misaligned = SwiGLUExperts(E, 16, 32), SwiGLUExperts(E, 6, 32)
    cpu32 = torch.zeros(2, 16)
    assert aligned.grouped_runs(cpu32)
    assert not aligned.grouped_runs(cpu32.double())  # no float64 kernel
    assert not misaligned.grouped_runs(torch.zeros(2, 6))  # 16-byte strides
    assert not aligned.grouped_runs(torch.zeros(2, 16, device="meta"))
    # elsewhere the compiled layer keeps permute and the loop (the padded fallback would
    # run every expert on every row): it breaks at the host read, as before
    cfg = MoEConfig(d_model=6, d_ff=32, router=RouterConfig(d_model=6, n_experts=E, top_k=2))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(MoE(cfg))(torch.randn(2, 5, 6))
    assert explained.graph_break_count > 0
