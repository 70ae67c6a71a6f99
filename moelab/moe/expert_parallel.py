"""Expert parallelism: the experts of every MoE layer split over the ranks of the
``ep`` dimension of a device mesh, the token rows sent to their experts' ranks and
back with the autograd-aware all-to-all.

Shape suffixes: T, D, E, K, N, R, X, Q (moelab.shapes).

`enable_expert_parallel` (called once, by ``moelab.train.parallel``, before the model
is wrapped and the optimiser built) does three things to each `MoE` layer:

1. **Shards the experts.** The stacked weights of `SwiGLUExperts` become DTensors
   placed ``Shard(0)`` on ``mesh["ep"]``: rank r of the EP group holds experts
   ``r * X .. (r + 1) * X - 1``. The global shapes stay (E, F, D), so the
   full-state-dict helpers of ``torch.distributed.checkpoint.state_dict``
   (``get_model_state_dict`` / ``set_model_state_dict`` with ``full_state_dict=True``)
   gather them on save and scatter them on load, and a checkpoint holds the same
   tensors whatever the parallelism; FSDP2's ``fully_shard`` can shard them further on
   the "dp" dimension (DTensors of one parent mesh). `SwiGLUExperts` computes with the
   local shard (``stacked_weights``).
2. **Installs the dispatch** (`ExpertParallelDispatch`) at the layer's seam between
   ``permute`` and ``unpermute`` (``MoE.expert_dispatch``, None in one process): the
   block sizes are exchanged first (one ``all_to_all_single`` of R x X counts, read on
   the host), then the rows go to their experts' ranks with
   ``all_to_all_single_autograd``, the local experts run on them grouped by expert, and
   the outputs come back the same way, in the order ``permute`` made. Fillers, dropped
   and unselected slots never leave their rank (``permute`` keeps only computed slots).
3. **Counts capacity over the EP group.** With ``RouterConfig.capacity_factor`` the
   group's R ranks share each expert's capacity C = capacity(sum of the ranks' T, K,
   E, factor): the slots dropped are those of one process on the group's concatenated
   batch (rank-major token order; first choices before second), from an all-gather of
   each rank's per-(slot, expert) counts (`group_capacity_drop`). The layer replaces the
   router's per-rank ``dropped_TK`` with it before ``permute``. Every rank of the group
   routes with the same K.

Gradients. Rank r's loss is the mean over its own micro-batch; a data-parallel wrapper
averages the gradients of the parameters every rank holds. An expert's gradient
arrives on its rank from the tokens of all R ranks (through the all-to-all's backward),
so the dispatch scales it by 1/R: after the backward each rank holds the gradient of
the mean of its group's losses, and averaging it over the "dp" dimension (FSDP2 on
``mesh["dp"]``) gives that of the global batch, the same as one process on it. The
dense parameters (attention, router, norms, embeddings) see only their rank's tokens
and must be averaged over every rank (dp x ep). The scaling (1/R on the expert
gradients, R on the rows' gradients) is exact for R a power of two.

A rank whose experts receive no rows still takes part in every collective of the
backward: `SwiGLUExperts` on zero rows returns a function of its input and weights
(zero gradients), so the all-to-all's backward and FSDP's gradient reduction run on
every rank alike.

Router statistics, the loss-free bias and the global balance loss already use the
default process group (``balancing.global_load``): every rank of a dp x ep world
routes its own micro-batch, so their sum is the global batch under any mesh.

Gradient clipping: `clip_grad_norm_` takes a mix of plain and DTensor gradients (the
global norm, each shard counted once); ``torch.nn.utils.clip_grad_norm_`` refuses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from moelab.routing import balancing
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput

from .experts import SwiGLUExperts
from .layer import MoE

__all__ = [
    "ExpertParallelDispatch",
    "clip_grad_norm_",
    "drop_from_group_counts",
    "enable_expert_parallel",
    "group_capacity_drop",
    "slot_expert_counts",
]

_EXPERT_WEIGHTS = ("w_gate_EFD", "w_up_EFD", "w_down_EDF")
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def slot_expert_counts(
    ids_TK: torch.Tensor, routed_TK: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """c[k, e] = #{t : routed[t, k], ids[t, k] = e}, int64 of shape (K, E)."""
    K = ids_TK.shape[1]
    slot_TK = torch.arange(K, device=ids_TK.device).expand_as(ids_TK)
    key = (slot_TK * n_experts + ids_TK.long().clamp(0, n_experts - 1))[routed_TK]
    return torch.bincount(key, minlength=K * n_experts).reshape(K, n_experts)


def drop_from_group_counts(
    ids_TK: torch.Tensor,
    routed_TK: torch.Tensor,
    counts_RKE: torch.Tensor,
    tokens_R: list[int],
    rank: int,
    n_experts: int,
    capacity_factor: float,
) -> torch.Tensor:
    """Rank ``rank``'s slots refused by a capacity shared by R ranks.

    The rule is :func:`moelab.routing.balancing.capacity_drop` on the group's
    concatenated batch (the ranks' tokens in rank order): C = capacity(sum(tokens_R),
    K, E, factor) slots per expert, admitted first choices first (slot k before k + 1),
    within a slot in token order. The slot (t, k) of rank r holding expert e is
    admitted if fewer than C slots come before it:

        before = sum_{r', k' < k} c[r', k', e] + sum_{r' < r} c[r', k, e]
                 + #{t' < t : routed[t', k], ids[t', k] = e on rank r}

    Args:
        ids_TK, routed_TK: this rank's slots and those that would be computed.
        counts_RKE: every rank's `slot_expert_counts`, shape (R, K, E).
        tokens_R: every rank's T.
        rank: this rank's place r in the group.
        n_experts: E (with null experts: E + M, as the router's capacity counts them).
        capacity_factor: the factor in C.

    Returns:
        bool (T, K).
    """
    T, K = ids_TK.shape
    E = n_experts
    cap = balancing.capacity(sum(tokens_R), K, E, capacity_factor)
    counts_RKE = counts_RKE.to(ids_TK.device)
    earlier_slots_KE = counts_RKE.sum(0).cumsum(0) - counts_RKE.sum(0)  # k' < k, all ranks
    earlier_ranks_KE = counts_RKE[:rank].sum(0)  # slot k, ranks r' < r
    # rank of each slot within its (k, e) run in token order: a stable sort of the
    # slots flattened slot-major (n = k * T + t) by the key k * (E + 1) + e, with the
    # slots that take no capacity keyed to e = E (after every expert of slot k)
    slot_TK = torch.arange(K, device=ids_TK.device).expand_as(ids_TK)
    expert_TK = torch.where(routed_TK, ids_TK.long(), E)
    key_N = (slot_TK * (E + 1) + expert_TK).t().reshape(-1)
    sorted_N, order_N = torch.sort(key_N, stable=True)
    run_len = torch.bincount(key_N, minlength=K * (E + 1))
    run_start = run_len.cumsum(0) - run_len
    within_N = torch.arange(key_N.numel(), device=key_N.device) - run_start[sorted_N]
    within_TK = torch.empty_like(within_N)
    within_TK[order_N] = within_N
    within_TK = within_TK.reshape(K, T).t()
    before_KE = earlier_slots_KE + earlier_ranks_KE
    before_TK = before_KE[slot_TK, expert_TK.clamp(max=E - 1)]
    return routed_TK & (before_TK + within_TK >= cap)


def group_capacity_drop(
    ids_TK: torch.Tensor,
    routed_TK: torch.Tensor,
    n_experts: int,
    capacity_factor: float | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The capacity drop of the EP group ``group`` (`drop_from_group_counts`): one
    all-gather of each rank's (K * E + 1) counts. Every rank of the group calls it with
    the same K. None factor: nothing is dropped."""
    if capacity_factor is None:
        return torch.zeros_like(routed_TK)
    T, K = ids_TK.shape
    local = torch.cat(
        [
            slot_expert_counts(ids_TK, routed_TK, n_experts).reshape(-1),
            torch.tensor([T], device=ids_TK.device),
        ]
    )
    R = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(R)]
    dist.all_gather(gathered, local, group=group)
    stacked = torch.stack(gathered)
    tokens_R = stacked[:, -1].tolist()
    counts_RKE = stacked[:, :-1].reshape(R, K, n_experts)
    return drop_from_group_counts(
        ids_TK,
        routed_TK,
        counts_RKE,
        tokens_R,
        dist.get_rank(group),
        n_experts,
        capacity_factor,
    )


class ExpertParallelDispatch:
    """What `MoE.forward` calls at its seam under expert parallelism
    (``MoE.expert_dispatch``): `drop` after the router, the call between ``permute``
    and ``unpermute``. Holds the EP group, not the experts (the layer passes them)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(
                f"n_experts = {n_experts} is not divisible by the {self.size} ranks of the "
                "expert-parallel group; choose ep dividing n_experts"
            )
        self.n_experts = n_experts
        self.n_local = n_experts // self.size

    def drop(self, out: RouterOutput, config: RouterConfig) -> RouterOutput:
        """``out`` with ``dropped_TK`` counted over the group (`group_capacity_drop`;
        the router's own, per rank, is replaced). The slots that take capacity are the
        router's: selected real experts with a non-zero weight."""
        if config.capacity_factor is None:
            return out
        routed_TK = out.selected_TK & (out.weights_TK.detach() != 0)
        dropped = group_capacity_drop(
            out.ids_TK, routed_TK, config.n_scored, config.capacity_factor, self.group
        )
        return dataclasses.replace(out, dropped_TK=dropped)

    def __call__(
        self, experts: SwiGLUExperts, x_ND: torch.Tensor, counts_E: list[int]
    ) -> torch.Tensor:
        """The rows ``x_ND`` sorted by expert (``counts_E`` per expert, all E) through
        their experts on whichever rank holds them; the outputs in ``x_ND``'s order."""
        R, X = self.size, self.n_local
        if len(counts_E) != self.n_experts:
            raise ValueError(f"counts_E has {len(counts_E)} entries, expected {self.n_experts}")
        dev = x_ND.device
        send_RX = torch.tensor(counts_E, dtype=torch.int64, device=dev).reshape(R, X)
        recv_RX = torch.empty_like(send_RX)
        dist.all_to_all_single(recv_RX, send_RX, group=self.group)
        recv_counts = recv_RX.tolist()  # recv[s][j]: rows of rank s for local expert j
        send_split = send_RX.sum(1).tolist()
        recv_split = [sum(row) for row in recv_counts]
        x_QD = all_to_all_single_autograd(x_ND, recv_split, send_split, self.group)
        # the rows arrive grouped by source rank, then by local expert: regroup them by
        # local expert (source order within each) for the experts
        n_RX = recv_RX.reshape(-1).cpu()
        start_RX = n_RX.cumsum(0) - n_RX  # where block (s, j) starts in x_QD
        n_XR, start_XR = n_RX.reshape(R, X).t().reshape(-1), start_RX.reshape(R, X).t().reshape(-1)
        new_start_XR = n_XR.cumsum(0) - n_XR
        order_Q = torch.repeat_interleave(start_XR - new_start_XR, n_XR) + torch.arange(
            int(n_XR.sum())
        )
        order_Q = order_Q.to(dev)
        local_counts = n_XR.reshape(X, R).sum(1).tolist()
        # NOTE: 1/R on the experts' parameter gradients (see the module docstring), R back
        # on the rows' gradients: the gradients of x are those of one process
        x_local = _ScaleGrad.apply(x_QD.index_select(0, order_Q), float(R))
        y_local = _ScaleGrad.apply(experts(x_local, local_counts), 1.0 / R)
        y_QD = y_local.index_select(0, torch.argsort(order_Q))
        y_ND = all_to_all_single_autograd(y_QD, send_split, recv_split, self.group)
        # NOTE: the result of a functional collective waits on first use; wait here
        return y_ND.wait() if hasattr(y_ND, "wait") else y_ND


def enable_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split the experts of every `MoE` layer of ``model`` over ``mesh["ep"]`` and
    install the all-to-all dispatch (see the module docstring). Call it once, after the
    model is built (identically on every rank) and before it is wrapped or its
    optimiser made. A 1-rank "ep" dimension changes nothing.

    Raises:
        ValueError: the mesh has no "ep" dimension, ep does not divide a layer's
            number of experts, or expert parallelism is already on.
    """
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # NOTE: torch < 2.5 keeps DTensor under _tensor
        from torch.distributed._tensor import Shard, distribute_tensor  # type: ignore[no-redef]

    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise ValueError(f"the mesh needs an 'ep' dimension, it has {names}")
    ep_mesh = mesh["ep"]
    if ep_mesh.size() == 1:
        return
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        if layer.expert_dispatch is not None:
            raise ValueError("expert parallelism is already enabled on this model")
        dispatch = ExpertParallelDispatch(ep_mesh.get_group(), layer.experts.n_experts)
        experts = layer.experts
        for name in _EXPERT_WEIGHTS:
            param = getattr(experts, name)
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.expert_dispatch = dispatch


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that mix plain tensors and
    DTensors on different meshes (expert parallelism under FSDP: the experts on the
    "ep" or ("dp", "ep") mesh, the rest on the world's), which torch's refuses.

    The total 2-norm counts every element of the model once: each rank sums the squares
    of its local gradients, each divided by the number of ranks holding a copy of it
    (the ranks outside its mesh, times the sizes of the mesh dimensions it is
    replicated on; a plain tensor: every rank), and one all-reduce over the default
    group adds them up, so every rank gets the same norm. Every gradient is then scaled
    by min(1, max_norm / (norm + 1e-6)), as torch does. With no DTensor gradient (one
    process, DDP) this is torch's own function. Returns the total norm (plain 0-d).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not any(hasattr(g, "to_local") for g in grads):
        return _torch_clip_grad_norm_(params, max_norm)
    world = dist.get_world_size()
    by_copies: dict[float, list[torch.Tensor]] = {}
    locals_ = []
    for g in grads:
        if hasattr(g, "to_local"):
            mesh, local = g.device_mesh, g.to_local()
            copies = world / mesh.size()
            for dim, placement in enumerate(g.placements):
                if placement.is_partial():
                    raise ValueError("clip_grad_norm_ takes no Partial gradients; reduce them")
                if placement.is_replicate():
                    copies *= mesh.size(dim)
        else:
            local, copies = g, float(world)
        by_copies.setdefault(copies, []).append(local)
        locals_.append(local)
    total_sq = torch.zeros((), dtype=torch.float64, device=locals_[0].device)
    for copies, tensors in by_copies.items():
        norms = torch._foreach_norm(tensors, 2.0)
        total_sq = total_sq + torch.stack(norms).double().square().sum() / copies
    dist.all_reduce(total_sq)
    total = total_sq.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for local in locals_:
            local.mul_(coef.to(local.device, local.dtype))
    return total
