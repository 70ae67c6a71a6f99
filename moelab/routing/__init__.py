"""The router pipeline: scorer -> temperature -> map -> selection -> gate, with
balancing, learned allocation across layers and certification helpers."""

from __future__ import annotations

from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput
from moelab.routing.router import Router

__all__ = ["Router", "RouterConfig", "RouterOutput"]
