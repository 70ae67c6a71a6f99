"""Data-parallel training across processes (``torchrun``): process group, rank helpers
and reductions. The training loop calls these; the model code knows nothing of them.

Under ``torchrun`` the environment holds RANK, WORLD_SIZE and LOCAL_RANK; the process
group uses gloo on CPU and nccl on CUDA. Without them everything here is a no-op for a
single process (rank 0 of 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "init_distributed",
    "local_world_size",
    "max_over_ranks",
    "shutdown",
    "unwrap",
    "wrap",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank, the number of processes, its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        """True when there is more than one process (a process group is running)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files."""
        return self.rank == 0


def _launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_distributed(device: str = "auto") -> DistInfo:
    """Pick the device and, under torchrun with WORLD_SIZE > 1, start the process group
    (nccl on CUDA, gloo on CPU). ``device``: "auto", "cpu" or "cuda" (ValueError when
    torch sees no CUDA GPU)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(  # the user's to change: a ValueError, as other bad settings
            "device=cuda but torch.cuda.is_available() is False (no CUDA GPU, or a torch "
            "built without CUDA); use device=cpu or device=auto"
        )
    if not _launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op for one process)."""
    if info.enabled:
        dist.barrier()


def all_reduce_mean(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """The mean of each value over the ranks (the values themselves for one process)."""
    if not info.enabled or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= info.world_size
    return dict(zip(keys, t.tolist(), strict=True))


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum over the ranks of each rank's ``t`` (a new tensor; ``t`` itself for one
    process)."""
    if not info.enabled:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on each), stacked: shape ``(world, *t.shape)``
    (``t[None]`` for one process)."""
    if not info.enabled:
        return t[None]
    parts = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def max_over_ranks(value: int, info: DistInfo) -> int:
    """The largest of each rank's ``value`` (the value itself for one process): e.g. a
    stop request that one rank received, so that every rank stops at the same step."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def local_world_size() -> int:
    """Processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without
    torchrun): they share its cores."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))), 1)


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    """DistributedDataParallel around ``model`` when several ranks run, else the model."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.local_rank] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside a DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group started by :func:`init_distributed`."""
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
