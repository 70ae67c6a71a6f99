"""A swapped torchtitan MoE (1.5-entmax, z-loss) on 2 gloo ranks, each with half the
batch, gives one process's loss and gradients on the whole batch, in one spawn:

- under FSDP2 (``fully_shard``): the router reads the engine's gate weight while FSDP
  has it unsharded;
- with the engine's own expert parallelism (its all-to-all token dispatcher, the
  experts sharded over an ``ep`` mesh). torchtitan 0.3.0 builds its device mesh on
  ``torchtitan.tools.utils.device_type`` ("cuda" even without a GPU; set to "cpu"
  here) and its default SPMD backend ("spmd_types") reads a mesh its trainer sets; this
  runs the "partial_dtensor" backend, whose EP dispatcher takes the ep mesh's group.

torchtitan's experts compute in bfloat16: their gradients agree to that accuracy.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.integrations.torchtitan.tiny import build, moe_config
from tests.train import free_port, rank_env, spawn_ranks

KEYS = {"map": "entmax", "alpha": 1.5, "z_loss_weight": 0.1}


def _moe(expert_parallel: bool = False):
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

    # the squared error and the z-loss are means over tokens: the mean of the two
    # halves' is the whole batch's
    return (moe(x) - target).square().mean() + aux_loss(moe)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _mean_loss(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / 2


def _fsdp(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    moe = _moe()
    fully_shard(moe)  # averages the gradients over the ranks
    x, target = _data()
    half = slice(2 * rank, 2 * rank + 2)
    loss = _loss(moe, x[half], target[half])
    loss.backward()
    grads = {n: _full(p.grad) for n, p in moe.named_parameters()}
    return {"loss": _mean_loss(loss), "grads": grads}


def _expert_parallel(rank: int) -> dict:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

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
    moe = _moe(expert_parallel=True)
    moe.parallelize(dims)
    x, target = _data()
    half = slice(2 * rank, 2 * rank + 2)
    loss = _loss(moe, x[half], target[half])
    loss.backward()
    # the experts' gradients hold both ranks' losses (the all-to-all's backward); the
    # others this rank's, summed here as data parallelism would
    grads = {}
    for name, p in moe.named_parameters():
        g = _full(p.grad)
        if not (isinstance(p, DTensor) and name.startswith("routed_experts")):
            g = g.clone()
            dist.all_reduce(g)
        grads[name] = g / 2
    sharded = isinstance(moe.routed_experts.inner_experts.w1_EFD, DTensor)
    return {"loss": _mean_loss(loss), "grads": grads, "sharded": sharded}


def _rank(rank: int, port: int, out: str) -> None:
    rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = {"fsdp": _fsdp(rank), "ep": _expert_parallel(rank)}
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path: Path):
    out = tmp_path / "rank0.pt"
    spawn_ranks(_rank, (free_port(), str(out)), timeout_s=200)
    got = torch.load(out)
    assert got["ep"]["sharded"]
    moe = _moe()
    x, target = _data()
    loss = _loss(moe, x, target)
    loss.backward()
    gate = "router.gate.weight"
    for kind in ("fsdp", "ep"):
        run = got[kind]
        torch.testing.assert_close(run["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        assert set(run["grads"]) == {n for n, _ in moe.named_parameters()}
        torch.testing.assert_close(
            run["grads"][gate], moe.router.gate.weight.grad, rtol=1e-4, atol=1e-5
        )
        for name, p in moe.named_parameters():
            torch.testing.assert_close(run["grads"][name], p.grad, rtol=2e-2, atol=1e-3)
