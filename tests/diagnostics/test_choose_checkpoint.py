"""Choosing the checkpoint that eval, stats and report measure: ``--step N`` (``step=``),
a damaged newest checkpoint refused with the intact older steps named (never replaced by
an older one unasked), and a lost ``checkpoints/latest`` pointer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelab import cli
from moelab.diagnostics import load_run
from moelab.runs.checkpoints import checkpoint_folder
from moelab.train import CheckpointError, train
from tests.train import make_corpus, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with checkpoints at steps 2, 4 and 6 (training keeps the newest two:
    the one of step 2 is put back)."""
    root = tmp_path_factory.mktemp("choose")
    corpus = make_corpus(root / "corpus", n_docs=16)
    run = root / "run"
    train(tiny_config(corpus, run, steps=4, checkpoint_every=2))
    shutil.copytree(checkpoint_folder(run, 2), root / "step2")
    train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)
    shutil.copytree(root / "step2", checkpoint_folder(run, 2))
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run that a test may damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _damage(run: Path, step: int) -> Path:
    weights = checkpoint_folder(run, step) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\x00" * 8
    weights.write_bytes(bytes(data))
    return weights


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_step_picks_the_checkpoint(run: Path) -> None:
    assert load_run(run).step == 6
    assert load_run(run, step=4).step == 4
    newest, older = load_run(run), load_run(run, step=2)
    w6 = newest.model.state_dict()
    w2 = older.model.state_dict()
    assert any(not w6[k].equal(w2[k]) for k in w6)  # another model, not the newest again
    with pytest.raises(FileNotFoundError, match=r"step 3 \(steps it has: 2, 4, 6\)"):
        load_run(run, step=3)


def test_a_damaged_newest_checkpoint_is_refused_naming_it_and_the_intact_steps(run: Path) -> None:
    _damage(run, 6)
    _damage(run, 2)
    with pytest.raises(CheckpointError) as err:
        load_run(run)
    message = str(err.value)
    assert "step_00000006" in message and "damaged" in message
    assert "intact older checkpoints: steps 4; pass --step 4" in message
    assert load_run(run, step=4).step == 4


def test_without_the_latest_pointer_the_newest_intact_step_is_taken(run: Path) -> None:
    (run / "checkpoints" / "latest").unlink()
    assert load_run(run).step == 6
    _damage(run, 6)
    assert load_run(run).step == 4


def test_the_commands_take_step(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ev = _json(["eval", str(run), "--top-k", "1", "2", "--step", "4", "--max-batches", "1"], capsys)
    assert ev["checkpoint_step"] == 4
    st = _json(["stats", str(run), "--step", "2", "--max-batches", "1"], capsys)
    assert st["checkpoint_step"] == 2
    out = run.parent / "report"
    argv = ["report", str(run), "--out", str(out), "--step", "4", "--max-batches", "1"]
    argv += ["--top-k", "1", "2"]
    rep = _json(argv, capsys)
    text = Path(rep["report"]).read_text()
    assert "checkpoint of step 4" in text
    # the routing table's loss is the checkpoint's, not training's final one
    final = json.loads((run / "summary.json").read_text())["val_loss"]
    assert rep["tables"]["routing"][0]["val loss"] != pytest.approx(final)


def test_command_line_errors_are_one_line(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _damage(run, 6)
    assert cli.main(["eval", str(run), "--top-k", "1", "--max-batches", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab eval: error: the newest checkpoint") and "--step 4" in err
    assert err.count("\n") == 1
    assert cli.main(["stats", str(run), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 5" in err and err.count("\n") == 1
    assert cli.main(["stats", "--hf", str(run), "--data", str(run), "--step", "2"]) == 2
    assert "--step picks a checkpoint of a moelab RUN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["stats", str(run), "--step", "-1"])
