"""Timing shared by the benchmarks: medians of wall-clock time, after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    Timings on a shared machine are noisy: compare implementations as ratios
    measured in the same run, never as absolute numbers across runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
