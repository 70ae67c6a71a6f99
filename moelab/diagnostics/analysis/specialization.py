"""Specialisation: how each token id, and each corpus, spreads over the experts.

Vocabulary specialisation, per MoE layer (the OLMoE paper's measure): for a token id x
seen ``N(x)`` times in the text, ``N(x, e)`` of which used expert e,

    spec(x) = max_e N(x, e) / N(x)

the share of its occurrences that reach its most frequent expert (1: the token always
goes there; a token spread evenly over the E experts with K used experts gets about
K / E, the ``uniform`` baseline given beside it). Only ids seen at least ``min_count``
times count. Given: the distribution of spec(x) over those ids (mean, p10, p50, p90, a
histogram of 20 bins on [0, 1]) and, per expert, the ``top`` ids of largest
``N(x, e) / N(x)`` with their text.

Domain specialisation, per corpus and MoE layer: the share of the used slots that
reach each expert, and its ratio to the uniform share 1 / E (the OLMoE figure: above 1,
the expert takes more of this corpus than an even split would).

Memory: counts per (seen token id, expert) and layer, int64, so it grows with the ids
the text holds, never with its length.

Shape suffixes: B, S, T, E (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from moelab.diagnostics.analysis.source import RoutingSource, route, used_mask

__all__ = ["VocabularyCounts", "specialization"]

HIST_BINS = 20


class VocabularyCounts:
    """``N(x)`` and ``N(x, e)`` of one MoE layer, over the token ids seen so far."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.index: dict[int, int] = {}  # token id -> row
        self.ids: list[int] = []
        self.seen = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros((0, n_experts), dtype=np.int64)

    def _rows(self, ids_T: np.ndarray) -> np.ndarray:
        for t in np.unique(ids_T).tolist():
            if t not in self.index:
                self.index[t] = len(self.ids)
                self.ids.append(t)
        if len(self.ids) > self.seen.shape[0]:
            grow = max(len(self.ids), 2 * self.seen.shape[0])
            self.seen = np.concatenate([self.seen, np.zeros(grow - self.seen.shape[0], np.int64)])
            pad = np.zeros((grow - self.counts.shape[0], self.n_experts), np.int64)
            self.counts = np.concatenate([self.counts, pad])
        return np.fromiter((self.index[t] for t in ids_T.tolist()), np.int64, ids_T.shape[0])

    def update(self, ids_T: torch.Tensor, mask_TE: torch.Tensor) -> None:
        rows = self._rows(ids_T.reshape(-1).cpu().numpy())
        np.add.at(self.seen, rows, 1)
        t, e = np.nonzero(mask_TE.cpu().numpy())
        np.add.at(self.counts, (rows[t], e), 1)

    def result(
        self, decode: Callable[[int], str], min_count: int, top: int, top_k: float | None
    ) -> dict[str, Any]:
        n = len(self.ids)
        seen, counts = self.seen[:n], self.counts[:n]
        keep = seen >= min_count
        share = counts[keep] / seen[keep, None] if keep.any() else np.zeros((0, self.n_experts))
        spec = share.max(axis=1) if share.size else np.zeros(0)
        ids = np.asarray(self.ids, dtype=np.int64)[keep]
        hist = np.histogram(spec, bins=HIST_BINS, range=(0.0, 1.0))[0] if spec.size else None
        experts = []
        for e in range(self.n_experts):
            order = np.lexsort((ids, -share[:, e])) if share.size else []
            tops = [
                {
                    "id": int(ids[r]),
                    "text": decode(int(ids[r])),
                    "share": float(share[r, e]),
                    "seen": int(seen[keep][r]),
                }
                for r in list(order)[:top]
                if share[r, e] > 0
            ]
            experts.append({"expert": e, "top_tokens": tops})
        q = (lambda p: float(np.percentile(spec, p))) if spec.size else (lambda p: None)
        return {
            "token_ids": int(keep.sum()),
            "token_ids_seen": n,
            "mean": float(spec.mean()) if spec.size else None,
            "p10": q(10),
            "p50": q(50),
            "p90": q(90),
            "uniform": None if top_k is None else top_k / self.n_experts,
            "histogram": None if hist is None else [int(v) for v in hist],
            "experts": experts,
        }


def _domain(loads: np.ndarray) -> dict[str, Any]:
    total = loads.sum()
    share = loads / total if total else np.full(loads.shape, np.nan)
    return {
        "used_slots": int(total),
        "share": [float(v) for v in share],
        "ratio_to_uniform": [float(v * loads.shape[0]) for v in share],
    }


def specialization(
    source: RoutingSource,
    data: Sequence[Any] = (None,),
    min_count: int = 10,
    top: int = 5,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Vocabulary specialisation over all the texts of ``data`` together (each a corpus
    the source reads; None: its default text) and the domain loads of each; see the
    module docstring."""
    if min_count < 1:
        raise ValueError(f"--min-count must be >= 1, got {min_count}")
    L, E = source.n_layers, source.n_experts
    vocab = [VocabularyCounts(E) for _ in range(L)]
    domains = []
    used_k = [0, 0]  # used slots, tokens: the mean K of the uniform baseline
    for text in data:
        loads = np.zeros((L, E), dtype=np.int64)
        tokens = 0
        for x_BS in source.batches(text):
            ids_T = x_BS.reshape(-1)
            for layer, out in enumerate(route(source, x_BS)):
                mask = used_mask(out)
                vocab[layer].update(ids_T, mask)
                loads[layer] += mask.sum(dim=0).long().cpu().numpy()
                if layer == 0:
                    used_k[0] += int(mask.sum())
                    used_k[1] += int(mask.shape[0])
            tokens += int(ids_T.numel())
            if progress is not None:
                progress(int(ids_T.numel()))
        if not tokens:
            raise ValueError(f"the text {text or 'of the validation split'} holds no batch")
        domains.append(
            {
                "data": None if text is None else str(text),
                "tokens": tokens,
                "layers": [{"layer": i, **_domain(loads[i])} for i in range(L)],
            }
        )
    k_mean = used_k[0] / used_k[1] if used_k[1] else None
    doc = source.describe()
    doc.update(
        analysis="specialization",
        data=[None if d is None else str(d) for d in data],
        tokens=sum(d["tokens"] for d in domains),
        min_count=min_count,
        vocabulary=[
            {"layer": i, **v.result(source.decode, min_count, top, k_mean)}
            for i, v in enumerate(vocab)
        ],
        domains=domains,
    )
    return doc
