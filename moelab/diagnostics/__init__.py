"""Diagnostics of trained routers: routing statistics per MoE layer and over layers."""

from __future__ import annotations

from moelab.diagnostics.accumulators import (
    FIELDS,
    GAP_BIN,
    GAP_MAX,
    ModelRoutingStats,
    RoutingStats,
    active_histograms,
    routing_stats,
)
from moelab.diagnostics.certify import CERT_FIELDS, RADIUS_BIN, CertificationStats
from moelab.diagnostics.evaluate import (
    LoadedRun,
    corpus_shard,
    evaluate,
    evaluate_truncation,
    load_run,
)
from moelab.diagnostics.quantiles import BinnedQuantiles
from moelab.diagnostics.replay import RoutingRecord, record, replay
from moelab.diagnostics.replay_formats import load_any, save_as
from moelab.diagnostics.run_stats import stats

__all__ = [
    "CERT_FIELDS",
    "FIELDS",
    "GAP_BIN",
    "GAP_MAX",
    "RADIUS_BIN",
    "BinnedQuantiles",
    "CertificationStats",
    "LoadedRun",
    "ModelRoutingStats",
    "RoutingRecord",
    "RoutingStats",
    "active_histograms",
    "corpus_shard",
    "evaluate",
    "evaluate_truncation",
    "load_any",
    "load_run",
    "record",
    "replay",
    "routing_stats",
    "save_as",
    "stats",
]
