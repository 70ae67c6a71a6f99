"""The torchtitan release this bridge is written and tested against, checked when
:mod:`moelab.integrations.torchtitan` is imported."""

from __future__ import annotations

import importlib.metadata

__all__ = ["PINNED", "check_version"]

PINNED = "0.3.0"
"""The torchtitan version whose router, MoE and config contracts the bridge follows."""


def check_version() -> str:
    """The installed torchtitan version; ImportError, in one line naming both versions,
    when it is not :data:`PINNED` (or torchtitan is not installed)."""
    try:
        installed = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"moelab.integrations.torchtitan needs torchtitan=={PINNED}, which is not "
            f"installed: pip install 'moelab[torchtitan]'"
        ) from None
    if installed != PINNED:
        raise ImportError(
            f"moelab.integrations.torchtitan is written for torchtitan=={PINNED}, but "
            f"torchtitan {installed} is installed: install torchtitan=={PINNED}"
        )
    return installed
