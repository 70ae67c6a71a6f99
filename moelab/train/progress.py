"""Time, throughput and progress of a training run.

* :class:`RunClock`: the wall-clock ``time`` (Unix seconds) and ``elapsed_s`` of every
  metrics row; ``elapsed_s`` counts from the start of ``train()``, on from the
  checkpoint's own ``elapsed_s`` when a run resumes, so over all parts of a run it is
  the run's training time (time between an interrupt and the resume is not counted,
  nor the steps after the checkpoint that the interrupted part trained).
* :class:`Throughput`: ``tokens_per_s``, the rate of the steps since the previous
  logged step (a logging window: what the run does now), and ``tokens_per_s_avg``,
  the rate since the first step of this part (compilation and warm-up included).
* :class:`Progress`: what stderr shows. On a terminal, a tqdm bar redrawn in place
  (``\r``) with the last logged numbers; elsewhere (a log file, a pipe, CI, a cluster
  job) plain lines, one per logged step (``log_every``), plus one every
  :data:`HEARTBEAT_S` seconds between them when the steps are slow::

      step 40/200 (20%)  loss 4.214  tok_s 3,124  active 2.00  elapsed 0:00:03
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["HEARTBEAT_S", "Progress", "RunClock", "Throughput", "format_duration", "is_terminal"]

HEARTBEAT_S = 60.0
"""Without a terminal: the most seconds between two progress lines while steps run."""


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


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (its ``isatty()``; False when it has none or is
    closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def format_duration(seconds: float) -> str:
    """``1:02:03``: hours, minutes and seconds."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Progress:
    """The progress of steps ``initial`` to ``total`` on ``stream`` (stderr), shown when
    ``enabled``: a tqdm bar on a terminal, plain lines elsewhere (see the module)."""

    def __init__(
        self,
        total: int,
        initial: int,
        enabled: bool,
        stream: TextIO | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total = total
        self.lines = enabled and not is_terminal(self.stream)
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._last_line = clock()
        self._bar = tqdm(
            total=total,
            initial=initial,
            disable=not enabled or self.lines,
            file=self.stream,
            dynamic_ncols=True,
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def logged(self, step: int, fields: dict[str, str], elapsed: float) -> None:
        """Step ``step`` logged the numbers ``fields`` (name: text), ``elapsed`` seconds
        into the run: the bar shows them, or they make a line."""
        if self.lines:
            self._line(step, fields, elapsed)
        else:
            self._bar.set_postfix(fields, refresh=False)

    def say(self, line: str) -> None:
        """A line of its own (a warning), above the bar on a terminal."""
        if self._bar.disable:
            print(line, file=self.stream, flush=True)
        else:
            self._bar.write(line, file=self.stream)

    def advance(self, step: int, elapsed: float) -> None:
        """Step ``step`` is done: the bar moves; without one, a line when none came for
        ``heartbeat_s`` seconds."""
        self._bar.update(1)
        if self.lines and self._clock() - self._last_line >= self.heartbeat_s:
            self._line(step, {}, elapsed)

    def _line(self, step: int, fields: dict[str, str], elapsed: float) -> None:
        words = [f"step {step}/{self.total} ({100 * step // max(self.total, 1)}%)"]
        words += [f"{name} {value}" for name, value in fields.items()]
        words.append(f"elapsed {format_duration(elapsed)}")
        print("  ".join(words), file=self.stream, flush=True)
        self._last_line = self._clock()
