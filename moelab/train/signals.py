"""Stopping on a signal: :class:`StopRequest` (the handlers of SIGINT and SIGTERM: stop
after the step under way; the same signal again stops at once) and what train() raises
then, :class:`TrainingInterrupted` (a checkpoint was written) and
:class:`TrainingAborted` (the second signal: none was).

The loop decides when a request takes effect (after a step, agreed across ranks); see
moelab.train.loop.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from moelab.runs.checkpoints import checkpoint_step


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on SIGINT or SIGTERM after writing a checkpoint of ``step``.

    A KeyboardInterrupt, so that code catching Exception does not swallow a stop the
    user asked for. ``str()`` is the message to print: where the checkpoint is and the
    command that resumes the run (``command``). ``exit_code`` is 128 + the signal's
    number, what a shell reports for a process the signal ended (130, 143)."""

    def __init__(self, step: int, checkpoint: Path, signum: int, command: str) -> None:
        self.step = step
        self.checkpoint = checkpoint
        self.signal = signal.Signals(signum).name
        self.exit_code = 128 + signum
        self.command = command
        super().__init__(
            f"training interrupted by {self.signal} at step {step}; checkpoint written to "
            f"{checkpoint}\nresume with: {command}\n(from Python: train(config, resume=True))"
        )


class TrainingAborted(TrainingInterrupted):
    """The same signal came twice: training stopped at once, during step ``step + 1`` or
    the checkpoint of ``step``, without writing one (a checkpoint write under way is
    abandoned whole: nothing of it is left). ``checkpoint`` is the newest checkpoint
    there is (None when there is none: a resume starts from step 0); ``exit_code`` is
    128 + the signal's number."""

    def __init__(self, step: int, checkpoint: Path | None, signum: int, command: str) -> None:
        KeyboardInterrupt.__init__(self)
        self.step = step
        self.checkpoint = checkpoint  # type: ignore[assignment]
        self.signal = signal.Signals(signum).name
        self.exit_code = 128 + signum
        self.command = command
        kept = (
            f"the newest checkpoint is {checkpoint} (step {checkpoint_step(checkpoint)})"
            if checkpoint is not None
            else "there is no checkpoint yet (a resume starts from step 0 and keeps the "
            "prepared data)"
        )
        self.args = (
            f"{self.signal} twice: stopped at once after step {step}, without a checkpoint "
            f"of it; {kept}\nresume with: {command}",
        )

    def __str__(self) -> str:
        return str(self.args[0])


class StopRequest:
    """Within ``with``: SIGINT and SIGTERM ask the loop to stop after the step under
    way (``signum`` holds the signal); the same signal again stops at once
    (KeyboardInterrupt), unless it comes within ``repeat_after`` seconds of the first:
    under a launcher (torchrun) the terminal's Ctrl-C can reach a rank twice, from the
    terminal and forwarded by the launcher. Signal handlers can only be set in the main
    thread; elsewhere this does nothing and the signals keep their handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeat_after: float = 0.0) -> None:
        self.signum = 0
        self.repeat_after = repeat_after
        self._first = 0.0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == self.signum:
            if time.monotonic() - self._first < self.repeat_after:
                return  # the same Ctrl-C, delivered twice
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} twice: stopped at once")
        if not self.signum:
            self.signum, self._first = signum, time.monotonic()
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step and writing a "
            "checkpoint (send it again to stop at once, without one)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
