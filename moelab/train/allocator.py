"""Keep freed memory in the process instead of handing it back to the OS after every
step (glibc's malloc, which torch's CPU tensors are allocated with).

A training step frees its activations and gradients in bulk at the end of backward.
By default glibc then returns the top of the heap to the OS (trimming) and serves
blocks above a threshold it adjusts on the fly with ``mmap``; the next step's tensors
of the same sizes take fresh pages, and every page costs a fault and a zeroing. On the
tiny preset that was about 2,800 page faults per step and 3-4% of the step time
(``moelab bench train``'s models, 8 x 128 tokens, one thread; docs/speed.md).

:func:`keep_freed_memory` sets the two thresholds once for the process: blocks up to
32 MiB come from the heap, and the heap is trimmed only when more than 1 GiB of it is
free. The process keeps up to that much freed memory for reuse. The ``moelab`` command
calls it at start-up (every command allocates tensors step after step); a library user
decides for their own process.

It does nothing where malloc is not glibc's, when ``MOELAB_KEEP_FREED_MEMORY=0``, and
when the user set glibc's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
(theirs win).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "in_force", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size (bytes) come from the heap (glibc's largest dynamic value)."""
TRIM_THRESHOLD = 1 << 30
"""The heap is given back to the OS only when more than this much (bytes) of it is free."""

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_state: dict[str, bool | None] = {"applied": None}


def keep_freed_memory() -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process (once); whether
    they are in force. See the module docstring for when it does nothing."""
    if _state["applied"] is not None:
        return bool(_state["applied"])
    _state["applied"] = _apply()
    return bool(_state["applied"])


def in_force() -> bool:
    """Whether :func:`keep_freed_memory` has set the thresholds in this process."""
    return bool(_state["applied"])


def _apply() -> bool:
    if os.environ.get("MOELAB_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:  # the process's own symbols: the C library it runs on, found without a search
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl ignores these)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # NOTE: mallopt returns 1 on success; the mmap threshold first, so that a refused
    # trim threshold leaves at most the harmless half
    return (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
