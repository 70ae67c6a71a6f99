"""Streaming percentiles with a stated error: a fixed-width histogram that remembers,
per bin, the smallest and largest value it received.

Values in ``[lo, hi)`` fall in bins of width ``width``; each bin keeps its count, its
minimum and its maximum. The smallest and largest order statistic of a bin are its
exact min and max; any other is estimated by the bin midpoint clamped to the bin's
``[min, max]``, which is within ``width / 2`` of the true value (and exact for a bin
holding a single distinct value, e.g. ties). Values outside ``[lo, hi)`` are kept
exactly in an overflow list. A percentile interpolated between two order statistics
(as ``numpy.percentile`` does) is therefore within ``width / 2`` of the exact one.

Counts add exactly, so accumulating over chunks, or merging accumulators of different
chunks or ranks, gives the one-shot histogram.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["BinnedQuantiles", "interpolated_percentile"]


class BinnedQuantiles:
    """Order statistics and percentiles of a stream of finite floats (see the module
    docstring for the error bound)."""

    def __init__(self, lo: float, width: float, hi: float) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi) and width > 0 and hi > lo):
            raise ValueError(f"need finite lo < hi and width > 0, got {lo}, {width}, {hi}")
        self.lo, self.width, self.hi = float(lo), float(width), float(hi)
        self.n_bins_max = math.ceil((self.hi - self.lo) / self.width)
        self.count = np.zeros(0, dtype=np.int64)
        self.min = np.zeros(0, dtype=np.float64)
        self.max = np.zeros(0, dtype=np.float64)
        self.overflow: list[float] = []

    @property
    def n(self) -> int:
        """Number of values seen."""
        return int(self.count.sum()) + len(self.overflow)

    def _grow(self, n_bins: int) -> None:
        extra = n_bins - self.count.shape[0]
        if extra > 0:
            self.count = np.concatenate([self.count, np.zeros(extra, np.int64)])
            self.min = np.concatenate([self.min, np.full(extra, np.inf)])
            self.max = np.concatenate([self.max, np.full(extra, -np.inf)])

    def add(self, values: np.ndarray) -> None:
        """Add finite values (NaN is ignored; +-inf goes to the exact overflow list)."""
        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[~np.isnan(values)]
        outside = (values < self.lo) | (values >= self.hi)
        self.overflow.extend(values[outside].tolist())
        binned = values[~outside]
        if binned.size == 0:
            return
        idx = np.floor((binned - self.lo) / self.width).astype(np.int64)
        idx = np.clip(idx, 0, self.n_bins_max - 1)
        self._grow(int(idx.max()) + 1)
        np.add.at(self.count, idx, 1)
        np.minimum.at(self.min, idx, binned)
        np.maximum.at(self.max, idx, binned)

    def merge(self, other: BinnedQuantiles) -> BinnedQuantiles:
        """Add the values of ``other`` (same bins); returns self."""
        if (other.lo, other.width, other.hi) != (self.lo, self.width, self.hi):
            raise ValueError("cannot merge histograms with different bins")
        n = other.count.shape[0]
        self._grow(n)
        self.count[:n] += other.count
        np.minimum(self.min[:n], other.min, out=self.min[:n])
        np.maximum(self.max[:n], other.max, out=self.max[:n])
        self.overflow.extend(other.overflow)
        return self

    def order_stats(self, ranks: np.ndarray) -> np.ndarray:
        """Estimated order statistics (0-based ranks into the sorted values)."""
        below = np.sort(np.asarray([v for v in self.overflow if v < self.lo], np.float64))
        above = np.sort(np.asarray([v for v in self.overflow if v >= self.hi], np.float64))
        cum = np.cumsum(self.count)
        n_binned = int(cum[-1]) if cum.size else 0
        out = np.empty(len(ranks), dtype=np.float64)
        for i, r in enumerate(ranks):
            r = int(r)
            if r < below.size:
                out[i] = below[r]
                continue
            r -= below.size
            if r >= n_binned:
                out[i] = above[r - n_binned]
                continue
            b = int(np.searchsorted(cum, r, side="right"))
            j = r - (int(cum[b - 1]) if b else 0)  # rank inside bin b
            if j == 0:  # the bin's smallest value: exact
                out[i] = self.min[b]
            elif j == self.count[b] - 1:  # its largest: exact
                out[i] = self.max[b]
            else:
                mid = self.lo + (b + 0.5) * self.width
                out[i] = min(max(mid, self.min[b]), self.max[b])
        return out

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0-100), linear interpolation as in numpy.percentile;
        None when empty."""
        return interpolated_percentile(self.n, q, self.order_stats)


def interpolated_percentile(
    n: int, q: float, order_stats: Callable[[np.ndarray], np.ndarray]
) -> float | None:
    """The q-th percentile (0-100) of ``n`` values given their order statistics
    (``order_stats(ranks)``, 0-based), interpolated linearly between the two around
    rank ``q / 100 * (n - 1)`` as ``numpy.percentile`` does; None when ``n == 0``."""
    if n == 0:
        return None
    pos = q / 100.0 * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    v_lo, v_hi = order_stats(np.array([lo, hi]))
    frac = pos - lo
    return float(v_lo + (v_hi - v_lo) * frac) if frac else float(v_lo)
