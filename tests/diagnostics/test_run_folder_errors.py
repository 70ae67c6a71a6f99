"""The errors of reading a run folder back (issue 39, items 9 and 11): one line that
names the file and says what to do, never advice that loses the run's work
(``--overwrite`` deletes its checkpoints) nor a flag the command does not have; an
evaluation on the run's own data needs no tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from moelab.cli import main
from moelab.diagnostics import evaluate
from moelab.runs.checkpoints import CheckpointError
from moelab.train import TrainConfig, latest_checkpoint, train
from tests.train import TINY_MODEL, tiny_config


@pytest.fixture(scope="module")
def corpus(small_corpus: Path) -> Path:
    return small_corpus


@pytest.fixture(scope="module")
def base(four_step_run: Path) -> Path:
    """A finished run of 4 steps with checkpoints at 2 and 4 (copied by the tests)."""
    return four_step_run


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _one_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moelab {command}: error: "), lines
    assert "--overwrite" not in lines[0]  # it would delete the run's checkpoints
    return lines[0]


# ---------------------------------------------------- a damaged tokenizer.json (item 9)


@pytest.mark.parametrize("damage", ["empty", "cut short"])
def test_eval_on_the_runs_own_data_needs_no_tokenizer(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = _copy(base, tmp_path)
    text = (run / "tokenizer.json").read_bytes()
    (run / "tokenizer.json").write_bytes(b"" if damage == "empty" else text[: len(text) // 2])
    capsys.readouterr()
    args = ["eval", str(run), "--top-k", "1", "2", "--max-batches", "2", "--threads", "1"]
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)["results"]
    assert rows == evaluate(base, [1, 2], max_batches=2)["results"]  # the intact run's
    assert "warning" in out.err and str(run / "tokenizer.json") in out.err
    # where the tokenizer is needed: one line naming it, a way out that keeps the run
    assert main([*args, "--data", str(tmp_path)]) == 2
    err = _one_error(capsys, "eval")
    assert str(run / "tokenizer.json") in err and "checkpoints are kept" in err


def test_a_damaged_shard_of_a_trained_run_is_not_mended_by_starting_over(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base, tmp_path)
    val = run / "data" / "val.bin"
    data = bytearray(val.read_bytes())
    data[1] ^= 0x01  # a high byte: the ids stay in range, only the hash tells
    val.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["eval", str(run), "--top-k", "2", "--threads", "1"]) == 2
    err = _one_error(capsys, "eval")
    assert str(val) in err and "resume" in err


# ------------------------------------------------- config.json edited (item 9)


def _edit(run: Path, **model: Any) -> None:
    path = run / "config.json"
    saved = json.loads(path.read_text())
    saved["model"].update(model)
    path.write_text(json.dumps(saved))


@pytest.mark.parametrize("step", [None, 2])
def test_an_edited_config_json_is_named_not_called_damage(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int | None
) -> None:
    run = _copy(base, tmp_path)
    assert TINY_MODEL["n_experts"] == 4
    _edit(run, n_experts=8)
    capsys.readouterr()
    args = ["eval", str(run), "--top-k", "2", "--threads", "1"]
    assert main(args + ([] if step is None else ["--step", str(step)])) == 2
    err = _one_error(capsys, "eval")
    assert "model.n_experts: 8 in config.json, 4 in the checkpoint" in err
    assert "damaged" not in err and "--step" not in err
    assert "state.json" in err  # where the trained values are


def test_resume_with_an_edited_config_json_names_it_and_keeps_the_checkpoints(
    base: Path, corpus: Path, tmp_path: Path
) -> None:
    run = _copy(base, tmp_path)
    _edit(run, n_experts=8)
    model = {**TINY_MODEL, "n_experts": 8}
    with pytest.raises(CheckpointError) as err:
        train(tiny_config(corpus, run, steps=6, checkpoint_every=2, model=model), resume=True)
    message = str(err.value)
    assert "model.n_experts: 8 in config.json, 4 in the checkpoint" in message
    assert "--overwrite" not in message and "intact" in message
    assert latest_checkpoint(run) == run / "checkpoints" / "step_00000004"


# ------------------------------------------------ flags the command has (item 9)


@pytest.mark.parametrize("command", ["eval", "stats"])
def test_a_corpus_too_small_for_one_batch_says_so_in_the_commands_words(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("one two three.\n")
    (small / "b.txt").write_text("four five.\n")
    capsys.readouterr()
    args = [command, str(base), "--data", str(small), "--threads", "1"]
    assert main(args + (["--top-k", "2"] if command == "eval" else [])) == 2
    err = _one_error(capsys, command)
    assert f"the corpus {small}" in err and "--data" in err
    cfg = TrainConfig.from_dict(json.loads((base / "config.json").read_text()))
    need = cfg.batch_size * (cfg.seq_len + 1)  # one batch of windows of S + 1 tokens
    assert f"at least {need:,} tokens" in err
    assert "lower batch_size" not in err  # eval and stats have no such flag


# ------------------------------------------ config.json not a run's settings (item 11)

HOSTILE: list[tuple[Any, str]] = [
    ([1, 2], "holds an array"),
    (None, "holds null"),
    ("settings", "holds a string"),
    ({"model": {"router": 3}}, "model.router is 3, not an object"),
    ({"model": {"n_experts": 2.5}}, "model.n_experts is 2.5, not a whole number"),
    ({"model": {"n_experts": "8"}}, 'model.n_experts is "8", not a whole number'),
    ({"seq_len": None}, "seq_len is null, not a whole number"),
    ({"top_k": [2]}, "top_k is [2], not a whole number or null"),
    ({"run_info": 3}, "run_info is 3, not an object"),
    ({"run_info": {"corpus": "abc"}}, "run_info.corpus is"),
]


def _hostile(run: Path, content: Any) -> None:
    path = run / "config.json"
    if isinstance(content, dict):
        saved = json.loads(path.read_text())
        for key, value in content.items():
            if isinstance(value, dict) and isinstance(saved.get(key), dict):
                saved[key].update(value)
            else:
                saved[key] = value
        content = saved
    path.write_text(json.dumps(content))


@pytest.mark.parametrize(("content", "says"), HOSTILE, ids=[str(c) for c, _ in HOSTILE])
def test_a_config_json_that_is_not_a_runs_settings_is_one_line(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, says: str
) -> None:
    run = _copy(base, tmp_path)
    _hostile(run, content)
    commands = {
        "eval": ["eval", str(run), "--top-k", "2", "--threads", "1"],
        "stats": ["stats", str(run), "--threads", "1"],
        "report": ["report", str(run), "--out", str(tmp_path / "rep"), "--threads", "1"],
        "export": ["export", str(run), "--out", str(tmp_path / "hf")],
    }
    capsys.readouterr()
    for command, args in commands.items():
        assert main(args) == 2, command
        err = _one_error(capsys, command)
        assert str(run / "config.json") in err and says in err, (command, err)
        assert "state.json" in err  # where the run's settings are kept
