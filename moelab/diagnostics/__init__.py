"""Diagnostics of trained routers: routing statistics per MoE layer and over layers."""

from __future__ import annotations

from moelab.diagnostics.stats import (
    FIELDS,
    GAP_BIN,
    GAP_MAX,
    ModelRoutingStats,
    RoutingStats,
    routing_stats,
)

__all__ = ["FIELDS", "GAP_BIN", "GAP_MAX", "ModelRoutingStats", "RoutingStats", "routing_stats"]
