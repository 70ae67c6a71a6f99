"""What a run folder records about itself: config.json read back on resume (a damaged
one is named), the vocabulary of prepared data, calibrated cuts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.train import train

from . import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def stopped(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 steps stopped after 2 (a checkpoint at step 2)."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    train(tiny_config(corpus, run, steps=4), stop_after=2)
    return run


# ------------------------------------------------------------- config.json on resume


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"preset": "tiny", "steps": ', "is not valid JSON"),  # cut short
        ("", "is not valid JSON"),  # emptied
        ("\xff\xfe", "is not valid JSON"),  # not text
        ("[1, 2]", "holds a JSON list, not the run's settings"),
        ('{"steps": 4, "nonsense": 1}', "is not a valid run config"),
    ],
)
def test_a_damaged_config_json_on_resume_is_named(
    corpus: Path, stopped: Path, tmp_path: Path, text: str, says: str
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "run"))
    path = run / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as err:
        train(tiny_config(corpus, run, steps=4), resume=True)
    message = str(err.value)
    assert message.startswith(f"{path} {says}"), message
    assert "--overwrite" in message
    assert path.read_bytes() == text.encode("latin-1")  # left as it was found


def test_a_damaged_config_json_is_one_line_from_the_cli(
    corpus: Path, stopped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "run"))
    (run / "config.json").write_text('{"steps": 4,', encoding="utf-8")
    args = ["train", "--out", str(run), "--data", str(corpus), "--threads", "1"]
    code = main([*args, "--resume", "--json"])
    err = capsys.readouterr()
    assert code == 2
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moelab train: error: "), err.err
    assert f"{run / 'config.json'} is not valid JSON" in lines[0]
    assert json.loads(err.out)["error"].startswith(f"{run / 'config.json'} is not valid JSON")
