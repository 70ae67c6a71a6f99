"""The builder of ``moelab report``'s report.md and the registry of its sections.

A section is a function (or any callable) that takes the :class:`ReportBuilder` and adds
to it: lines to ``md``, figures (drawn into ``out``) to ``files``, tables by name to
``tables`` (:class:`moelab.report.table.Table`; one with a caption also goes to
tables.tex). :data:`SECTIONS` names them in report.md's order as ``"module:function"``,
imported when a report is built, so that this module imports none of them and a section
imports this module and the table module without an import circle. A new section: one
module with its function, and one line in :data:`SECTIONS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.report.table import Table

__all__ = ["SECTIONS", "ReportBuilder", "ReportSection", "load_sections"]

ReportSection = Callable[["ReportBuilder"], None]
"""A section of report.md: adds its lines, figures and tables to the builder."""

SECTIONS: list[str] = [
    "moelab.report.sections:_loss_section",
    "moelab.report.sections:_routing_section",
    "moelab.report.sections:_sweep_section",
    "moelab.report.sections:_training_section",
    "moelab.report.sections:_gap_section",
    "moelab.report.sections:_certification_section",
    "moelab.report.sections:_lapsum_section",
    "moelab.report.sections:_active_section",
    "moelab.report.sections:_load_section",
    "moelab.report.downstream:downstream_section",
    "moelab.report.analysis:analysis_section",
]
"""The sections of report.md in order, as ``"module:function"``."""


def load_sections(names: Sequence[str] | None = None) -> list[ReportSection]:
    """The section functions named in ``names`` (default :data:`SECTIONS`), imported now."""
    out = []
    for name in SECTIONS if names is None else names:
        module, _, attr = name.partition(":")
        out.append(getattr(importlib.import_module(module), attr))
    return out


@dataclass
class ReportBuilder:
    """What the sections build up: report.md's lines (``md``), the figures (``files``)
    and the tables (``tables``, by name: report.md's tables as numbers, those with a
    caption also in tables.tex), from the entries ``data`` (one per run or saved result,
    see :func:`moelab.report.collect_run`) measured on ``max_batches``. ``out`` is the
    folder the figures are drawn into. :meth:`build` runs ``sections`` in order (by
    default :data:`SECTIONS`)."""

    out: Path
    data: list[dict[str, Any]]
    max_batches: int | None
    md: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    tables: dict[str, Table] = field(default_factory=dict)
    sections: Sequence[ReportSection] | None = None

    @property
    def moe(self) -> list[dict[str, Any]]:
        """The MoE runs (not dense, not saved results)."""
        return [d for d in self.data if not d["dense"] and not d.get("result")]

    @property
    def results(self) -> list[dict[str, Any]]:
        """The entries read from saved ``moelab stats`` / ``eval`` results."""
        return [d for d in self.data if d.get("result")]

    @property
    def routed(self) -> list[dict[str, Any]]:
        """The entries with routing statistics: MoE runs and results with a stats file."""
        return [d for d in self.data if not d["dense"] and (not d.get("result") or d["stats"])]

    def skip_note(self, what: str) -> list[str]:
        """The report.md lines saying that the saved results are left out of a section."""
        if not self.results:
            return []
        names = ", ".join(f"`{d['label']}`" for d in self.results)
        return [f"Saved results ({names}) have no {what}: left out here.", ""]

    def build(self) -> None:
        """Run every section in order (``sections``, or :data:`SECTIONS`)."""
        for section in self.sections if self.sections is not None else load_sections():
            section(self)
