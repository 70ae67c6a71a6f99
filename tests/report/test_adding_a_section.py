"""docs/extending.md, "Adding a section of report.md": the page's toy section (run from
its code block) and its one line in ``moelab.report.builder.SECTIONS`` add a table to
report.md, to tables.tex and to the tables the report returns."""

from __future__ import annotations

import pytest

from moelab.report import ReportBuilder, builder
from tests._docs import install_page_module


@pytest.fixture
def toy_section(monkeypatch: pytest.MonkeyPatch) -> None:
    install_page_module(monkeypatch, "extending.md", "moelab.report.toy_section")  # new file
    # the registry line, alone here so that the other sections need no real runs
    monkeypatch.setattr(builder, "SECTIONS", ["moelab.report.toy_section:steps_section"])


def test_a_new_section_is_one_module_and_one_line(toy_section, tmp_path) -> None:
    data = [
        {"row": {"label": "softmax", "val_loss": 4.25}, "checkpoint_step": 6},
        {"row": {"label": "sparsemax", "val_loss": float("nan")}, "checkpoint_step": 8},
    ]
    rep = ReportBuilder(tmp_path, data, max_batches=1)
    rep.build()
    assert rep.md == [
        "## Checkpoint steps",
        "",
        "| run | step | val loss |\n|---|---:|---:|\n| softmax | 6 | 4.2500 |\n"
        "| sparsemax | 8 | - |",
        "",
    ]
    assert rep.tables["steps"].records() == [
        {"run": "softmax", "step": 6, "val loss": 4.25},
        {"run": "sparsemax", "step": 8, "val loss": None},
    ]
    assert r"\caption{Checkpoint step of every run.}" in rep.tables["steps"].latex()
