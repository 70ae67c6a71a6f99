"""moelab: mixture-of-experts routing, from probability maps to routing statistics.

Tensors are named by their shape (``probs_TE``: tokens x experts); the legend, one
meaning per letter, is :mod:`moelab.shapes`.

The names below (``maps``, ``MoE``, ``Router``, ...) are imported on first use, so that
``import moelab`` (and ``moelab --help``) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "Router", "RouterConfig", "RouterOutput", "__version__", "maps"]

_LAZY = {
    "maps": ("moelab.maps", None),
    "MoE": ("moelab.moe", "MoE"),
    "MoEConfig": ("moelab.moe", "MoEConfig"),
    "Router": ("moelab.routing", "Router"),
    "RouterConfig": ("moelab.routing", "RouterConfig"),
    "RouterOutput": ("moelab.routing", "RouterOutput"),
}

if TYPE_CHECKING:
    from moelab import maps
    from moelab.moe import MoE, MoEConfig
    from moelab.routing import Router, RouterConfig, RouterOutput


def __getattr__(name: str) -> Any:
    """The public names of :data:`__all__`, imported when first asked for (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'moelab' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
