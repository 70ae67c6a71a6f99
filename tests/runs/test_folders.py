"""moelab.runs.folders: what a folder holds (a run is a folder of RUN_ENTRIES alone),
whether report or study may write into it, and a folder replaced whole or not at all.
The commands' use of it: tests/studies/test_out_folder.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.runs.folders import (
    Staging,
    check_out,
    inspect_folder,
    read_marker,
    staged_folder,
    write_marker,
)
from moelab.runs.layout import RUN_ENTRIES


def _run_folder(path: Path) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        (path / name).write_text("{}")
    return path


def test_a_run_folder_is_its_entries_alone(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "run")
    assert {"config.json", "checkpoints", "metrics.jsonl"} <= RUN_ENTRIES
    folder = inspect_folder(run)
    assert folder.kinds == ("run",) and folder.made_by_moelab
    assert folder.describe() == "a moelab run"
    (run / "thesis.tex").write_text("mine")
    folder = inspect_folder(run)
    assert folder.foreign == ("thesis.tex",) and not folder.made_by_moelab


def test_an_empty_or_missing_folder_may_be_written(tmp_path: Path) -> None:
    assert check_out(tmp_path / "new", "report").exists is False
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("")
    assert check_out(tmp_path / "empty", "study", study="toy").empty


def test_a_run_folder_takes_a_report_with_overwrite_and_never_a_study(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "run")
    with pytest.raises(FileExistsError, match=r"holds a moelab run.*overwrite=True"):
        check_out(run, "report")
    assert check_out(run, "report", overwrite=True).kinds == ("run",)
    with pytest.raises(FileExistsError, match="never into a run folder"):
        check_out(run, "study", overwrite=True, study="toy")


def test_a_marked_folder_is_its_commands_own(tmp_path: Path) -> None:
    write_marker(tmp_path / "s", "study", study="toy", scale="quick")
    assert check_out(tmp_path / "s", "report").empty  # the marker alone: still empty
    (tmp_path / "s" / "report.md").write_text("# Study: Toy\n")
    assert read_marker(tmp_path / "s", "study")["study"] == "toy"
    assert read_marker(tmp_path / "s", "report") is None
    assert check_out(tmp_path / "s", "study", study="toy").kinds == ("study",)
    with pytest.raises(FileExistsError, match="the study other did not make"):
        check_out(tmp_path / "s", "study", study="other")


def test_staging_moves_its_files_in_last_ones_last(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / ".moelab-staging-old").mkdir(parents=True)  # left by a crashed command
    staging = Staging(out)
    assert not (out / ".moelab-staging-old").exists()
    for name in ("b.md", "a.png", "report.md"):
        (staging.dir / name).write_text(name)
    assert staging.final(staging.dir / "a.png") == out / "a.png"
    assert staging.commit(last=["report.md"]) == ["a.png", "b.md", "report.md"]
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "b.md", "report.md"]


def test_a_staged_folder_replaces_the_old_one_or_leaves_it(tmp_path: Path) -> None:
    path = tmp_path / "result"
    path.mkdir()
    (path / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_folder(path, ".result.staged") as staged:
        (staged / "new.txt").write_text("new")
        raise RuntimeError("a failed check")
    assert [p.name for p in path.iterdir()] == ["old.txt"]
    assert not (tmp_path / ".result.staged").exists()
    with staged_folder(path, ".result.staged") as staged:
        (staged / "new.txt").write_text("new")
    assert [p.name for p in path.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]
