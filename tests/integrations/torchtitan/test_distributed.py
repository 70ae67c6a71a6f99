"""torchtitan's ``MoE`` under its own expert parallelism on 2 gloo ranks (CPU) equals one
process on the ranks' concatenated batch: the outputs, the loss, the gradients of the
input, the router and the experts, the token counts of the loss-free bias; with the
engine's own router and with a swapped moelab router (1.5-entmax).

How torchtitan 0.3.0 runs on gloo (what the worker sets up, as the engine's trainer
would): the MoE's token dispatcher is the ``"standard"`` one (``AllToAllTokenDispatcher``:
``all_to_all_single`` with uneven splits, which gloo has); the sharding configs are
``set_moe_sharding_config(enable_ep=True)``; ``ParallelDims(dp_shard=2, ep=2)`` builds the
meshes and ``MoE.parallelize`` shards the experts (``Shard(0)`` over ``ep``) and wires
the dispatcher. Two things are not the engine's defaults:

- ``ParallelDims.build_mesh`` calls ``init_device_mesh(device_type, ...)`` with
  ``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a machine without an
  accelerator (``_get_available_device_type() or "cuda"``), and fails in
  ``torch.cuda.set_device`` ("module 'torch._C' has no attribute '_cuda_setDevice'");
  the worker sets ``torchtitan.distributed.parallel_dims.device_type = "cpu"``.
- the default ``parallelism.spmd_backend = "spmd_types"`` sends the tokens with
  ``spmd_types``' ``_AllToAllUneven``, i.e. ``dist.all_to_all`` on a list of unequal
  chunks, which gloo refuses ("ProcessGroupGloo::alltoall: invalid tensor size at index
  1 (expected (11, 16), got (13, 16))"); ``spmd_backend = "partial_dtensor"`` (a
  torchtitan setting) takes the functional ``all_to_all_single`` path, which runs.

The MoE module alone (no FSDP): the replicated router's gradient is each rank's share,
summed over the ranks as FSDP's reduce-scatter would. The whole model (a tiny torchtitan
Qwen3 MoE with 1.5-entmax routers) goes through torchtitan's own ``parallelize_qwen3``:
EP on the experts and FSDP2 (``fully_shard``) on every block, over the same 2 ranks. One
more setting there: torchtitan turns FSDP's gradient division off
(``set_gradient_divide_factor(1.0)``, it scales the loss by the global token count
itself), for which FSDP2 reduces with ``ReduceOp.PREMUL_SUM(1.0)``, which gloo lacks
("Cannot use ReduceOp.PREMUL_SUM with Gloo"); ``set_force_sum_reduction_for_comms(True)``
on the FSDP modules makes it a plain SUM (the same result: a factor of 1).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.train import free_port, rank_env, spawn_ranks

D, F, E, K = 16, 24, 4, 2
B_RANK, L = 2, 6  # sequences per rank, tokens per sequence
BIAS_E = (0.3, -0.2, 0.1, 0.0)  # a non-zero loss-free bias (the engine's expert_bias_E)
ROUTERS = {
    "engine": None,  # torchtitan's own TokenChoiceTopKRouter (softmax top-2)
    "entmax": {"map": "entmax", "alpha": 1.5},  # a swapped moelab Router
}
"""The routers compared: name -> swap_routers keys (None: the engine's own router)."""


def _moe_config():
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    def normal(std: float):
        return lambda t: torch.nn.init.normal_(t, std=std)

    experts = {name: normal(0.3) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return make_moe_config(
        num_experts=E,
        router=make_router_config(
            dim=D, num_experts=E, gate_param_init={"weight": normal(0.5)}, top_k=K,
            score_func="softmax",
        ),
        routed_experts=make_routed_experts_config(
            dim=D, hidden_dim=F, num_experts=E, top_k=K, param_init=experts,
            comm_backend="standard",
        ),
        load_balance_coeff=1e-3,
    )  # fmt: skip


def _ep_config():
    import spmd_types as spmd
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    cfg = _moe_config()
    set_moe_sharding_config(
        cfg,
        enable_ep=True,
        enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    return cfg


def _swap(moe: torch.nn.Module, keys: dict | None) -> None:
    if keys is not None:
        from moelab.integrations.torchtitan import swap_routers

        swap_routers(moe, **keys)


def _moe_case(dims, rank: int, world: int, keys: dict | None) -> dict[str, float]:
    """The MoE module alone under EP (``MoE.parallelize``) against one process: the max
    abs differences."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * B_RANK, L, D, generator=gen)
    g_all = torch.randn(world * B_RANK, L, D, generator=gen)
    own = slice(rank * B_RANK, (rank + 1) * B_RANK)
    torch.manual_seed(0)
    ref = _moe_config().build()
    ref.init_states()
    ref.expert_bias_E.copy_(torch.tensor(BIAS_E))
    _swap(ref, keys)
    state = copy.deepcopy(ref.state_dict())
    ep = _ep_config().build()
    _swap(ep, keys)
    ep.load_state_dict(state)
    ep.parallelize(dims)
    assert isinstance(ep.routed_experts.inner_experts.w1_EFD, DTensor)

    x_ref = x_all.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    loss_ref = (y_ref * g_all).sum()
    loss_ref.backward()
    x = x_all[own].clone().requires_grad_(True)
    y = ep(x)
    loss = (y * g_all[own]).sum()
    loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)

    diffs = {
        "y": (y - y_ref[own]).abs().max().item(),
        "x.grad": (x.grad - x_ref.grad[own]).abs().max().item(),
        "loss": abs(loss_sum.item() - loss_ref.item()),
    }
    grads = dict(ref.named_parameters())
    for pname, p in ep.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):  # the experts: each rank holds E / 2 of them
            assert g.to_local().shape[0] == E // world
            g = g.full_tensor()
        else:  # replicated (the router): each rank's tokens' share
            g = g.clone()
            dist.all_reduce(g)
        diffs[pname] = (g - grads[pname].grad).abs().max().item()
    counts = ep.tokens_per_expert_E.clone()
    dist.all_reduce(counts)
    torch.testing.assert_close(counts, ref.tokens_per_expert_E, rtol=0, atol=0)
    return diffs


def _model_case(dims, rank: int, world: int) -> dict[str, float]:
    """A whole torchtitan Qwen3 MoE model with 1.5-entmax routers, parallelised by
    torchtitan's own ``parallelize_qwen3`` (EP over ``ep``, FSDP2 over ``fsdp`` /
    ``efsdp``) against one process: the loss (the sum of the tokens' cross-entropy over
    the global token count, as torchtitan's trainer scales it) and every gradient."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    from tests.integrations.torchtitan.test_back_to_moelab import VOCAB, tiny_qwen3_moe

    torch.manual_seed(0)
    ref = tiny_qwen3_moe().build()
    ref.init_states()
    _swap(ref, ROUTERS["entmax"])
    cfg = tiny_qwen3_moe()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    model = cfg.build()
    _swap(model, ROUTERS["entmax"])
    model.load_state_dict(copy.deepcopy(ref.state_dict()))
    parallelize_qwen3(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32",
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                      data_parallel_shard_degree=world,
                                      expert_parallel_degree=world),
        compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="",
    )  # fmt: skip
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert fsdp
    for m in fsdp:  # NOTE: gloo has no PREMUL_SUM (torchtitan sets a divide factor of 1)
        m.set_force_sum_reduction_for_comms(True)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (world * B_RANK, 16), generator=gen)
    n = tokens[:, 1:].numel()

    def loss_of(net: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
        logits = net(t)[:, :-1].reshape(-1, VOCAB)
        return F.cross_entropy(logits, t[:, 1:].reshape(-1), reduction="sum") / n

    loss_ref = loss_of(ref, tokens)
    loss_ref.backward()
    loss = loss_of(model, tokens[rank * B_RANK : (rank + 1) * B_RANK])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    diffs = {"loss": abs(total.item() - loss_ref.item())}
    grads = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        assert isinstance(p, DTensor), pname  # FSDP2 (and EP) sharded every parameter
        diffs[pname] = (p.grad.full_tensor() - grads[pname].grad).abs().max().item()
    return diffs


def _worker(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
        from torchtitan.distributed.utils import set_spmd_backend
        from torchtitan.models.common import config_utils  # noqa: F401

        # NOTE: the model modules import torch's fake process group, which build_mesh
        # uses for its size-1 dimensions ("Unknown c10d backend type FAKE" without it)

        set_spmd_backend("partial_dtensor")
        parallel_dims.device_type = "cpu"  # NOTE: "cuda" on a machine without a GPU
        dims = parallel_dims.ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world,
            spmd_backend="partial_dtensor",
        )  # fmt: skip
        dims.build_mesh()
        figures = {name: _moe_case(dims, rank, world, keys) for name, keys in ROUTERS.items()}
        figures["qwen3 model, EP + FSDP2"] = _model_case(dims, rank, world)
        for name, diffs in figures.items():
            for what, d in diffs.items():
                assert d <= 1e-5, (name, what, d)
        if rank == 0:
            Path(out).write_text(json.dumps(figures, indent=1))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_expert_parallel_and_fsdp_on_two_gloo_ranks_equal_one_process(tmp_path) -> None:
    out = tmp_path / "figures.json"
    spawn_ranks(_worker, (2, free_port(), str(out)), world=2, timeout_s=120)
    figures = json.loads(out.read_text())
    print(json.dumps(figures))
    assert sorted(figures) == sorted([*ROUTERS, "qwen3 model, EP + FSDP2"])
