"""Grouped-GEMM experts (``torch._grouped_mm``) against the per-expert loop and a float64
reference built from `SwiGLUExperts.forward_expert`: outputs and gradients, experts with no
rows, every row on one expert, and the rule that picks the implementation.

Shape suffixes: D, F, E, N (moelab.shapes).
"""

from __future__ import annotations

import pytest
import torch

from moelab.moe import MoE, MoEConfig, SwiGLUExperts
from moelab.moe import experts as experts_mod
from moelab.routing.config import RouterConfig

D, F, E = 16, 32, 5

pytestmark = pytest.mark.skipif(
    not experts_mod.grouped_mm_available(), reason="this torch has no torch._grouped_mm"
)


def make_experts(seed: int = 0) -> SwiGLUExperts:
    torch.manual_seed(seed)
    ex = SwiGLUExperts(E, D, F).double()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.3)  # O(1) outputs, so agreement is not trivially small
    return ex


def reference(ex64: SwiGLUExperts, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
    """float64, one expert at a time through forward_expert (indexing, not unbind)."""
    outs, start = [], 0
    for e, c in enumerate(counts_E):
        outs.append(ex64.forward_expert(e, x_ND[start : start + c]))
        start += c
    return torch.cat(outs, 0)


def run(ex: SwiGLUExperts, x_ND: torch.Tensor, counts_E: list[int], g_ND: torch.Tensor):
    """Output and gradients (x, w_gate, w_up, w_down) for upstream gradient g_ND."""
    x = x_ND.detach().requires_grad_(True)
    y = ex(x, counts_E)
    params = [ex.w_gate_EFD, ex.w_up_EFD, ex.w_down_EDF]
    grads = torch.autograd.grad(y, [x, *params], g_ND.to(y.dtype))
    return y, grads


def compare(counts_E: list[int], dtype: torch.dtype, seed: int = 0) -> None:
    ex64 = make_experts(seed)
    n = sum(counts_E)
    g = torch.Generator().manual_seed(seed + 1)
    x64 = torch.randn(n, D, generator=g, dtype=torch.float64)
    g64 = torch.randn(n, D, generator=g, dtype=torch.float64)
    # the reference's output and gradients, in float64
    xr = x64.clone().requires_grad_(True)
    y_ref = reference(ex64, xr, counts_E)
    params64 = [ex64.w_gate_EFD, ex64.w_up_EFD, ex64.w_down_EDF]
    grads_ref = torch.autograd.grad(y_ref, [xr, *params64], g64)
    tol = {torch.float32: 2e-5, torch.bfloat16: 4e-2}[dtype]
    results = {}
    for impl in ("loop", "grouped"):
        ex = make_experts(seed).to(dtype)
        ex.impl = impl
        y, grads = run(ex, x64.to(dtype), counts_E, g64)
        assert y.dtype == dtype and y.shape == (n, D)
        scale = max(1.0, float(y_ref.detach().abs().max()))
        torch.testing.assert_close(y.double(), y_ref, atol=tol * scale, rtol=tol)
        for got, want in zip(grads, grads_ref, strict=True):
            s = max(1.0, float(want.abs().max()))
            torch.testing.assert_close(got.double(), want, atol=tol * s, rtol=tol)
        results[impl] = (y, grads)
    # experts with no rows get exactly zero weight gradients on both paths
    for e, c in enumerate(counts_E):
        if c == 0:
            for impl in ("loop", "grouped"):
                for w_grad in results[impl][1][1:]:
                    assert bool((w_grad[e] == 0).all()), (impl, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "counts_E",
    [[7, 3, 12, 1, 9], [0, 11, 0, 5, 0], [0, 0, 23, 0, 0], [17, 0, 0, 0, 0], [0, 0, 0, 0, 6]],
    ids=["all-busy", "empty-experts", "one-expert-middle", "one-expert-first", "one-expert-last"],
)
def test_grouped_equals_loop_and_float64_reference(counts_E: list[int], dtype: torch.dtype) -> None:
    compare(counts_E, dtype)


def test_grouped_matches_loop_closely_in_float32() -> None:
    """Same dtype, same weights: the two paths agree to float32 rounding."""
    ex = make_experts(3).float()
    counts = [4, 0, 9, 2, 5]
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(4))
    g = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(5))
    ex.impl = "loop"
    y_loop, grads_loop = run(ex, x, counts, g)
    ex.impl = "grouped"
    y_grp, grads_grp = run(ex, x, counts, g)
    torch.testing.assert_close(y_grp, y_loop, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_grp, grads_loop, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_no_rows_at_all_and_sum_backward() -> None:
    ex = make_experts().float()
    ex.impl = "grouped"
    y = ex(torch.zeros(0, D), [0] * E)
    assert y.shape == (0, D)
    # out.sum().backward() sends a broadcast gradient, which _grouped_mm's backward refuses
    # unless it is made contiguous first
    x = torch.randn(6, D, requires_grad=True)
    ex(x, [1, 2, 0, 3, 0]).sum().backward()
    assert x.grad is not None and ex.w_down_EDF.grad is not None
    assert bool((ex.w_down_EDF.grad[2] == 0).all())


def test_counts_must_cover_rows() -> None:
    ex = make_experts().float()
    ex.impl = "grouped"
    with pytest.raises(ValueError, match="sums to 5"):
        ex(torch.randn(6, D), [1, 1, 1, 1, 1])


def test_layer_grouped_equals_loop() -> None:
    """The whole MoE layer (router, permute, experts, unpermute) on both paths."""
    torch.manual_seed(0)
    rc = RouterConfig(d_model=D, n_experts=E, top_k=2, map="softmax", renorm=True)
    moe = MoE(MoEConfig(d_model=D, d_ff=F, router=rc))
    x = torch.randn(2, 9, D)
    outs = {}
    for impl in ("loop", "grouped"):
        moe.experts.impl = impl
        xi = x.clone().requires_grad_(True)
        y, _ = moe(xi)
        (y.square().sum()).backward()
        outs[impl] = (y.detach(), xi.grad, moe.experts.w_up_EFD.grad.clone())
        moe.zero_grad(set_to_none=True)
    for a, b in zip(outs["grouped"], outs["loop"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cpu_autocast_runs_grouped_in_bf16() -> None:
    ex = make_experts().float()
    ex.impl = "grouped"
    x = torch.randn(8, D)
    with torch.autocast("cpu", torch.bfloat16):
        assert experts_mod.compute_dtype(x) == torch.bfloat16
        y = ex(x, [2, 2, 2, 1, 1])
    assert y.dtype == torch.bfloat16
    ex.impl = "loop"
    torch.testing.assert_close(y.float(), ex(x, [2, 2, 2, 1, 1]), atol=3e-2, rtol=3e-2)


def test_auto_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = experts_mod.resolve_impl
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # the CPU keeps the loop (grouped GEMM is not faster there), whatever the dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert resolve("auto", cpu, dtype, 16, 32) == "loop"
    monkeypatch.setattr(experts_mod, "_probe_cuda", lambda device: True)
    assert resolve("auto", cuda, torch.bfloat16, 16, 32) == "grouped"
    assert resolve("auto", cuda, torch.float32, 16, 32) == "loop"
    assert resolve("auto", cuda, torch.bfloat16, 12, 32) == "loop"  # 24-byte rows
    assert resolve("loop", cuda, torch.bfloat16, 16, 32) == "loop"
    monkeypatch.setattr(experts_mod, "_probe_cuda", lambda device: False)
    assert resolve("auto", cuda, torch.bfloat16, 16, 32) == "loop"
    monkeypatch.setattr(experts_mod, "_probe_cuda", lambda device: True)
    monkeypatch.setattr(experts_mod, "grouped_mm_available", lambda: False)
    assert resolve("auto", cuda, torch.bfloat16, 16, 32) == "loop"
    with pytest.raises(ValueError, match=r"torch\._grouped_mm"):
        resolve("grouped", cpu, torch.float32, 16, 32)


def test_forced_grouped_errors() -> None:
    resolve = experts_mod.resolve_impl
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="float64"):
        resolve("grouped", cpu, torch.float64, 16, 32)
    with pytest.raises(ValueError, match="multiples of 4"):
        resolve("grouped", cpu, torch.float32, 6, 32)
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve("fast", cpu, torch.float32, 16, 32)
    with pytest.raises(ValueError, match="impl must be one of"):
        SwiGLUExperts(E, D, F, impl="fast")
    ex = make_experts()  # float64: the forced grouped path says what to change
    ex.impl = "grouped"
    with pytest.raises(ValueError, match=r"impl='loop'"):
        ex(torch.randn(3, D, dtype=torch.float64), [3, 0, 0, 0, 0])
