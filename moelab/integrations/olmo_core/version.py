"""The OLMo-core release this bridge is written against, checked when it is imported."""

from __future__ import annotations

import importlib.metadata

__all__ = ["PINNED", "check_version"]

PINNED = "3.0.0"
"""The ``ai2-olmo-core`` release whose ``MoERouter`` contract the bridge keeps."""


def check_version() -> str:
    """The installed ``ai2-olmo-core`` version; ImportError (one line naming both
    versions) unless it is :data:`PINNED`."""
    try:
        found = importlib.metadata.version("ai2-olmo-core")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"moelab.integrations.olmo_core needs ai2-olmo-core=={PINNED}, which is not "
            "installed: pip install 'moelab[olmo]'"
        ) from None
    if found != PINNED:
        raise ImportError(
            f"moelab.integrations.olmo_core is written for ai2-olmo-core=={PINNED}, found "
            f"{found}: install ai2-olmo-core=={PINNED}"
        )
    return found
