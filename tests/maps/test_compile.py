"""``torch.compile`` of code that calls the maps through the fused CPU kernels.

The kernels are C++ ops without fake-tensor implementations, which a compiler cannot
trace; ``moelab.maps._kernels`` wraps each in an opaque custom op with a fake
implementation. Checked here: every op has one, each wrapped op passes
``torch.library.opcheck`` (fake against real outputs, schema, AOT dispatch), and
compiled calls of the ops, the maps, a Router and an MoE layer agree with eager mode,
forward and backward.

The sparse maps and the Router compile to one graph (``fullgraph=True``; every map and
selection rule through the Router: tests/routing/test_router_compile.py). LapSum with a
tensor temperature and the MoE layer (the dispatch's one host sync) still break the
graph, so those tests compile with ``fullgraph=False``; each checks that the result
equals eager mode, and the map tests that the kernels were traced into the graphs rather
than run outside them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from moelab import MoE, MoEConfig, Router, RouterConfig, RouterOutput, maps
from moelab.maps import _kernels

pytestmark = pytest.mark.skipif(
    maps.backend() != "cpu-kernels", reason="the CPU kernels are not built on this machine"
)

DTYPES = [torch.float32, torch.float64]
KERNEL_OPS = {
    "sparsemax_forward",
    "entmax15_forward",
    "normmax2_forward",
    "sparsemax_backward",
    "entmax15_backward",
    "normmax2_backward",
    "lapsum_forward",
    "lapsum_backward",
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _raw(name: str) -> Callable[..., object]:
    return getattr(torch.ops.moelab_maps, name)


def _sample_args(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Valid inputs of the kernel op ``name``: 5 rows of 7 scores."""
    z = torch.randn(5, 7, generator=_gen(1), dtype=dtype)
    g = torch.randn(5, 7, generator=_gen(2), dtype=dtype)
    k = torch.full((5,), 2.0, dtype=dtype)
    t = torch.full((5,), 0.5, dtype=dtype)
    kernel, _, direction = name.rpartition("_")
    if kernel == "lapsum":
        if direction == "forward":
            return z, k, t
        p = _raw("lapsum_forward")(z, k, t)[0]
        return p, g, t
    if direction == "forward":
        return (z,)
    return _raw(f"{kernel}_forward")(z)[0], g


def test_every_kernel_op_has_a_fake_and_an_opaque_wrapper() -> None:
    schemas = _kernels.kernel_op_schemas()
    assert KERNEL_OPS <= set(schemas)
    missing = sorted(set(schemas) - set(_kernels.FAKES))
    assert not missing, f"kernel ops without a fake implementation in _kernels.FAKES: {missing}"
    for name, schema in schemas.items():
        wrapped = getattr(torch.ops.moelab_maps_opaque, name).default
        assert str(wrapped._schema) == f"moelab_maps_opaque::{schema}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(KERNEL_OPS))
def test_opaque_op_passes_opcheck(name: str, dtype: torch.dtype) -> None:
    op = getattr(torch.ops.moelab_maps_opaque, name)
    args = _sample_args(name, dtype)
    torch.library.opcheck(op, args)
    # and the wrapper computes what the C++ op computes
    for got, want in zip(
        torch.utils._pytree.tree_leaves(op(*args)),
        torch.utils._pytree.tree_leaves(_raw(name)(*args)),
        strict=True,
    ):
        assert torch.equal(got, want)


def _kernel_pipeline(z: torch.Tensor, g: torch.Tensor, k: torch.Tensor, t: torch.Tensor):
    """Every kernel op through ``_kernels.ops()``, as the maps call them."""
    ops = _kernels.ops()
    outs = []
    for kernel in ("sparsemax", "entmax15", "normmax2"):
        p, status = getattr(ops, f"{kernel}_forward")(z)
        outs += [p, status, getattr(ops, f"{kernel}_backward")(p, g)]
    p, x, status = ops.lapsum_forward(z, k, t)
    dz, dk = ops.lapsum_backward(p, g, t)
    return [*outs, p, x, status, dz, dk]


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("aot_eager", torch.float32), ("aot_eager", torch.float64), ("inductor", torch.float64)],
)
def test_compiled_kernel_ops_fullgraph(backend: str, dtype: torch.dtype) -> None:
    z, k, t = _sample_args("lapsum_forward", dtype)
    g = _sample_args("lapsum_backward", dtype)[1]
    compiled = torch.compile(_kernel_pipeline, backend=backend, fullgraph=True)
    for got, want in zip(compiled(z, g, k, t), _kernel_pipeline(z, g, k, t), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparsemax": lambda z: maps.sparsemax(z, dim=1),
    "entmax15": lambda z: maps.entmax(z, 1.5, dim=1),
    "normmax2": lambda z: maps.normmax(z, 2.0, dim=1),
    "lapsum": lambda z: maps.lapsum(z, 2.0, temperature=0.5, dim=1),
}


class _Graphs:
    """A torch.compile backend that runs each captured graph as it is (eagerly,
    after AOT autograd's tracing) and records the ops in it."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.common import aot_autograd

        def record(g: torch.fx.GraphModule, _: list) -> Callable:
            self.targets += [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
            return g.forward

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)


def _forward_backward(fn: Callable, z: torch.Tensor, g: torch.Tensor):
    x = z.clone().requires_grad_(True)
    p = fn(x)
    (p * g).sum().backward()
    return p.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MAPS))
def test_compiled_map_matches_eager(name: str, dtype: torch.dtype) -> None:
    z = torch.randn(3, 6, 4, generator=_gen(3), dtype=dtype)  # experts along dim 1
    g = torch.randn(z.shape, generator=_gen(4), dtype=dtype)
    graphs = _Graphs()
    compiled = torch.compile(MAPS[name], backend=graphs)
    p, dz = _forward_backward(compiled, z, g)
    p_eager, dz_eager = _forward_backward(MAPS[name], z, g)
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p, p_eager, **tol)
    torch.testing.assert_close(dz, dz_eager, **tol)
    kernel = "lapsum" if name == "lapsum" else name
    assert f"moelab_maps_opaque.{kernel}_forward.default" in graphs.targets
    assert f"moelab_maps_opaque.{kernel}_backward.default" in graphs.targets


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "normmax2"])
def test_sparse_map_compiles_to_one_graph(name: str) -> None:
    """Forward and backward of a sparse map in one graph (fullgraph=True): the kernels
    trace, and no host-read input check runs under compilation."""
    z = torch.randn(4, 6, generator=_gen(10), dtype=torch.float64)
    g = torch.randn(4, 6, generator=_gen(11), dtype=torch.float64)
    compiled = torch.compile(MAPS[name], backend="aot_eager", fullgraph=True)
    p, dz = _forward_backward(compiled, z, g)
    p_eager, dz_eager = _forward_backward(MAPS[name], z, g)
    torch.testing.assert_close(p, p_eager, rtol=0, atol=0)
    torch.testing.assert_close(dz, dz_eager, rtol=0, atol=0)


def test_compiled_lapsum_with_tensor_k_and_temperature() -> None:
    """Gradients for k and t too (the temperature's takes the PyTorch backward)."""
    z = torch.randn(4, 6, generator=_gen(5), dtype=torch.float64)
    g = torch.randn(4, 6, generator=_gen(6), dtype=torch.float64)

    def run(fn_compile: bool) -> list[torch.Tensor]:
        x = z.clone().requires_grad_(True)
        k = torch.full((4,), 2.5, dtype=torch.float64, requires_grad=True)
        t = torch.full((4,), 0.7, dtype=torch.float64, requires_grad=True)
        fn = maps.lapsum
        if fn_compile:
            fn = torch.compile(fn, backend="aot_eager")
        p = fn(x, k, t)
        (p * g).sum().backward()
        return [p.detach(), x.grad, k.grad, t.grad]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _router_config(map_name: str) -> RouterConfig:
    if map_name == "lapsum":
        return RouterConfig(
            d_model=8,
            n_experts=6,
            map="lapsum",
            lapsum_k=2.0,
            selection="threshold",
            threshold=0.05,
            cap_factor=2.0,
        )
    return RouterConfig(d_model=8, n_experts=6, map=map_name, top_k=2)


@pytest.mark.parametrize("map_name", ["sparsemax", "entmax", "lapsum"])
def test_compiled_router_forward_backward(map_name: str) -> None:
    torch.manual_seed(0)
    router = Router(_router_config(map_name))
    twin = copy.deepcopy(router)
    tokens = torch.randn(10, 8, generator=_gen(8))
    g = torch.randn(10, 6, generator=_gen(9))

    def run(module: torch.nn.Module) -> tuple[RouterOutput, torch.Tensor]:
        x = tokens.clone().requires_grad_(True)
        out = module(x)
        loss = (out.probs_TE * g).sum() + out.weights_TK.square().sum() + out.aux_loss
        loss.backward()
        assert x.grad is not None
        return out, x.grad

    out_c, dx_c = run(torch.compile(twin, backend="aot_eager", fullgraph=True))
    out_e, dx_e = run(router)
    torch.testing.assert_close(out_c.probs_TE, out_e.probs_TE)
    assert torch.equal(out_c.ids_TK, out_e.ids_TK)
    assert torch.equal(out_c.selected_TK, out_e.selected_TK)
    torch.testing.assert_close(out_c.weights_TK, out_e.weights_TK)
    torch.testing.assert_close(dx_c, dx_e)
    assert twin.weight.grad is not None and router.weight.grad is not None
    torch.testing.assert_close(twin.weight.grad, router.weight.grad)


def test_compiled_moe_forward_backward() -> None:
    """A whole MoE layer with a truncating LapSum router (graph breaks in the
    dispatch are allowed: fullgraph=False)."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=8, d_ff=12, router=_router_config("lapsum")))
    twin = copy.deepcopy(moe)
    x = torch.randn(2, 5, 8, generator=_gen(7))

    def loss(module: torch.nn.Module) -> torch.Tensor:
        y, out = module(x)
        return y.square().sum() + out.probs_TE.square().sum() + out.aux_loss

    compiled_loss, eager_loss = loss(torch.compile(twin, backend="aot_eager")), loss(moe)
    compiled_loss.backward()
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(moe.named_parameters(), twin.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
