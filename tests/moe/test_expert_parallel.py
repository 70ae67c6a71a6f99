"""Expert parallelism (moelab.moe.expert_parallel): the MoE layer with its experts split
over 2 gloo ranks equals one process on the ranks' concatenated batch (outputs, the
gradients of x, the router and the experts, the capacity drop, the loss-free bias)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moelab import MoE, MoEConfig, RouterConfig
from moelab.moe.expert_parallel import (
    clip_grad_norm_,
    drop_from_group_counts,
    enable_expert_parallel,
    slot_expert_counts,
)
from moelab.routing import balancing
from tests.train import free_port, rank_env, spawn_ranks

T_RANK = 24  # tokens per rank
D, F = 8, 12


@pytest.mark.parametrize("n_experts", [4, 8, 11])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.3])
def test_group_drop_equals_capacity_drop_on_the_concatenated_batch(
    n_experts: int, capacity_factor: float
) -> None:
    """Every rank's share of the drop equals balancing.capacity_drop on the ranks'
    tokens concatenated in rank order (unequal T, unselected slots)."""
    gen = torch.Generator().manual_seed(n_experts)
    K, tokens_R = 2, [13, 7, 20]
    skew_E = 1.0 / torch.arange(1, n_experts + 1) ** 1.5  # a few experts overloaded
    ids = [torch.multinomial(skew_E, t * K, True, generator=gen).reshape(t, K) for t in tokens_R]
    routed = [torch.rand(t, K, generator=gen) < 0.8 for t in tokens_R]
    counts_RKE = torch.stack(
        [slot_expert_counts(i, r, n_experts) for i, r in zip(ids, routed, strict=True)]
    )
    ref = balancing.capacity_drop(torch.cat(ids), torch.cat(routed), n_experts, capacity_factor)
    parts = [
        drop_from_group_counts(i, r, counts_RKE, tokens_R, rank, n_experts, capacity_factor)
        for rank, (i, r) in enumerate(zip(ids, routed, strict=True))
    ]
    assert ref.any()
    torch.testing.assert_close(torch.cat(parts), ref, rtol=0, atol=0)


def _layer(n_experts: int, map_name: str, capacity_factor, bias_rate: float = 0.0) -> MoE:
    torch.manual_seed(n_experts)
    rc = RouterConfig(
        d_model=D,
        n_experts=n_experts,
        top_k=2,
        map=map_name,
        init_std=1.0,
        capacity_factor=capacity_factor,
        bias_rate=bias_rate,
    )
    return MoE(MoEConfig(d_model=D, d_ff=F, router=rc))


CASES = [  # (E, map, capacity factor, rank 1's experts never chosen)
    (4, "sparsemax", None, False),  # fillers: a token whose support is one expert
    (8, "softmax", None, False),
    (8, "sparsemax", None, False),
    (4, "softmax", 0.75, False),  # drops, counted over the group
    (8, "sparsemax", 0.6, False),
    (4, "softmax", None, True),  # rank 1's experts get no rows: its backward still meets
]


def _layer_worker(rank: int, world: int, port: int) -> None:
    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    try:
        for n_experts, map_name, cf, idle in CASES:
            ref = _layer(n_experts, map_name, cf)
            if idle:  # a selection bias that keeps every token off experts E/2..E-1
                ref.router.bias[n_experts // 2 :] = -1e4
            gen = torch.Generator().manual_seed(100 + n_experts)
            x_all = torch.randn(world * T_RANK, D, generator=gen)
            g_all = torch.randn(world * T_RANK, D, generator=gen)
            # one process on the concatenated batch; the loss of rank r is the sum
            # over its tokens, the reference the sum over all of them
            x_ref = x_all.clone().requires_grad_(True)
            y_ref, out_ref = ref(x_ref)
            (y_ref * g_all).sum().backward()
            if map_name == "sparsemax":
                assert out_ref.fillers_TK.any()
            if cf is not None:
                assert out_ref.dropped_TK.any()
            if idle:
                assert (out_ref.ids_TK[out_ref.computed_TK] < n_experts // 2).all()

            ep = copy.deepcopy(ref)
            ep.zero_grad()
            enable_expert_parallel(ep, mesh)
            own = slice(rank * T_RANK, (rank + 1) * T_RANK)
            x = x_all[own].clone().requires_grad_(True)
            y, out = ep(x)
            (y * g_all[own]).sum().backward()

            tol = dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y, y_ref[own], **tol)
            assert torch.equal(out.dropped_TK, out_ref.dropped_TK[own])
            torch.testing.assert_close(x.grad, x_ref.grad[own], **tol)
            # the router (replicated): the ranks' gradients sum to the reference
            router_grad = ep.router.weight.grad.clone()
            dist.all_reduce(router_grad)
            torch.testing.assert_close(router_grad, ref.router.weight.grad, **tol)
            # the experts: rank r holds experts r*E/R..; its gradient is that of the mean
            # of the group's losses (the reference / R)
            per = n_experts // world
            rows = slice(rank * per, (rank + 1) * per)
            for name in ("w_gate_EFD", "w_up_EFD", "w_down_EDF"):
                p_ep, p_ref = getattr(ep.experts, name), getattr(ref.experts, name)
                assert tuple(p_ep.shape) == tuple(p_ref.shape)  # the global shape
                torch.testing.assert_close(p_ep.to_local(), p_ref.detach()[rows], rtol=0, atol=0)
                torch.testing.assert_close(p_ep.grad.to_local(), p_ref.grad[rows] / world, **tol)
            # clipping sees the global norm of (router sum / R, experts / R) = reference / R
            ep.router.weight.grad.copy_(router_grad / world)
            params = [ep.router.weight, *ep.experts.parameters()]
            ref_params = [ref.router.weight, *ref.experts.parameters()]
            for p in ref_params:
                p.grad /= world
            total = clip_grad_norm_(params, 0.01)
            total_ref = torch.nn.utils.clip_grad_norm_(ref_params, 0.01)
            torch.testing.assert_close(total, total_ref, **tol)
            torch.testing.assert_close(
                ep.experts.w_up_EFD.grad.to_local(), ref.experts.w_up_EFD.grad[rows], **tol
            )
        _check_bias(rank, world, mesh)
    finally:
        dist.destroy_process_group()


def _check_bias(rank: int, world: int, mesh) -> None:
    """The loss-free bias of an EP layer moves as one process's on the global batch."""
    ref = _layer(8, "softmax", 1.0, bias_rate=0.05)
    ep = copy.deepcopy(ref)
    enable_expert_parallel(ep, mesh)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):  # three steps: the bias moves and then steers the selection
        x_all = torch.randn(world * T_RANK, D, generator=gen)
        _, out_ref = ref(x_all)
        # the reference's update from its own counts (its step would all-reduce them)
        load_E = balancing.expert_counts(out_ref.ids_TK, out_ref.chosen_TK, 8)
        ref.router.bias.copy_(balancing.bias_update(ref.router.bias, load_E, 0.05))
        _, out = ep(x_all[rank * T_RANK : (rank + 1) * T_RANK])
        ep.router.step(out)
        torch.testing.assert_close(ep.router.bias, ref.router.bias, rtol=0, atol=1e-7)
    assert ref.router.bias.abs().max() > 0


@pytest.mark.multiprocess
def test_layer_and_loss_free_bias_under_ep2_equal_one_process() -> None:
    """Two gloo ranks (one spawn for all the cases, to keep the test short)."""
    spawn_ranks(_layer_worker, (2, free_port()), world=2, timeout_s=90)


def test_enable_rejects_a_mesh_it_cannot_use() -> None:
    class Mesh:
        mesh_dim_names = ("dp",)

    with pytest.raises(ValueError, match="'ep' dimension"):
        enable_expert_parallel(_layer(4, "softmax", None), Mesh())  # type: ignore[arg-type]


def _mechanisms_worker(rank: int, world: int, port: int) -> None:
    """Constant null experts (MoE++) and input gating (Llama 4) under EP = 2, with drops:
    the same output and gradients as one process on the concatenated batch."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    try:
        torch.manual_seed(11)
        rc = RouterConfig(
            d_model=D, n_experts=4, top_k=2, init_std=1.0, capacity_factor=0.75,
            n_null_experts=2, null_expert="constant",
        )  # fmt: skip
        ref = MoE(MoEConfig(d_model=D, d_ff=F, router=rc, gate_on="input"))
        assert ref.constants is not None
        with torch.no_grad():
            ref.constants.w_MCD.normal_()
        gen = torch.Generator().manual_seed(12)
        x_all = torch.randn(world * T_RANK, D, generator=gen)
        g_all = torch.randn(world * T_RANK, D, generator=gen)
        x_ref = x_all.clone().requires_grad_(True)
        y_ref, out_ref = ref(x_ref)
        (y_ref * g_all).sum().backward()
        assert out_ref.dropped_TK.any() and out_ref.null_TK is not None and out_ref.null_TK.any()
        ep = copy.deepcopy(ref)
        ep.zero_grad()
        enable_expert_parallel(ep, mesh)
        own = slice(rank * T_RANK, (rank + 1) * T_RANK)
        x = x_all[own].clone().requires_grad_(True)
        y, _ = ep(x)
        (y * g_all[own]).sum().backward()
        tol = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y, y_ref[own], **tol)
        torch.testing.assert_close(x.grad, x_ref.grad[own], **tol)
        # the constant experts are replicated (as the router): the ranks' grads sum up
        for p_ep, p_ref in zip(ep.constants.parameters(), ref.constants.parameters(), strict=True):
            grad = p_ep.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, p_ref.grad, **tol)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_constant_null_experts_and_input_gating_under_ep2_equal_one_process() -> None:
    spawn_ranks(_mechanisms_worker, (2, free_port()), world=2, timeout_s=90)
