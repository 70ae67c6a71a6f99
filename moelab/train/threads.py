"""How many CPU threads torch should use: the cores this process may run on that
other work is not already keeping busy.

    default_threads()        # e.g. 1 on a 2-core machine where another job runs
    use_threads(None)        # set torch's intra-op threads to that default; returns it
    use_threads(4)           # set them to 4

Every command that computes (train, eval, stats, report, demo) calls :func:`use_threads`
with its ``--threads`` value, so the rule lives here only.

The rule (:func:`free_cores`):

    cores = len(os.sched_getaffinity(0))       the cores the OS lets this process use,
            capped by a cgroup CPU quota           (cpu.max, containers) when one is set
    busy  = round(1-minute load average - own) the other runnable work, in whole cores
    free  = max(1, cores - busy)

``own`` is this process's share of the load average: 0 before work starts (a command's
start-up, a few seconds of imports, adds well under half a core to the 1-minute mean,
which the rounding absorbs), torch's thread count while training runs. The load average
is the whole machine's; on a machine with more cores than the affinity mask allows,
work on the other cores counts as busy too, which errs toward fewer threads (NOTE: a
thread too many on a busy machine costs far more than one too few: on a loaded 2-core
machine, 2 threads ran 20x slower than 1, each step waiting for the thread that lost its
core). Without ``os.getloadavg`` (Windows) ``busy`` is 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

__all__ = ["available_cores", "default_threads", "free_cores", "oversubscribed", "use_threads"]


def _cgroup_quota() -> float | None:
    """Cores allowed by a cgroup v2 CPU quota (``cpu.max``: "quota period"), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(float(quota) / float(period), 1.0)
    except (ValueError, ZeroDivisionError):
        return None


def available_cores() -> int:
    """Cores this process may run on: its affinity mask (``os.sched_getaffinity``, not
    the machine's count), capped by a cgroup CPU quota; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # NOTE: macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(cores, 1)


def free_cores(own: float = 0.0) -> int:
    """Cores not kept busy by other work: ``available_cores() - round(load - own)``, at
    least 1, where ``load`` is the 1-minute load average and ``own`` this process's share
    of it (0 before work starts; the number of busy threads while it computes)."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # NOTE: no load average (Windows): assume idle
        return cores
    busy = round(max(load - own, 0.0))
    return max(cores - busy, 1)


def default_threads(share: int = 1) -> int:
    """The thread count a command uses when none is given: the free cores, divided
    between ``share`` processes (the ranks of one machine under torchrun), at least 1."""
    return max(free_cores() // max(share, 1), 1)


def use_threads(threads: int | None, share: int = 1) -> int:
    """Set torch's intra-op threads to ``threads`` (None: :func:`default_threads`) and
    return the number set. Raises ValueError for a count below 1."""
    if threads is None:
        threads = default_threads(share)
    elif int(threads) != threads or threads < 1:
        raise ValueError(f"threads must be a whole number >= 1, got {threads!r}")
    threads = int(threads)
    torch.set_num_threads(threads)
    return threads


def oversubscribed(threads: int, share: int = 1, elapsed: float | None = None) -> int | None:
    """The free cores per process when fewer than ``threads``, else None: does this
    process, computing with ``threads`` threads beside ``share - 1`` like it, ask for
    more cores than other work leaves?

    ``elapsed``: seconds this process has been computing, None for not yet. Its own
    threads then make up ``threads * share * (1 - exp(-elapsed / 60))`` of the 1-minute
    load average (the kernel's exponential mean), which is taken out."""
    own = 0.0 if elapsed is None else threads * share * -math.expm1(-elapsed / 60.0)
    per_process = max(free_cores(own=own) // max(share, 1), 1)
    return per_process if threads > per_process else None
