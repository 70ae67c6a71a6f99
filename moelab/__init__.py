"""moelab: mixture-of-experts routing, from probability maps to routing statistics.

Tensors are named by their shape (``probs_TE``: tokens x experts); the legend, one
meaning per letter, is in docs/extending.md, "Shape suffixes".
"""

from __future__ import annotations

from moelab import maps
from moelab.moe import MoE, MoEConfig
from moelab.routing import Router, RouterConfig, RouterOutput

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "Router", "RouterConfig", "RouterOutput", "__version__", "maps"]
