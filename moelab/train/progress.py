"""Time and throughput of a training run.

* :class:`RunClock`: the wall-clock ``time`` (Unix seconds) and ``elapsed_s`` of every
  metrics row; ``elapsed_s`` counts from the start of ``train()``, on from the
  checkpoint's own ``elapsed_s`` when a run resumes, so over all parts of a run it is
  the run's training time (time between an interrupt and the resume is not counted,
  nor the steps after the checkpoint that the interrupted part trained).
* :class:`Throughput`: ``tokens_per_s``, the rate of the steps since the previous
  logged step (a logging window: what the run does now), and ``tokens_per_s_avg``,
  the rate since the first step of this part (compilation and warm-up included).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["RunClock", "Throughput"]


class RunClock:
    """``elapsed_s``: ``before`` seconds plus those since this clock was made."""

    def __init__(self, before: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.before = before
        self._clock = clock
        self._origin = clock()

    def elapsed(self) -> float:
        return self.before + self._clock() - self._origin

    def stamp(self) -> dict[str, float]:
        """``{"time": Unix seconds now, "elapsed_s": seconds of the run}``, to the ms."""
        return {"time": round(time.time(), 3), "elapsed_s": round(self.elapsed(), 3)}


class Throughput:
    """Tokens per second of the steps from ``step`` on, ``tokens_per_step`` each."""

    def __init__(
        self, step: int, tokens_per_step: int, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self._clock = clock
        self._start = self._window = clock()
        self._start_step = self._window_step = step

    def seconds(self) -> float:
        """Seconds since the first step of this part."""
        return max(self._clock() - self._start, 1e-9)

    def rates(self, done: int) -> dict[str, float]:
        """After ``done`` steps: ``tokens_per_s`` over the window (the steps since the
        last :meth:`next_window`), ``tokens_per_s_avg`` since the first step."""
        now = self._clock()
        window, total = max(now - self._window, 1e-9), max(now - self._start, 1e-9)
        return {
            "tokens_per_s": (done - self._window_step) * self.tokens_per_step / window,
            "tokens_per_s_avg": (done - self._start_step) * self.tokens_per_step / total,
        }

    def next_window(self, done: int) -> None:
        """Start the next window after ``done`` steps (call it once the logged step's
        own work, evaluation and checkpoint included, is over: the window then times
        training steps)."""
        self._window, self._window_step = self._clock(), done
