"""BinnedQuantiles: percentiles within width / 2 of numpy's, exact where promised,
and merging chunks equals the one-shot histogram."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.diagnostics.quantiles import BinnedQuantiles


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_percentiles_match_numpy_within_half_a_bin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # values below, inside and above the binned range, with ties
    values = np.concatenate(
        [rng.normal(0.0, 3.0, 5000), np.full(50, 1.25), rng.uniform(-20, -10, 30), [40.0, 55.5]]
    )
    q = BinnedQuantiles(-5.0, 0.01, 5.0)
    q.add(values)
    assert q.n == values.size
    for pct in (0, 1, 10, 25, 50, 75, 90, 99, 100):
        assert abs(q.percentile(pct) - np.percentile(values, pct)) <= 0.005 + 1e-12
    # the extremes are exact, also when they lie outside the bins
    assert q.percentile(0) == values.min() and q.percentile(100) == values.max()


def test_chunks_and_merge_equal_one_shot() -> None:
    rng = np.random.default_rng(3)
    values = rng.exponential(2.0, 3000)
    one = BinnedQuantiles(0.0, 0.05, 8.0)
    one.add(values)
    a, b = BinnedQuantiles(0.0, 0.05, 8.0), BinnedQuantiles(0.0, 0.05, 8.0)
    a.add(values[:1000])
    a.add(values[1000:1700])
    b.add(values[1700:])
    a.merge(b)
    assert np.array_equal(a.count, one.count[: a.count.size]) or np.array_equal(a.count, one.count)
    for pct in (5, 50, 95):
        assert a.percentile(pct) == one.percentile(pct)
    with pytest.raises(ValueError, match="different bins"):
        a.merge(BinnedQuantiles(0.0, 0.1, 8.0))


def test_single_value_bins_and_empty() -> None:
    q = BinnedQuantiles(0.0, 1.0, 10.0)
    assert q.percentile(50) is None
    q.add(np.array([3.3, 3.3, 3.3, np.nan]))
    assert q.n == 3 and q.percentile(50) == 3.3  # one distinct value per bin: exact
    with pytest.raises(ValueError):
        BinnedQuantiles(1.0, 0.1, 1.0)
