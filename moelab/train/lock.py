"""One trainer per run folder: ``RUN/.lock``, held with ``flock`` while training.

The lock file holds the holder's process id, host and start time (JSON), so that a
refusal can say who holds the run. The kernel releases an ``flock`` when its process
ends, however it ends (a kill included): a lock file whose lock nobody holds is stale,
and the next trainer takes it over, saying whose it was. Under torchrun only rank 0
takes the lock; the others learn the outcome from it (moelab.train.loop).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK", "RunLock", "RunLocked"]

LOCK = ".lock"


class RunLocked(OSError):
    """Another process is training in the run folder (the message says which)."""


def _holder(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """``RunLock(run).acquire(say)`` takes the lock of the run folder ``run`` (which must
    exist) or raises :class:`RunLocked`; ``release()`` lets it go (also on ``with``
    exit). ``say`` receives the line that reports a stale lock taken over."""

    def __init__(self, run: str | Path) -> None:
        self.path = Path(run) / LOCK
        self._fd: int | None = None

    def acquire(self, say: Any = None) -> RunLock:
        import fcntl

        before = _holder(self.path) if self.path.is_file() else {}
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            who = _holder(self.path)
            pid, host = who.get("pid", "?"), who.get("host", "?")
            since = who.get("started")
            when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
            raise RunLocked(
                f"{self.path.parent} is in use by another trainer (process {pid} on {host}"
                f"{when}); wait for it to finish or stop it (Ctrl-C writes a checkpoint), "
                "then resume"
            ) from None
        # NOTE: locked: a holder recorded in the file is gone (its lock was released)
        if before.get("pid") is not None and say is not None:
            state = "still running, not training" if _alive(before.get("pid")) else "gone"
            say(
                f"taking over the lock of {self.path.parent} left by process "
                f"{before.get('pid')} on {before.get('host', '?')} ({state})"
            )
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(doc) + "\n").encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # NOTE: no holder recorded: the next one is not "taking over"
        except OSError:
            pass
        os.close(fd)  # releases the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
