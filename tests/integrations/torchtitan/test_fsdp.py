"""A swapped torchtitan MoE under FSDP2 (``fully_shard``) on 2 gloo ranks, each with
half the batch: the loss and the gradients equal one process on the whole batch (the
router reads the engine's gate weight while FSDP has it unsharded)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.integrations.torchtitan.tiny import build, moe_config
from tests.train import free_port, rank_env, spawn_ranks

KEYS = {"map": "entmax", "alpha": 1.5, "z_loss_weight": 0.1}


def _model_and_data():
    from moelab.integrations.torchtitan import swap_routers

    moe = build(moe_config(top_k=2))
    swap_routers(moe, **KEYS)
    g = torch.Generator().manual_seed(11)
    return moe, torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)


def _loss(moe, x, target):
    from moelab.integrations.torchtitan import aux_loss

    # z-loss and the squared error are means over tokens: the mean of the two halves'
    # is the whole batch's, as FSDP averages the gradients
    return (moe(x) - target).square().mean() + aux_loss(moe)


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        moe, x, target = _model_and_data()
        fully_shard(moe)
        half = slice(2 * rank, 2 * rank + 2)
        loss = _loss(moe, x[half], target[half])
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in moe.named_parameters()}
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            torch.save({"loss": total / 2, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def test_fsdp_two_ranks_equal_one_process(tmp_path: Path):
    out = tmp_path / "rank0.pt"
    spawn_ranks(_rank, (free_port(), str(out)), timeout_s=150)
    got = torch.load(out)
    moe, x, target = _model_and_data()
    loss = _loss(moe, x, target)
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=1e-7)
    assert set(got["grads"]) == {n for n, _ in moe.named_parameters()}
    gate = "router.gate.weight"
    torch.testing.assert_close(
        got["grads"][gate], moe.router.gate.weight.grad, rtol=1e-5, atol=1e-6
    )
    for name, p in moe.named_parameters():  # the experts run in bfloat16
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=2e-2, atol=1e-3)
