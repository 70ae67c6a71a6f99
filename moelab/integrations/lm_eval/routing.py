"""Routing statistics per downstream task.

Every forward pass of :class:`~moelab.integrations.lm_eval.model.MoelabLM` hands its
router outputs (one per MoE layer, over the B x S padded tokens of the batch, flattened
batch-major) and, per request, its task and real length to :meth:`TaskRouting.add`. Only
the real tokens of each request reach that task's
:class:`~moelab.diagnostics.ModelRoutingStats`: the rows ``b * S + s`` for ``s <`` the
request's length, never the padding. So a task's statistics are those ``moelab stats``
computes on the token sequences its requests fed to the model (the statistics of a
token do not depend on the other tokens of its batch for a causal, dropless router).

Shape suffixes: T, K (moelab.shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from moelab.diagnostics.accumulators import ModelRoutingStats
from moelab.routing.output import RouterOutput

__all__ = ["SUMMARY_FIELDS", "TaskRouting", "router_rows"]

SUMMARY_FIELDS = ("active_experts", "discarded_mass", "contributors", "load_cv")
"""The statistics reported per task (means over the MoE layers, and per layer)."""

_ROW_FIELDS = (
    "scores_TE",
    "logits_TE",
    "probs_TE",
    "ids_TK",
    "weights_TK",
    "selected_TK",
    "dropped_TK",
    "null_TK",
)


def router_rows(out: RouterOutput, rows: torch.Tensor) -> RouterOutput:
    """The RouterOutput of the token rows ``rows`` (int64 indices into T) of ``out``."""
    rows = rows.to(out.ids_TK.device)
    picked = {
        name: getattr(out, name).index_select(0, rows)
        for name in _ROW_FIELDS
        if getattr(out, name) is not None
    }
    return dataclasses.replace(out, **picked)


class TaskRouting:
    """One :class:`ModelRoutingStats` per task, fed the real tokens of its requests."""

    def __init__(self, n_layers: int, map_name: str, alpha: float | None) -> None:
        self.n_layers, self.map_name, self.alpha = n_layers, map_name, alpha
        self.stats: dict[str, ModelRoutingStats] = {}
        self.requests: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every task's statistics."""
        self.stats.clear()
        self.requests.clear()

    def add(
        self,
        outs: Sequence[RouterOutput],
        seq_len: int,
        spans: Sequence[tuple[str, int, int, int]],
        new_requests: bool = True,
    ) -> None:
        """Add the tokens of one forward pass over a (B, ``seq_len``) batch: ``spans``
        holds ``(task, row b, first position, end position)``, the positions
        ``[first, end)`` of row b that count (``new_requests``: each span is a new
        request, else more tokens of one already counted)."""
        by_task: dict[str, list[torch.Tensor]] = {}
        for task, b, first, end in spans:
            if end > first:
                by_task.setdefault(task, []).append(torch.arange(first, end) + b * seq_len)
            if new_requests:
                self.requests[task] = self.requests.get(task, 0) + 1
        for task, parts in by_task.items():
            acc = self.stats.get(task)
            if acc is None:
                acc = self.stats[task] = ModelRoutingStats(self.n_layers, self.map_name, self.alpha)
            rows = torch.cat(parts)
            acc.update([router_rows(o, rows) for o in outs])

    def result(self) -> dict[str, dict[str, Any]]:
        """Per task: ``{"tokens", "requests", field: mean over layers, ..., "layers":
        [{"layer", field: ...}, ...]}`` for the :data:`SUMMARY_FIELDS`, and ``"full"``:
        the whole :meth:`ModelRoutingStats.result` means."""
        res = {}
        for task, acc in self.stats.items():
            r = acc.result()
            mean = r["mean"]
            res[task] = {
                "tokens": r["layers"][0]["states"],
                "requests": self.requests.get(task, 0),
                **{f: mean[f] for f in SUMMARY_FIELDS},
                "layers": [
                    {"layer": lay["layer"], **{f: lay[f] for f in SUMMARY_FIELDS}}
                    for lay in r["layers"]
                ],
                "full": {k: v for k, v in mean.items()},
            }
        return res
