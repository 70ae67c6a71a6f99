"""moelab: mixture-of-experts routing, from probability maps to routing statistics."""

from __future__ import annotations

from moelab import maps
from moelab.moe import MoE, MoEConfig
from moelab.routing import Router, RouterConfig, RouterOutput

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "Router", "RouterConfig", "RouterOutput", "__version__", "maps"]
