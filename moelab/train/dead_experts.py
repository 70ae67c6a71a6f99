"""Dead experts: the real experts of an MoE layer that computed no token over a stretch
of training (a logging window: the steps since the previous logged step) or over the
final evaluation.

A token reaches an expert when one of its slots is computed (``RouterOutput.computed_TK``:
selected, not dropped by a capacity limit, non-zero gate weight). Null experts
(``router.n_null_experts``) are not experts here: they compute nothing by design. The
counts are summed over the ranks of a torchrun run before an expert is called dead.

Shape suffixes: T, E, K, L (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelab.routing.measures import expert_counts
from moelab.routing.output import RouterOutput

from . import distributed as D

__all__ = ["ExpertLoad"]


class ExpertLoad:
    """Tokens computed by each real expert of each MoE layer since the last
    :meth:`dead`, counted on the device (no host sync per step)."""

    def __init__(self) -> None:
        self._counts_LE: torch.Tensor | None = None

    @torch.no_grad()
    def add(self, outs: Sequence[RouterOutput]) -> None:
        """Count the computed slots of one forward pass (one RouterOutput per MoE
        layer, in order)."""
        if not outs:
            return
        counts_LE = torch.stack(
            [expert_counts(o.ids_TK, o.computed_TK, o.n_experts, torch.int64) for o in outs]
        )
        self._counts_LE = counts_LE if self._counts_LE is None else self._counts_LE + counts_LE

    def take(self, info: D.DistInfo) -> torch.Tensor | None:
        """The counts since the last call, summed over the ranks (collective under
        torchrun: every rank calls it), shape (L, E); then start over. None when
        nothing was counted."""
        counts_LE, self._counts_LE = self._counts_LE, None
        if counts_LE is None:
            return None
        return D.all_reduce_sum(counts_LE, info)

    def state(self, info: D.DistInfo) -> list[list[int]] | None:
        """The counts so far, summed over the ranks (collective under torchrun), as
        lists of ints per layer, without starting over: what a checkpoint keeps of a
        window that a stop cut (:meth:`restore` puts them back). None when nothing was
        counted."""
        if self._counts_LE is None:
            return None
        return [[int(n) for n in row] for row in D.all_reduce_sum(self._counts_LE, info).tolist()]

    def restore(self, counts: list[list[int]] | None, info: D.DistInfo) -> None:
        """Start from ``counts`` (:meth:`state` of a checkpoint): rank 0 holds them, the
        other ranks zeros, so that the sum over the ranks is the saved window's."""
        if counts is None:
            self._counts_LE = None
            return
        counts_LE = torch.tensor(counts, dtype=torch.int64, device=info.device)
        self._counts_LE = counts_LE if info.is_main else torch.zeros_like(counts_LE)

    def dead(self, info: D.DistInfo) -> list[int]:
        """Per MoE layer, the real experts that computed no token since the last call
        (on any rank: collective under torchrun, every rank calls it); then start over.
        [] when nothing was counted."""
        counts_LE = self.take(info)
        if counts_LE is None:
            return []
        return [int(n) for n in (counts_LE == 0).sum(-1).tolist()]
