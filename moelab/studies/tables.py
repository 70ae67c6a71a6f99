"""What a study's analysis returns: :class:`Section` (text, tables, figures) and
:class:`StudyTable` (a table whose numeric cells may hold one value per seed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.report.table import Table

__all__ = ["Section", "StudyTable"]

# ----------------------------------------------------------------------- seeds, cells


class StudyTable(Table):
    """A table of a study: a :class:`moelab.report.table.Table` built as ``StudyTable(key,
    title, columns, rows, note)``. ``columns``: ``(header, key, spec)`` with a format spec
    (".3f", ".1%", "d", or "s" for text). ``rows``: dicts from key to a text, a number,
    or a list with one value per seed (summarised as mean ± sd). ``key`` names it in
    results.json and tables.tex."""

    def __init__(
        self,
        key: str,
        title: str,
        columns: list[tuple[str, str, str]],
        rows: list[dict[str, Any]],
        note: str = "",
    ) -> None:
        super().__init__(columns, rows, title, key, note)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StudyTable:
        """The table back from its :meth:`to_json` document (cells already summarised)."""
        columns = [(c["header"], c["key"], c["spec"]) for c in doc["columns"]]
        return cls(doc["key"], doc["title"], columns, list(doc["rows"]), doc.get("note", ""))


@dataclass
class Section:
    """A part of the report: a title, Markdown text, tables and figures (PNG paths; the
    report links them relative to the study folder)."""

    title: str
    text: str = ""
    tables: list[StudyTable] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
