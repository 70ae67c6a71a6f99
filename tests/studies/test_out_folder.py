"""``report --out`` and ``study --out`` write only into a folder they made (or, with
--overwrite, one another moelab command made): a study's report, a user's files, a
corpus and a run folder stay as they were; a study and a report reuse their own folder.

One toy study (two arms, one seed, 4 steps) gives the study folder and the trained runs
the reports read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelab import cli
from moelab.studies import run_study
from tests.studies.test_core import ToyStudy
from tests.train import make_corpus

REPORT = ["--max-batches", "1", "--top-k", "1", "2"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("out_folder")
    corpus = make_corpus(root / "corpus", n_docs=20, sentences=6)
    out = root / "study"
    doc = run_study(ToyStudy(), out, scale="quick", seeds=1, data=str(corpus), progress=False)
    return out, corpus, doc


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below ``folder``: its bytes and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one stderr line ``moelab COMMAND: error: MESSAGE``: its message."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    prefix = f"moelab {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) :].strip()


def _legacy(study: Path, where: Path) -> Path:
    """A copy of the study folder as studies made it before they left a marker."""
    shutil.copytree(study, where)
    (where / ".moelab-study.json").unlink(missing_ok=True)
    return where


# --- report ----------------------------------------------------------------------------


@pytest.mark.parametrize("marked", [True, False], ids=["study", "legacy-study"])
def test_report_into_a_study_folder_is_refused(toy, tmp_path, capsys, marked):
    study, _, _ = toy
    out = study if marked else _legacy(study, tmp_path / "old")
    before = _snapshot(out)
    run = study / "runs" / "soft" / "seed0"
    assert cli.main(["report", str(run), "--out", str(out), *REPORT]) == 2
    message = _error(capsys, "report")
    assert f"output folder {out} holds the runs and report of the study toy" in message
    assert "choose another (new or empty) folder" in message and "--overwrite" in message
    assert _snapshot(out) == before  # report.md, tables.tex, results.json byte-identical


@pytest.mark.parametrize("earlier_report", [False, True], ids=["thesis", "report+thesis"])
def test_report_into_a_folder_with_a_users_file_is_refused_even_with_overwrite(
    toy, tmp_path, capsys, earlier_report
):
    study, _, _ = toy
    run = str(study / "runs" / "soft" / "seed0")
    out = tmp_path / "thesis"
    if earlier_report:
        assert cli.main(["report", run, "--out", str(out), *REPORT]) == 0
        capsys.readouterr()
    out.mkdir(exist_ok=True)
    (out / "thesis.tex").write_text("\\documentclass{article}\n")
    before = _snapshot(out)
    for extra in ([], ["--overwrite"]):
        assert cli.main(["report", run, "--out", str(out), *REPORT, *extra]) == 2
        message = _error(capsys, "report")
        assert "files moelab did not write: thesis.tex" in message, message
        assert "--overwrite writes only over a folder that moelab made" in message
        assert _snapshot(out) == before
    if not earlier_report:
        assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_report_rerun_into_its_own_folder_refreshes_it(toy, tmp_path, capsys):
    from moelab.runs.folders import inspect_folder

    study, _, _ = toy
    soft, sparse = (str(study / "runs" / arm / "seed0") for arm in ("soft", "sparse"))
    out = tmp_path / "rep"
    assert cli.main(["report", soft, sparse, "--out", str(out), *REPORT]) == 0
    capsys.readouterr()
    assert (out / "load_sparse_seed0.png").is_file()
    marker = json.loads((out / ".moelab-report.json").read_text())
    assert marker["made_by"] == "moelab report" and "report.md" in marker["files"]
    assert inspect_folder(out).kinds == ("report",)
    # again with one run: the folder is the report's own, refreshed without --overwrite
    assert cli.main(["report", soft, "--out", str(out), *REPORT, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["report"] == str(out / "report.md")
    assert all(Path(f).parent == out and Path(f).is_file() for f in doc["files"])
    text = (out / "report.md").read_text()
    assert "soft_seed0" in text and "sparse_seed0" not in text
    assert not (out / "load_sparse_seed0.png").exists()  # the earlier report's, removed
    assert not [p for p in out.iterdir() if p.name.startswith(".moelab-staging-")]
    assert json.loads((out / ".moelab-report.json").read_text())["runs"] == [soft]


def test_a_failed_refresh_leaves_the_earlier_report_whole(toy, tmp_path, monkeypatch):
    """The new files are built aside and renamed in at the end: a report that fails half
    way (here in its load section, after the loss, sweep and gap figures) leaves every
    file of the earlier report as it was."""
    from moelab.report import build_report
    from moelab.report import sections as sections_module

    study, _, _ = toy
    run = study / "runs" / "soft" / "seed0"
    out = tmp_path / "rep"
    build_report([run], out, top_ks=(1, 2), max_batches=1)
    before = _snapshot(out)

    def broken(rep):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(sections_module, "_load_section", broken)
    with pytest.raises(RuntimeError, match="disk gone"):
        build_report([run], out, top_ks=(1, 2), max_batches=1)
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith(".moelab-")} == {
        k: v for k, v in before.items() if not k.startswith(".moelab-")
    }
    assert not [p for p in out.iterdir() if p.name.startswith(".moelab-staging-")]


def test_report_into_a_run_folder_needs_overwrite(toy, tmp_path, capsys):
    study, _, _ = toy
    run = shutil.copytree(study / "runs" / "soft" / "seed0", tmp_path / "run")
    before = _snapshot(run)
    assert cli.main(["report", str(run), "--out", str(run), *REPORT]) == 2
    assert "holds a moelab run" in _error(capsys, "report")
    assert _snapshot(run) == before
    assert cli.main(["report", str(run), "--out", str(run), *REPORT, "--overwrite"]) == 0
    assert (run / "report.md").is_file()
    # the run is untouched
    assert {k: v for k, v in _snapshot(run).items() if k in before} == before


# --- study -----------------------------------------------------------------------------


def test_study_out_on_a_corpus_folder_is_refused(toy, capsys):
    _, corpus, _ = toy
    before = _snapshot(corpus)
    argv = ["study", "sparse-maps", "--scale", "quick", "--data", str(corpus)]
    for extra in ([], ["--overwrite"]):
        assert cli.main([*argv, "--out", str(corpus), "--threads", "1", *extra]) == 2
        message = _error(capsys, "study")
        assert f"output folder {corpus} holds a corpus" in message, message
        assert "doc000.txt" in message and "choose another" in message
    assert _snapshot(corpus) == before  # no runs/, report.md or marker


def test_study_out_on_a_run_folder_is_refused(toy, capsys):
    study, corpus, _ = toy
    run = study / "runs" / "soft" / "seed0"
    before = _snapshot(run)
    argv = ["study", "sparse-maps", "--scale", "quick", "--data", str(corpus)]
    for extra in ([], ["--overwrite"]):
        assert cli.main([*argv, "--out", str(run), "--threads", "1", *extra]) == 2
        message = _error(capsys, "study")
        assert f"output folder {run} holds a moelab run" in message, message
        assert "never into a run folder" in message
    assert _snapshot(run) == before


def test_study_rerun_on_its_own_folder_reuses_it(toy, tmp_path):
    from moelab.runs.folders import inspect_folder

    study, corpus, doc = toy
    marker = json.loads((study / ".moelab-study.json").read_text())
    assert marker["made_by"] == "moelab study" and marker["study"] == "toy"
    assert marker["scale"] == "quick"
    folder = inspect_folder(study)
    assert folder.kinds == ("study",) and folder.study == "toy" and folder.made_by_moelab
    for out in (study, _legacy(study, tmp_path / "old")):
        again = run_study(ToyStudy(), out, scale="quick", seeds=1, data=str(corpus), progress=False)
        assert again["arm_states"] == {"soft": ["reused"], "sparse": ["reused"]}
        assert again["tables"] == doc["tables"]
        assert not [p for p in out.iterdir() if p.name.startswith(".moelab-staging-")]
    # a legacy folder is marked as the study's from now on
    assert json.loads((tmp_path / "old" / ".moelab-study.json").read_text())["study"] == "toy"


def test_another_study_needs_overwrite(toy, tmp_path):
    study, corpus, _ = toy

    class Other(ToyStudy):
        name = "other"

    out = _legacy(study, tmp_path / "copy")
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match="holds the runs and report of the study toy"):
        run_study(Other(), out, scale="quick", seeds=1, data=str(corpus), progress=False)
    assert _snapshot(out) == before
    doc = run_study(
        Other(), out, scale="quick", seeds=1, data=str(corpus), progress=False, overwrite=True
    )
    assert doc["study"] == "other" and doc["arm_states"]["soft"] == ["reused"]
    assert json.loads((out / ".moelab-study.json").read_text())["study"] == "other"


def test_a_report_over_a_study_folder_and_the_study_back(toy, tmp_path, capsys):
    """report --overwrite writes into a study's folder (its runs untouched); the folder
    then holds both, so the study needs --overwrite to take it back, and is its own
    again after. A report folder inside the study's folder is no obstacle."""
    from moelab.runs.folders import inspect_folder

    study, corpus, _ = toy
    out = _legacy(study, tmp_path / "copy")
    runs = _snapshot(out / "runs")
    run = str(out / "runs" / "soft" / "seed0")
    assert cli.main(["report", run, "--out", str(out), *REPORT, "--overwrite"]) == 0
    assert (out / "report.md").read_text().startswith("# moelab report")
    assert _snapshot(out / "runs") == runs
    assert inspect_folder(out).kinds == ("study", "report")
    again = dict(scale="quick", seeds=1, data=str(corpus), progress=False)
    mixed = "study toy, and a moelab report: not the study toy's alone"
    with pytest.raises(FileExistsError, match=mixed):
        run_study(ToyStudy(), out, **again)
    run_study(ToyStudy(), out, **again, overwrite=True)
    assert (out / "report.md").read_text().startswith("# Study: Toy")
    assert inspect_folder(out).kinds == ("study",)
    assert cli.main(["report", run, "--out", str(out / "report"), *REPORT]) == 0
    capsys.readouterr()
    folder = inspect_folder(out)
    assert folder.kinds == ("study",) and folder.nested == ("report",) and not folder.foreign
    doc = run_study(ToyStudy(), out, **again)
    assert doc["arm_states"] == {"soft": ["reused"], "sparse": ["reused"]}
