"""Co-activation: which experts a token uses together.

Per MoE layer, over the tokens of a text, with ``A_T`` the used experts of token t
(selected, non-zero weight; :func:`~moelab.diagnostics.analysis.source.used_mask`):

``counts[i][j]``
    the tokens that use both i and j (``counts[i][i]`` = n_i, the tokens that use i);
``conditional[i][j]``
    ``P(j used | i used) = counts[i][j] / n_i`` (None for an expert no token used);
``expected[i][j]``
    what independent choice of a token's other experts would give: a token that uses i
    uses ``k_i - 1`` other experts (``k_i``: the mean number of used experts of the
    tokens that use i), each drawn in proportion to the other experts' loads, so
    ``(k_i - 1) n_j / (S - n_i)`` with ``S = sum_l n_l``. For top-2 routing of E experts
    chosen uniformly at random this is 1 / (E - 1), as it should be;
``lift``
    ``conditional / expected``: above 1, j goes with i more often than chance.

``top_pairs``: the pairs i < j with at least ``min_count`` tokens in common, ranked by
the symmetric lift ``counts[i][j] * S / ((k_i - 1) n_i n_j)`` averaged over both
directions (its two one-sided lifts are given too).

Shape suffixes: B, S, T, E (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from moelab.diagnostics.analysis.source import RoutingSource, route, used_mask

__all__ = ["CoactivationCounts", "coactivation"]


class CoactivationCounts:
    """Exact co-activation counts of one MoE layer (int64), streamed batch by batch."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.tokens = 0
        self.counts = np.zeros((n_experts, n_experts), dtype=np.int64)
        self.used_slots = np.zeros(n_experts, dtype=np.int64)  # sum over tokens using i of |A_t|

    def update_mask(self, mask_TE: torch.Tensor) -> None:
        """Add the used-expert mask (T, E) of a batch."""
        m = mask_TE.to(torch.float64)
        self.tokens += int(m.shape[0])
        self.counts += (m.t() @ m).round().long().numpy()
        self.used_slots += (m * m.sum(dim=1, keepdim=True)).sum(dim=0).round().long().numpy()

    def result(self, min_count: int = 10, top: int = 10) -> dict[str, Any]:
        c = self.counts.astype(np.float64)
        n = np.diag(c).copy()
        S = n.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(n > 0, self.used_slots / np.maximum(n, 1), np.nan)
            cond = np.where(n[:, None] > 0, c / np.maximum(n, 1)[:, None], np.nan)
            rest = S - n
            expected = np.where(
                (n[:, None] > 0) & (rest[:, None] > 0),
                (k[:, None] - 1) * n[None, :] / np.where(rest > 0, rest, 1)[:, None],
                np.nan,
            )
            lift = np.where(expected > 0, cond / np.where(expected > 0, expected, 1), np.nan)
        np.fill_diagonal(expected, np.nan)
        np.fill_diagonal(lift, np.nan)
        pairs = []
        for i in range(self.n_experts):
            for j in range(i + 1, self.n_experts):
                if self.counts[i, j] < min_count or not np.isfinite(lift[i, j] + lift[j, i]):
                    continue
                pairs.append(
                    {
                        "i": i,
                        "j": j,
                        "tokens": int(self.counts[i, j]),
                        "p_j_given_i": float(cond[i, j]),
                        "p_i_given_j": float(cond[j, i]),
                        "lift_ij": float(lift[i, j]),
                        "lift_ji": float(lift[j, i]),
                        "lift": float((lift[i, j] + lift[j, i]) / 2),
                    }
                )
        pairs.sort(key=lambda p: (-p["lift"], p["i"], p["j"]))

        def listed(a: np.ndarray) -> list[list[float | None]]:
            return [[None if not np.isfinite(v) else float(v) for v in row] for row in a]

        finite = lift[np.isfinite(lift)]
        return {
            "tokens": self.tokens,
            "load": [int(v) for v in n],
            "counts": self.counts.tolist(),
            "conditional": listed(cond),
            "expected": listed(expected),
            "lift": listed(lift),
            "lift_max": float(finite.max()) if finite.size else None,
            "lift_min": float(finite.min()) if finite.size else None,
            "top_pairs": pairs[:top],
        }


def coactivation(
    source: RoutingSource,
    data: Any = None,
    min_count: int = 10,
    top: int = 10,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Co-activation of every MoE layer of ``source`` on ``data`` (None: its default
    text); see the module docstring for the fields of each layer."""
    acc = [CoactivationCounts(source.n_experts) for _ in range(source.n_layers)]
    for x_BS in source.batches(data):
        for a, out in zip(acc, route(source, x_BS), strict=True):
            a.update_mask(used_mask(out))
        if progress is not None:
            progress(int(x_BS.numel()))
    if not acc[0].tokens:
        raise ValueError("the text holds no batch to route")
    doc = source.describe()
    doc.update(
        analysis="coactivation",
        data=None if data is None else str(data),
        tokens=acc[0].tokens,
        min_count=min_count,
        layers=[{"layer": i, **a.result(min_count, top)} for i, a in enumerate(acc)],
    )
    return doc
