"""The parallel mode of a training run, chosen here and nowhere else.

:func:`setup` takes the bare model and the run's settings (``TrainConfig.parallel``,
``ep``, ``compile``, ``checkpoint_activations``) and returns a :class:`Parallel`: the
module the loop calls, and the few operations whose work depends on the mode (gathering
and loading the full state for a checkpoint, reading the routers' weights between
steps). The training loop calls :func:`setup` once and never asks which mode runs.

Modes (``torchrun --nproc-per-node N -m moelab train ... --parallel MODE``):

* one process (no torchrun, or WORLD_SIZE = 1): the bare model, whatever ``parallel``
  says (a one-rank FSDP shards nothing); ``ep`` must be 1.
* ``ddp``: DistributedDataParallel (moelab.train.distributed.wrap): every rank holds
  the whole model and the optimiser state, gradients are all-reduced.
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on a device mesh: each
  router (and the learned-allocation module) is its own unit, then each transformer
  block, then the root (embedding, final norm, output projection). Parameters,
  gradients and AdamW's state are sharded over the ranks; a block's parameters are
  gathered for its forward and backward. On CUDA the blocks compute with bf16
  parameters and reduce gradients in fp32 (``MixedPrecisionPolicy``), the routers and
  the allocator keep fp32 parameters.
* ``ep > 1`` (with ``fsdp``): the mesh has dimensions ("dp", "ep") of sizes
  (world / ep, ep) and ``moelab.moe.expert_parallel.enable_expert_parallel(model,
  mesh)`` shards each MoE layer's experts over "ep" before FSDP wraps the blocks.
  Expert parallelism composes with FSDP only: with ``parallel`` left unset (None, no
  ``--parallel``) the mode is ``ddp``, or ``fsdp`` when ``ep > 1``, which rank 0 says
  once (:func:`choose_mode`).

Per block, before wrapping: activation checkpointing (``checkpoint_activations``:
``torch.utils.checkpoint``, non-reentrant, the block's forward recomputed in the
backward pass) and ``torch.compile`` (``compile``: ``Module.compile()`` in place, so
parameter names, hence checkpoints, are the same as eager ones).

Checkpoints are the same files in every mode (moelab.runs.checkpoints): under FSDP the
full state is gathered to rank 0 on the CPU (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True``) and the
optimiser's state is keyed by parameter index as ``torch.optim.Optimizer.state_dict``
keys it; loading gives every rank the full state and keeps its shard
(``set_model_state_dict`` / ``set_optimizer_state_dict``). A run saved in one mode
resumes in another.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed as D

__all__ = ["Parallel", "choose_mode", "compile_blocks", "setup"]


@dataclass
class Parallel:
    """The parallel mode of a run (built by :func:`setup`)."""

    mode: str
    """"single" (one process), "ddp" or "fsdp"."""
    info: D.DistInfo
    model: nn.Module
    """The bare model (under FSDP the same object, its parameters sharded)."""
    module: nn.Module
    """What the training step calls: the DDP wrapper, else the model itself."""
    mesh: Any = None
    """The DeviceMesh under FSDP (dimension "dp", and "ep" with expert parallelism)."""
    ep: int = 1
    """Ranks of an expert-parallel group (1: none)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global 2-norm (over every rank's share) is
        at most ``max_norm``; returns the norm before clipping. Under expert
        parallelism the gradients live on two meshes, which torch's function refuses:
        moelab.moe.expert_parallel.clip_grad_norm_ counts them."""
        if self.ep > 1:
            from moelab.moe.expert_parallel import clip_grad_norm_

            return clip_grad_norm_(self.model.parameters(), max_norm)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    @contextlib.contextmanager
    def routers_gathered(self) -> Iterator[None]:
        """Within ``with``: every router's (and the layer allocator's) parameters are
        whole tensors on every rank, for what runs between steps (the routers' step,
        their logged state). Collective under FSDP: every rank must enter."""
        units = _gather_units(self.model) if self.mode == "fsdp" else []
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def full_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The model's state dict and the optimiser's (as ``Optimizer.state_dict()``
        gives them: state keyed by parameter index), whole, on CPU, on rank 0; (None,
        None) on the other ranks. Collective under FSDP: every rank must call it."""
        if self.mode != "fsdp":
            if not self.info.is_main:
                return None, None
            return self.model.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=options)
        optim_sd = get_optimizer_state_dict(self.model, optimizer, options=options)
        if not self.info.is_main:
            return None, None
        return dict(model_sd), _indexed(optim_sd, _param_names(self.model, optimizer))

    def load_full_state(
        self,
        optimizer: torch.optim.Optimizer | None,
        tensors: dict[str, torch.Tensor] | None,
        extra_state: dict[str, Any],
        optim_sd: dict[str, Any] | None,
        source: str | Path = "the checkpoint",
    ) -> None:
        """Load a checkpoint's whole state (every rank passes the same) into the model
        and ``optimizer``: ``tensors`` are the model's tensors (read from ``source``,
        named in errors), ``extra_state`` the modules' extra state (state.json),
        ``optim_sd`` as ``Optimizer.state_dict()``. Collective under FSDP. A tensor of
        another shape than the model's raises CheckpointError before anything loads."""
        from moelab.runs.checkpoints import check_model_keys, check_model_shapes, set_extra_states

        if tensors is not None:
            # NOTE: under FSDP a parameter is a DTensor whose shape is the whole tensor's
            check_model_shapes(self.model.state_dict(), tensors, source)
        if self.mode != "fsdp":
            if tensors is not None:
                missing, unexpected = self.model.load_state_dict(tensors, strict=False)
                check_model_keys(missing, unexpected, extra_state)
                set_extra_states(self.model, extra_state)
            if optimizer is not None and optim_sd is not None:
                optimizer.load_state_dict(optim_sd)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        if tensors is not None:
            names = set(self.model.state_dict())
            missing = sorted(names - set(tensors))
            unexpected = sorted(set(tensors) - names)
            check_model_keys(missing, unexpected, extra_state)
            # NOTE: in the model's order on every rank: the tensors are scattered one by
            # one, and a safetensors file's keys come in an order of their own per
            # process; the modules' extra state goes along (else a placeholder would)
            full = {**extra_state, **tensors}
            ordered = {k: full[k] for k in self.model.state_dict() if k in full}
            set_model_state_dict(self.model, ordered, options=options)
        if optimizer is not None and optim_sd is not None:
            named = _named(optim_sd, _param_names(self.model, optimizer))
            set_optimizer_state_dict(self.model, optimizer, named, options=options)


def _router_units(model: nn.Module) -> list[nn.Module]:
    """The routers and the layer allocator: FSDP units of their own (:func:`setup`)."""
    units: list[nn.Module] = [layer.router for layer in getattr(model, "moe_layers", [])]
    if getattr(model, "allocator", None) is not None:
        units.append(model.allocator)
    return units


def _gather_units(model: nn.Module) -> list[Any]:
    """The FSDP units :meth:`Parallel.routers_gathered` gathers."""
    return [u for u in _router_units(model) if hasattr(u, "unshard")]


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer``, in the order of its param groups:
    the index ``Optimizer.state_dict()`` gives the parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _indexed(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A state dict keyed by parameter name (the DCP helpers') keyed by index instead."""
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return {"state": {index[n]: s for n, s in sd["state"].items()}, "param_groups": groups}


def _named(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_indexed` (the state in parameter order, the same on every
    rank, whatever the order of ``sd``)."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    by_index = {int(i): s for i, s in sd["state"].items()}
    state = {
        names[i]: {k: by_index[i][k] for k in sorted(by_index[i])}
        for i in range(len(names))
        if i in by_index
    }
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------ setup


def choose_mode(parallel: str | None, ep: int, world: int) -> tuple[str, str | None]:
    """The mode of a run of ``world`` ranks (``"single"``, ``"ddp"`` or ``"fsdp"``)
    from its ``parallel`` setting (None: not chosen) and ``ep``, and the line that
    says why when the setting did not name it (else None)."""
    if world == 1:
        return "single", None
    if parallel is not None:
        return parallel, None
    if ep > 1:
        return "fsdp", (
            f"ep = {ep}: expert parallelism composes with FSDP only, so the ranks shard "
            "the model with FSDP (--parallel fsdp)"
        )
    return "ddp", None


def setup(model: nn.Module, config: Any, info: D.DistInfo) -> Parallel:
    """Prepare ``model`` (a moelab Transformer on ``info.device``) for the run's parallel
    mode: activation checkpointing and compilation per block when asked, then the
    wrapping of ``config.parallel`` (see the module docstring). Call it before the
    optimiser is built (FSDP replaces the parameters by sharded ones).

    Raises:
        ValueError: ``config.ep`` does not divide the number of ranks, or asks for
            expert parallelism in one process.
        NotImplementedError: ``ep > 1`` while moelab.moe.expert_parallel has no
            ``enable_expert_parallel`` yet.
    """
    world = info.world_size
    if world % config.ep:
        raise ValueError(
            f"ep = {config.ep} does not divide the {world} rank(s); launch a multiple of "
            f"{config.ep} ranks (torchrun --nproc-per-node) or change --ep"
        )
    if config.checkpoint_activations:
        for block in model.blocks:
            _checkpoint_block(block)
    if config.compile:
        compile_blocks(model)
    mode, why = choose_mode(config.parallel, config.ep, world)
    if why is not None and info.is_main:
        print(why, file=sys.stderr, flush=True)
    if mode == "single":
        return Parallel("single", info, model, model)
    if mode == "ddp":
        return Parallel("ddp", info, model, D.wrap(model, info))
    return _fully_shard(model, config, info)


def compile_blocks(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.compile`` each transformer block of ``model`` in place
    (``Module.compile(**kwargs)``: parameter names stay those of the eager model), as
    ``TrainConfig.compile`` does; returns ``model``. Under compile an MoE block traces
    into one graph (`moelab.moe.layer.MoE` takes the dispatch without host read)."""
    for block in model.blocks:
        block.compile(**kwargs)
    return model


def _checkpoint_block(block: nn.Module) -> None:
    """Recompute ``block``'s forward in the backward pass (its parameter names stay)."""
    from torch.utils.checkpoint import checkpoint

    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward  # type: ignore[method-assign]


def _fully_shard(model: nn.Module, config: Any, info: D.DistInfo) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            MixedPrecisionPolicy,
            fully_shard,
        )

    world, ep = info.world_size, config.ep
    kind = info.device.type
    if ep > 1:
        mesh = init_device_mesh(kind, (world // ep, ep), mesh_dim_names=("dp", "ep"))
        _enable_expert_parallel(model, mesh)
        dense_mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    else:
        mesh = dense_mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    if kind == "cuda":
        blocks_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fp32_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    else:
        blocks_mp = fp32_mp = MixedPrecisionPolicy()
    # NOTE: routers and the allocator first, as units of their own: they keep fp32
    # parameters under the blocks' bf16, and routers_gathered() gathers only them.
    for unit in _router_units(model):
        fully_shard(unit, mesh=dense_mesh, mp_policy=fp32_mp)
    ignored: set[nn.Parameter] | None = None
    if ep > 1:
        # NOTE: each rank of an "ep" group holds other experts: they are sharded over
        # "dp" only (the ranks that hold the same experts), or left out of FSDP when
        # the group spans every rank
        experts = [layer.experts for layer in model.moe_layers]
        if world // ep > 1:
            for module in experts:
                fully_shard(module, mesh=mesh["dp"], mp_policy=blocks_mp)
        else:
            ignored = {p for module in experts for p in module.parameters()}
    for block in model.blocks:
        fully_shard(block, mesh=dense_mesh, mp_policy=blocks_mp, ignored_params=ignored)
    fully_shard(model, mesh=dense_mesh, mp_policy=blocks_mp)
    return Parallel("fsdp", info, model, model, mesh, ep)


def _enable_expert_parallel(model: nn.Module, mesh: Any) -> None:
    try:
        from moelab.moe.expert_parallel import enable_expert_parallel
    except ImportError:
        raise NotImplementedError(
            "expert parallelism (--ep > 1) is not available in this moelab yet "
            "(moelab.moe.expert_parallel.enable_expert_parallel is missing); run with --ep 1"
        ) from None
    enable_expert_parallel(model, mesh)
