"""Router saturation: how early in training each token's routing reaches its final form.

For checkpoints ``c_1 .. c_n`` of one training run (``c_n`` the last) and a fixed text,
per MoE layer:

``top1_agreement``
    the share of tokens whose top-1 expert (the used expert of largest gate weight,
    :func:`~moelab.diagnostics.analysis.source.top1`) at ``c_i`` equals the one at ``c_n``;
``set_overlap``
    the mean over tokens of ``|A ∩ B| / max(|A|, |B|)`` (1 when both are empty), A and
    B the used experts at ``c_i`` and at ``c_n``: for top-K without fillers, the share of
    the K experts that are already the final ones (the OLMoE paper's router saturation);
``set_agreement``
    the share of tokens whose used set equals the final one.

The last checkpoint is compared with itself too (every value 1, which checks the
plumbing). Each checkpoint is compared with the last batch by batch: both models run on
the same batch, so memory stays flat in the number of tokens and in the number of
checkpoints (two models at a time; the last is run once per checkpoint).

A moelab run keeps its two newest checkpoints unless training was told to keep more:
``--set keep_every=N`` keeps every checkpoint of a step that is a multiple of N
(``TrainConfig.keep_every``; the demo keeps all four of its checkpoints).

Shape suffixes: B, S (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moelab.diagnostics.analysis.source import RoutingSource, route, top1, used_mask

__all__ = ["SaturationCounts", "compare_routing", "saturation"]


class SaturationCounts:
    """Exact counts of one checkpoint against the last, per MoE layer."""

    def __init__(self, n_layers: int) -> None:
        self.tokens = [0] * n_layers
        self.top1_same = [0] * n_layers
        self.set_same = [0] * n_layers
        self.overlap_sum = [0.0] * n_layers

    def update(self, layer: int, mine: Any, final: Any) -> None:
        """Add one batch of layer ``layer``: RouterOutputs of the same tokens."""
        a, b = used_mask(mine), used_mask(final)
        if a.shape != b.shape:
            raise ValueError(
                f"MoE layer {layer}: the checkpoints route {tuple(a.shape)} and "
                f"{tuple(b.shape)} (tokens, experts); compare checkpoints of one model"
            )
        inter = (a & b).sum(dim=1).double()
        size = torch.maximum(a.sum(dim=1), b.sum(dim=1)).double()
        overlap = torch.where(size > 0, inter / size.clamp_min(1), torch.ones_like(inter))
        self.tokens[layer] += a.shape[0]
        self.top1_same[layer] += int((top1(mine) == top1(final)).sum())
        self.set_same[layer] += int((a == b).all(dim=1).sum())
        self.overlap_sum[layer] += float(overlap.sum())

    def result(self) -> list[dict[str, Any]]:
        rows = []
        for i, n in enumerate(self.tokens):
            rows.append(
                {
                    "layer": i,
                    "tokens": n,
                    "top1_agreement": self.top1_same[i] / n if n else None,
                    "set_overlap": self.overlap_sum[i] / n if n else None,
                    "set_agreement": self.set_same[i] / n if n else None,
                }
            )
        return rows


def compare_routing(
    mine: RoutingSource, final: RoutingSource, batches: Any, counts: SaturationCounts
) -> None:
    """Run both sources on every batch and add the comparison to ``counts``."""
    for x_BS in batches:
        for layer, (a, b) in enumerate(zip(route(mine, x_BS), route(final, x_BS), strict=True)):
            counts.update(layer, a, b)


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) / len(values) if values else None


def saturation(
    checkpoints: Sequence[Callable[[], RoutingSource]],
    labels: Sequence[int | None],
    data: Any = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Saturation of the checkpoints that ``checkpoints`` load (functions, called one at
    a time, in training order, the last being the final one) on the text ``data``
    (None: the source's default text). ``labels``: the step of each checkpoint (None
    where unknown). Returns ``{..., "final_step", "checkpoints": [{"step", "tokens"
    (training tokens when known), "mean": {...}, "layers": [...]}]}``."""
    if len(checkpoints) < 2:
        raise ValueError(
            f"saturation compares checkpoints with the last one, and there is "
            f"{len(checkpoints)}; train with --set keep_every=N to keep every N-th "
            "checkpoint (TrainConfig.keep_every)"
        )
    final = checkpoints[-1]()
    rows = []
    for i, (load, step) in enumerate(zip(checkpoints, labels, strict=True)):
        if progress is not None:
            progress(f"checkpoint {step if step is not None else i} ({i + 1}/{len(checkpoints)})")
        mine = final if i == len(checkpoints) - 1 else load()
        if mine.n_layers != final.n_layers or mine.n_experts != final.n_experts:
            raise ValueError(
                f"checkpoint {step}: {mine.n_layers} MoE layers of {mine.n_experts} experts, "
                f"the last has {final.n_layers} of {final.n_experts}; these are not one run"
            )
        counts = SaturationCounts(final.n_layers)
        compare_routing(mine, final, final.batches(data), counts)
        layers = counts.result()
        if not layers[0]["tokens"]:
            raise ValueError("the text holds no batch to route")
        per_step = final.tokens_per_step
        rows.append(
            {
                "step": step,
                "training_tokens": None if step is None or per_step is None else step * per_step,
                "mean": {
                    k: _mean(layers, k) for k in ("top1_agreement", "set_overlap", "set_agreement")
                },
                "layers": layers,
            }
        )
        if mine is not final:
            del mine
    doc = final.describe()
    doc.update(
        analysis="saturation",
        data=None if data is None else str(data),
        tokens=rows[-1]["layers"][0]["tokens"],
        final_step=labels[-1],
        checkpoints=rows,
    )
    return doc
