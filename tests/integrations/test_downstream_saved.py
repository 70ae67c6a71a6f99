"""RUN/downstream.json records the checkpoint step, --limit and the task versions; one
file never mixes two settings (an earlier file is moved whole, never lost); moelab
report and the sparse-maps study mark or leave out scores of another checkpoint; and a
task whose data is not cached says, offline, that --network is needed."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from moelab.cli import main
from moelab.diagnostics import load_run
from moelab.train import train
from tests.train import make_corpus, tiny_config

STEPS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def base_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A softmax top-2 run of STEPS steps, one MoE layer of 4 experts."""
    out = tmp_path_factory.mktemp("runs") / "soft"
    train(tiny_config(corpus, out, map="softmax", steps=STEPS, eval_batches=1))
    return out


@pytest.fixture
def run(base_run: Path, tmp_path: Path) -> Path:
    """A copy of the trained run that a test may score and extend."""
    return Path(shutil.copytree(base_run, tmp_path / "soft"))


def _cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _score(capsys: pytest.CaptureFixture[str], run: Path, *extra: str) -> None:
    argv = ["downstream", str(run), "--tasks", "moelab_cloze", "--threads", "1", *extra]
    rc, _, err = _cli(capsys, argv)
    assert rc == 0, err


def _saved(run: Path) -> dict[str, Any]:
    return json.loads((run / "downstream.json").read_text(encoding="utf-8"))


def _yaml_version(run: Path) -> float:
    """The version the generated cloze task's YAML declares (metadata: version: X)."""
    text = (run / "downstream" / "moelab_cloze" / "moelab_cloze.yaml").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("version:")]
    return float(line.split(":", 1)[1])


def _extend(corpus: Path, run: Path, steps: int) -> None:
    train(tiny_config(corpus, run, map="softmax", steps=steps, eval_batches=1), resume=True)


def test_the_file_records_step_limit_versions_and_never_mixes_limits(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _score(capsys, run, "--limit", "4", "--top-k", "1", "2")
    first = _saved(run)
    step = load_run(run).step
    assert step == STEPS
    assert first["checkpoint_step"] == step and first["limit"] == 4
    assert first["task_versions"] == {"moelab_cloze": _yaml_version(run)}
    assert [(r["top_k"], r["samples"], r["limit"]) for r in first["rows"]] == [(1, 4, 4), (2, 4, 4)]
    assert all(r["checkpoint_step"] == step for r in first["rows"] + first["routing"])

    # another --limit: the file is replaced whole, the earlier one moved, not rewritten
    before = (run / "downstream.json").read_bytes()
    _score(capsys, run, "--limit", "2")
    second = _saved(run)
    assert [(r["top_k"], r["samples"], r["limit"]) for r in second["rows"]] == [(2, 2, 2)]
    assert [r["top_k"] for r in second["routing"]] == [2]
    kept = run / "downstream" / f"downstream.step_{step:08d}.limit_4.json"
    assert kept.read_bytes() == before
    assert any(str(kept) in n for n in second["notes"])

    # the same setting merges: K = 1 joins the K = 2 row of --limit 2, nothing moves
    _score(capsys, run, "--limit", "2", "--top-k", "1")
    third = _saved(run)
    assert [(r["top_k"], r["samples"]) for r in third["rows"]] == [(1, 2), (2, 2)]
    assert sorted(p.name for p in (run / "downstream").glob("downstream.*.json")) == [kept.name]


def test_an_old_file_is_moved_whole_and_a_broken_one_kept(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = {"rows": [{"task": "moelab_cloze", "top_k": 1, "acc": 0.5, "metrics": {}}]}
    (run / "downstream.json").write_text(json.dumps(old))
    _score(capsys, run, "--limit", "2")
    assert json.loads((run / "downstream" / "downstream.step_unknown.json").read_text()) == old
    assert [r["top_k"] for r in _saved(run)["rows"]] == [2]
    (run / "downstream.json").write_text('{"rows": [')
    _score(capsys, run, "--limit", "2")
    kept = run / "downstream" / "downstream.step_unknown.2.json"
    assert kept.read_text() == '{"rows": ['
    assert _saved(run)["limit"] == 2


def _report(run: Path, out: Path) -> tuple[list[dict[str, Any]], str]:
    from moelab.report import build_report

    doc = build_report([run], out, top_ks=[2], max_batches=1)
    return doc["tables"]["downstream"], Path(doc["report"]).read_text()


def test_report_marks_the_scores_of_an_older_checkpoint(
    run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _score(capsys, run, "--limit", "3")
    rows, md = _report(run, tmp_path / "r0")
    assert [(r["K"], r["step"], r["scores"], r["limit"]) for r in rows] == [
        (2, STEPS, "current", "3")
    ]
    assert "Stale" not in md and "Step unknown" not in md
    assert "Task versions (lm-evaluation-harness): `moelab_cloze` 1.0." in md

    _extend(corpus, run, STEPS + 2)  # the run is trained further: a newer checkpoint
    assert load_run(run).step == STEPS + 2
    rows, md = _report(run, tmp_path / "r1")
    assert [(r["K"], r["step"], r["scores"]) for r in rows] == [(2, STEPS, f"stale: step {STEPS}")]
    assert f"scored at step {STEPS}; newest checkpoint {STEPS + 2}" in md

    _score(capsys, run, "--limit", "3")  # scored again: current, the old file kept
    rows, md = _report(run, tmp_path / "r2")
    assert [(r["K"], r["step"], r["scores"]) for r in rows] == [(2, STEPS + 2, "current")]
    assert "Stale" not in md
    assert f"downstream.step_{STEPS:08d}.limit_3.json" in md


def test_step_scores_an_older_checkpoint(
    run: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _extend(corpus, run, STEPS + 2)
    _score(capsys, run, "--limit", "3", "--step", str(STEPS))
    saved = _saved(run)
    assert saved["checkpoint_step"] == STEPS
    assert {r["checkpoint_step"] for r in saved["rows"]} == {STEPS}
    argv = ["downstream", str(run), "--tasks", "moelab_cloze", "--step", "3"]
    rc, _, err = _cli(capsys, argv)
    assert rc == 2 and f"no checkpoint of step 3 (steps it has: {STEPS}, {STEPS + 2})" in err


def test_study_leaves_out_the_scores_of_another_checkpoint(run: Path) -> None:
    from moelab.studies.sparse_maps import downstream_scores

    rows = [
        {"task": "cloze", "top_k": 2, "acc": 0.25, "metrics": {}, "checkpoint_step": 2},
        {"task": "qa", "top_k": 2, "acc": 0.5, "metrics": {}, "checkpoint_step": STEPS},
    ]
    (run / "downstream.json").write_text(json.dumps({"rows": rows, "routing": []}))
    assert downstream_scores(run) == {"qa": {"acc": 0.5, "perplexity": None}}


def test_report_and_study_on_files_without_a_step(run: Path, tmp_path: Path) -> None:
    from moelab.studies.sparse_maps import downstream_record
    from moelab.studies.sparse_maps.analysis import downstream_note

    # a file of an older moelab: no format, rows without a step
    rows = [{"task": "cloze", "top_k": 2, "acc": 0.25, "metrics": {}}]
    (run / "downstream.json").write_text(json.dumps({"rows": rows, "routing": []}))
    table, md = _report(run, tmp_path / "r")
    assert [(r["step"], r["scores"], r["limit"]) for r in table] == [(None, "step unknown", "?")]
    assert "Step unknown: `soft`" in md
    record = downstream_record(run)
    assert record["scores"] == {"cloze": {"acc": 0.25, "perplexity": None}}
    assert record["unknown"] and not record["stale"]
    assert "Step unknown: the scores of" in downstream_note({"a": [{"downstream_record": record}]})

    # rows of an older step (as the earlier moelab merged them): left out of the study
    rows = [
        {"task": "cloze", "top_k": 2, "acc": 0.25, "metrics": {}, "checkpoint_step": 2},
        {"task": "qa", "top_k": 2, "acc": 0.5, "metrics": {}, "checkpoint_step": STEPS},
    ]
    (run / "downstream.json").write_text(json.dumps({"rows": rows, "routing": []}))
    record = downstream_record(run)
    assert record["stale"] == [2] and record["newest"] == STEPS and not record["unknown"]
    note = downstream_note({"a": [{"downstream_record": record}]})
    assert f"scored at step 2; newest checkpoint {STEPS}" in note and "Left out" in note
    table, md = _report(run, tmp_path / "r2")
    # one table row per checkpoint step: the two steps never share a row
    assert [(r["step"], r["scores"], r["cloze acc"], r["qa acc"]) for r in table] == [
        (2, "stale: step 2", 0.25, None),
        (STEPS, "current", None, 0.5),
    ]
    assert f"scored at step 2; newest checkpoint {STEPS}" in md


def test_offline_task_without_cached_data_names_network(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets.config
    import huggingface_hub.constants

    # an empty cache, and no connection may be opened
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    argv = ["downstream", str(run), "--tasks", "hellaswag", "--threads", "1"]
    rc, out, err = _cli(capsys, argv)
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("moelab downstream: error: ")
    assert "--network" in line and "download" in line and "Hugging Face Hub" in line
    assert "hellaswag" in line
    assert attempts == []
    assert not (run / "downstream.json").exists()
