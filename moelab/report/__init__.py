"""Markdown + PNG comparison reports across trained runs (``moelab report``)."""

from __future__ import annotations

from moelab.report.report import build_report, collect_run, format_routing_table, write_report

__all__ = ["build_report", "collect_run", "format_routing_table", "write_report"]
