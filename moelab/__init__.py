"""moelab: mixture-of-experts routing, from probability maps to routing statistics.

Tensors are named by their shape (``probs_TE``: tokens x experts); the legend, one
meaning per letter, is :mod:`moelab.shapes`.

The names below (``maps``, ``MoE``, ``Router``, ...) are imported on first use, so that
``import moelab`` (and ``moelab --help``) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moelab._lazy import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
