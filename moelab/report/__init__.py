"""Markdown + PNG comparison reports across trained runs (``moelab report``)."""

from __future__ import annotations

from moelab.report.builder import SECTIONS, ReportBuilder, ReportSection
from moelab.report.report import build_report, collect_run, format_routing_table, write_report
from moelab.report.table import Table

__all__ = [
    "SECTIONS",
    "ReportBuilder",
    "ReportSection",
    "Table",
    "build_report",
    "collect_run",
    "format_routing_table",
    "write_report",
]
