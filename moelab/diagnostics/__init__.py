"""Diagnostics of trained routers: routing statistics per MoE layer and over layers."""

from __future__ import annotations

from moelab.diagnostics.evaluate import LoadedRun, corpus_shard, evaluate, load_run, stats
from moelab.diagnostics.stats import (
    FIELDS,
    GAP_BIN,
    GAP_MAX,
    ModelRoutingStats,
    RoutingStats,
    routing_stats,
)

__all__ = [
    "FIELDS",
    "GAP_BIN",
    "GAP_MAX",
    "LoadedRun",
    "ModelRoutingStats",
    "RoutingStats",
    "corpus_shard",
    "evaluate",
    "load_run",
    "routing_stats",
    "stats",
]
