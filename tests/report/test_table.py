"""The one table type (moelab.report.table) and the report builder's section registry."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from moelab.report import builder
from moelab.report.builder import SECTIONS, ReportBuilder, load_sections
from moelab.report.table import Table, cell_text, summarize
from moelab.studies import StudyTable

COLUMNS = [("arm", "arm", "s"), ("loss", "l", ".4f"), ("share", "p", ".1%")]
ROWS = [
    {"arm": "a|b", "l": [1.0, 2.5, float("nan")], "p": 0.25},
    {"arm": "c", "l": None, "p": [0.1]},
]


def test_markdown_summarises_per_seed_cells_and_escapes_pipes() -> None:
    t = Table([("a|b", "arm", "s"), *COLUMNS[1:]], ROWS)
    assert t.markdown().split("\n") == [
        "| a\\|b | loss | share |",
        "|---|---:|---:|",
        "| a\\|b | 1.7500 ± 1.0607 | 25.0% |",
        "| c | - | 10.0% |",
    ]


def test_text_aligns_text_left_and_numbers_right() -> None:
    t = Table(COLUMNS, ROWS)
    assert t.text().split("\n") == [
        "arm             loss  share",
        "a|b  1.7500 ± 1.0607  25.0%",
        "c                  -  10.0%",
    ]


def test_latex_has_caption_label_and_escapes() -> None:
    tex = Table(COLUMNS, ROWS, "Loss & share_", "main").latex()
    assert r"\caption{Loss \& share\_}" in tex and r"\label{tab:main}" in tex
    assert r"a\textbar{}b & 1.7500 $\pm$ 1.0607 & 25.0\% \\" in tex
    assert r"\begin{tabular}{lrr}" in tex
    assert r"\label" not in Table(COLUMNS, ROWS, "No key.").latex()


def test_records_are_strict_json_keyed_by_header() -> None:
    t = Table([("x", "x", ".3f"), ("name", "n", "s")], [{"x": float("inf"), "n": "r"}])
    assert t.records() == [{"x": None, "name": "r"}]
    json.dumps(t.records(), allow_nan=False)


def test_study_document_round_trips() -> None:
    t = StudyTable("main", "Loss", COLUMNS, ROWS, note="n")
    assert isinstance(t, Table) and t.title == "Loss" and t.key == "main"
    doc = json.loads(json.dumps(t.to_json(), allow_nan=False))
    assert doc["rows"][0]["l"] == summarize([1.0, 2.5, float("nan")])
    back = StudyTable.from_json(doc)
    assert back.markdown() == t.markdown() and back.latex() == t.latex()
    assert Table.from_json(doc).markdown() == t.markdown()
    assert cell_text(doc["rows"][0]["l"], ".2f") == "1.75 ± 1.06"


def test_builder_runs_its_sections_in_order(tmp_path: Path) -> None:
    seen: list[str] = []

    def first(rep: ReportBuilder) -> None:
        seen.append("first")
        rep.tables["t"] = Table(COLUMNS, ROWS, "T.")
        rep.md.append(rep.tables["t"].markdown())

    def second(rep: ReportBuilder) -> None:
        seen.append(f"second after {len(rep.md)} lines")

    rep = ReportBuilder(tmp_path, [], None, sections=[first, second])
    rep.build()
    assert seen == ["first", "second after 1 lines"] and list(rep.tables) == ["t"]


def test_every_registered_section_resolves() -> None:
    sections = load_sections()
    assert len(sections) == len(SECTIONS) and all(callable(s) for s in sections)
    assert SECTIONS[-2:] == [
        "moelab.report.downstream:downstream_section",
        "moelab.report.analysis:analysis_section",
    ]


def test_no_section_is_imported_by_the_builder_or_the_report_at_import_time() -> None:
    """No import circle: the builder imports no section module (they import it), and
    importing the report imports no downstream code until a report is built."""
    tree = ast.parse(Path(builder.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "importlib", "collections.abc", "dataclasses",
                        "pathlib", "typing", "moelab.report.table"}  # fmt: skip
    code = "import sys, moelab.report; assert 'moelab.report.downstream' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
