from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.cli import main

from . import make_corpus


def _args(corpus: Path, out: Path) -> list[str]:
    sets = [
        "n_layers=2", "d_model=32", "n_heads=2", "n_kv_heads=1", "d_ff=64", "n_experts=4",
        "max_seq_len=32", "seq_len=32", "batch_size=4", "vocab_size=300", "val_fraction=0.1",
        "eval_batches=1", "device=cpu", "router.renorm=true",
    ]  # fmt: skip
    args = ["train", "--preset", "tiny", "--map", "sparsemax", "--top-k", "2", "--steps", "3"]
    args += ["--out", str(out), "--data", str(corpus), "--json"]
    for item in sets:
        args += ["--set", item]
    return args


def test_cli_train_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    assert main(_args(corpus, out)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 3 and result["model"] == {"map": "sparsemax", "top_k": 2}
    config = json.loads((out / "config.json").read_text())
    # the resolved router: every RouterConfig field, the --set and --map ones included
    router = config["model"]["router"]
    assert router["renorm"] is True and router["map"] == "sparsemax" and router["top_k"] == 2
    assert config["map"] == "sparsemax" and config["model"]["n_layers"] == 2
    # an existing run folder is a user error: one line and exit code 2, not a traceback
    assert main(_args(corpus, out)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("moelab train: error: run folder")
    assert "--overwrite" in captured.err
    assert "--overwrite" in json.loads(captured.out)["error"]
    assert main([*_args(corpus, out), "--overwrite"]) == 0


def test_cli_train_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--resume" in text and "--overwrite" in text and "lr=0.003" in text
