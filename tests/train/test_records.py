"""What a run folder records about itself: config.json read back on resume (a damaged
one is named), the vocabulary of prepared data, calibrated cuts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.data import Tokenizer
from moelab.data.prepare import prepare
from moelab.train import TrainConfig, train

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


# ------------------------------------------------------------------ prepared data


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared with a 280-token BPE and a validation share of 0.2."""
    out = tmp_path_factory.mktemp("prepared") / "prep"
    prepare(corpus, out, vocab_size=280, val_fraction=0.2, progress=False)
    return out


def _cli_train(tmp_path: Path, prepared: Path, *sets: str) -> list[str]:
    args = ["train", "--out", str(tmp_path / "run"), "--data", str(prepared), "--threads", "1"]
    return [*args, *(a for s in sets for a in ("--set", s))]


@pytest.mark.parametrize(
    ("given", "key", "theirs"),
    [("vocab_size=4096", "vocab_size", "280"), ("val_fraction=0.05", "val_fraction", "0.2")],
)
def test_a_set_that_prepared_data_contradict_is_refused(
    tmp_path: Path, prepared: Path, capsys: pytest.CaptureFixture[str], given: str, key: str,
    theirs: str,
) -> None:  # fmt: skip
    assert main(_cli_train(tmp_path, prepared, given)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moelab train: error: --set "), lines
    assert f"prepared with {key} = {theirs}" in lines[0] and f"drop --set {key}" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_a_set_that_prepared_data_agree_with_is_taken(
    tmp_path: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[TrainConfig] = []

    def fake_train(config: TrainConfig, **kw: object) -> dict:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("moelab.train.train", fake_train)
    with pytest.raises(SystemExit):
        main(_cli_train(tmp_path, prepared, "vocab_size=280", "val_fraction=0.2"))
    assert (seen[0].vocab_size, seen[0].val_fraction) == (280, 0.2)


@pytest.mark.parametrize("vocab_size", [2048, 4096])  # the default, and another value
def test_config_json_records_the_prepared_vocabulary(
    tmp_path: Path, prepared: Path, capsys: pytest.CaptureFixture[str], vocab_size: int
) -> None:
    run = tmp_path / "run"
    train(tiny_config(prepared, run, steps=2, vocab_size=vocab_size, val_fraction=0.05))
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    tokens = Tokenizer.load(prepared / "tokenizer.json").vocab_size
    assert tokens <= 280
    assert saved["vocab_size"] == saved["model"]["vocab_size"] == tokens
    assert saved["val_fraction"] == 0.2
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: vocab")]
    assert len(warned) == (vocab_size != 2048)  # only a value asked for is worth a word
    # the same settings resume it; so does the folder's own value
    cfg = tiny_config(prepared, run, steps=3, vocab_size=vocab_size, val_fraction=0.05)
    assert train(cfg, resume=True)["steps"] == 3
    cfg = tiny_config(prepared, run, steps=4, vocab_size=tokens, val_fraction=0.2)
    assert train(cfg, resume=True)["steps"] == 4


def test_a_run_that_recorded_another_vocabulary_still_resumes(
    tmp_path: Path, prepared: Path
) -> None:
    """Runs written before the fix hold the vocab_size they were given."""
    run = tmp_path / "run"
    train(tiny_config(prepared, run, steps=3), stop_after=2)
    path = run / "config.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**saved, "vocab_size": 4096}), encoding="utf-8")
    assert train(tiny_config(prepared, run, steps=3), resume=True)["steps"] == 3
    tokens = Tokenizer.load(prepared / "tokenizer.json").vocab_size
    assert json.loads(path.read_text(encoding="utf-8"))["vocab_size"] == tokens
