"""Validation during training: :class:`Validation` decides when (``due(step)``: every
``eval_every`` steps and after the last) and evaluates (:func:`_evaluate`: the mean
loss over the first ``eval_batches`` validation batches, over all ranks); the last
evaluation also counts the experts that computed no token (the run's dead experts).

Shape suffixes: B, S (moelab.shapes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from moelab.data import TokenShard, batches

from . import distributed as D
from .config import TrainConfig
from .dead_experts import ExpertLoad


@torch.no_grad()
def _evaluate(
    model: torch.nn.Module,
    val: TokenShard,
    config: TrainConfig,
    info: D.DistInfo,
    per_rank: int,
    load: ExpertLoad | None = None,
) -> float:
    """Mean validation loss over the first ``eval_batches`` batches of the validation
    split in file order (fewer when the split is shorter: no batch is read twice), over
    all ranks; :func:`count_val_batches` is their count. ``load`` counts the experts' tokens."""
    bare = D.unwrap(model)
    bare.eval()
    devices = [info.device.index or 0] if info.device.type == "cuda" else []
    # NOTE: fork the RNG so that evaluating never changes the training stream (an
    # interrupted and resumed run evaluates at different points than a straight one).
    with torch.random.fork_rng(devices=devices):
        total, n = 0.0, 0
        for x_BS, y_BS in _val_iter(val, per_rank, config, info):
            with torch.autocast("cuda", torch.bfloat16, enabled=info.device.type == "cuda"):
                out = bare(x_BS.to(info.device), y_BS.to(info.device), collect=load is not None)
            if load is not None:
                load.add(out.router_outputs)
            total += float(out.loss)
            n += 1
    bare.train()
    return D.all_reduce_mean({"v": total / n}, info)["v"]


def _val_iter(
    val: TokenShard, per_rank: int, config: TrainConfig, info: D.DistInfo
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The validation batches training evaluates on: one pass in file order, cut at
    ``eval_batches`` (every rank gets the same count)."""
    it = batches(
        val,
        per_rank,
        config.seq_len,
        config.seed,
        info.rank,
        info.world_size,
        shuffle=False,
        epochs=1,
    )
    return itertools.islice(it, config.eval_batches)


def count_val_batches(val: TokenShard, per_rank: int, config: TrainConfig, info: D.DistInfo) -> int:
    """How many batches (per rank) training's validation loss covers."""
    return sum(1 for _ in _val_iter(val, per_rank, config, info))


class Validation:
    """Validation during steps ``start`` to ``end``: when (:meth:`due`) and the
    evaluation itself (:meth:`run`, collective under torchrun). ``loss`` is the last
    validation loss; ``dead_final`` the dead experts of the last step's evaluation (one
    count per MoE layer)."""

    def __init__(
        self,
        model: torch.nn.Module,
        val: TokenShard,
        config: TrainConfig,
        info: D.DistInfo,
        per_rank: int,
        end: int,
    ) -> None:
        self.model, self.val, self.config, self.info = model, val, config, info
        self.per_rank, self.end = per_rank, end
        self.loss = float("nan")
        self.final = ExpertLoad()  # dead experts: the end
        self.dead_final: list[int] = []

    def due(self, step: int) -> bool:
        """Whether training evaluates after ``step`` steps: every ``eval_every`` and after
        the last."""
        every = self.config.eval_every
        return bool((every and step % every == 0) or step == self.end)

    def run(self, step: int) -> float:
        """The validation loss after ``step`` steps; after the last, with the experts'
        tokens counted (``dead_final``)."""
        last = step == self.end
        load = self.final if last else None
        self.loss = _evaluate(self.model, self.val, self.config, self.info, self.per_rank, load)
        self.dead_final = self.final.dead(self.info) if last else self.dead_final
        return self.loss
