"""A swapped torchtitan MoE with the engine's own expert parallelism (its all-to-all
token dispatcher, the experts sharded over an ``ep`` mesh) on 2 gloo ranks, each with
half the batch: the loss and the gradients equal one process on the whole batch.

torchtitan 0.3.0 builds its device mesh on ``torchtitan.tools.utils.device_type``
("cuda" even without a GPU; the CPU mesh here sets it to "cpu") and its default SPMD
backend ("spmd_types") reads a mesh its trainer sets; this test runs the
"partial_dtensor" backend, whose EP dispatcher takes the ep mesh's process group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.integrations.torchtitan.tiny import build, moe_config
from tests.train import free_port, rank_env, spawn_ranks

KEYS = {"map": "entmax", "alpha": 1.5, "z_loss_weight": 0.1}


def _moe(expert_parallel: bool):
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.deepseek_v3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    from moelab.integrations.torchtitan import swap_routers

    cfg = moe_config(top_k=2)
    if expert_parallel:
        set_moe_sharding_config(
            cfg, enable_ep=True, enable_sp=False, expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT
        )
    moe = build(cfg)
    swap_routers(moe, **KEYS)
    return moe


def _data():
    g = torch.Generator().manual_seed(12)
    return torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)


def _loss(moe, x, target):
    from moelab.integrations.torchtitan import aux_loss

    return (moe(x) - target).square().mean() + aux_loss(moe)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank(rank: int, port: int, out: str) -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

    rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        parallel_dims.device_type = "cpu"
        dist_utils.set_spmd_backend("partial_dtensor")
        dims = parallel_dims.ParallelDims(
            dp_replicate=1,
            dp_shard=2,
            cp=1,
            tp=1,
            pp=1,
            ep=2,
            world_size=2,
            spmd_backend="partial_dtensor",
        )
        dims.build_mesh()
        moe = _moe(True)
        moe.parallelize(dims)
        x, target = _data()
        half = slice(2 * rank, 2 * rank + 2)
        loss = _loss(moe, x[half], target[half])
        loss.backward()
        # the experts' gradients hold both ranks' losses (the all-to-all's backward);
        # the router's hold this rank's: summed here, as data parallelism would
        grads = {}
        for name, p in moe.named_parameters():
            g = _full(p.grad)
            if not isinstance(p, DTensor) or not name.startswith("routed_experts"):
                g = g.clone()
                dist.all_reduce(g)
            grads[name] = g / 2
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            torch.save(
                {
                    "loss": total / 2,
                    "grads": grads,
                    "sharded": isinstance(moe.routed_experts.inner_experts.w1_EFD, DTensor),
                },
                out,
            )
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_ranks_equal_one_process(tmp_path: Path):
    out = tmp_path / "rank0.pt"
    spawn_ranks(_rank, (free_port(), str(out)), timeout_s=150)
    got = torch.load(out)
    assert got["sharded"]
    moe = _moe(False)
    x, target = _data()
    _loss(moe, x, target).backward()
    with torch.no_grad():
        expected = _loss(moe, x, target)
    torch.testing.assert_close(got["loss"], expected, rtol=1e-5, atol=1e-6)
    gate = "router.gate.weight"
    torch.testing.assert_close(
        got["grads"][gate], moe.router.gate.weight.grad, rtol=1e-4, atol=1e-5
    )
    for name, p in moe.named_parameters():  # the experts run in bfloat16
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=2e-2, atol=1e-3)
