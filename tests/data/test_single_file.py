"""A single text file as the corpus: its paragraphs (split at blank lines) are the
documents, so that `moelab train --data FILE` and `moelab data prepare FILE` work (a
single file was one document, refused with "need at least 2"); a file of one paragraph
is refused with the rule and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab import cli
from moelab.data import load_corpus
from tests.train import make_corpus

TINY = [
    f"--set={k}={v}"
    for k, v in dict(
        vocab_size=300, n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, n_experts=4,
        seq_len=32, max_seq_len=32, batch_size=4, eval_batches=1, log_every=1,
    ).items()
]  # fmt: skip


def one_file(folder: Path, tmp_path: Path) -> Path:
    """The documents of a corpus folder as the paragraphs of one file."""
    docs = load_corpus(folder)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def test_paragraphs_are_the_documents(tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    path.write_text("One line\nand its next.\n\n\nTwo\n \t\nThree  \n\n", encoding="utf-8")
    assert load_corpus(path) == ["One line\nand its next.", "Two", "Three"]
    (tmp_path / "one.txt").write_text("no blank line\nat all\n", encoding="utf-8")
    assert load_corpus(tmp_path / "one.txt") == ["no blank line\nat all"]
    # a folder: one document per file, as before
    whole = "One line\nand its next.\n\n\nTwo\n \t\nThree"
    assert load_corpus(tmp_path) == [whole, "no blank line\nat all"]


def test_train_on_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    book = one_file(make_corpus(tmp_path / "corpus", n_docs=12), tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--data", str(book), "--out", str(out), "--steps", "2", *TINY, "--json"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    meta = {s: json.loads((out / "data" / f"{s}.json").read_text()) for s in ("train", "val")}
    assert meta["train"]["n_documents"] + meta["val"]["n_documents"] == 12
    assert meta["val"]["n_documents"] >= 1


def test_prepare_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    book = one_file(make_corpus(tmp_path / "corpus", n_docs=12), tmp_path)
    argv = ["data", "prepare", str(book), "--out", str(tmp_path / "prep"), "--vocab-size", "300"]
    assert cli.main([*argv, "--json"]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert sum(doc["n_documents"].values()) == 12


@pytest.mark.parametrize("command", ["train", "data"])
def test_one_paragraph_says_how_to_split(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.txt"
    path.write_text("a single paragraph\nof two lines\n", encoding="utf-8")
    out = tmp_path / "out"
    if command == "train":
        argv = ["train", "--data", str(path), "--out", str(out), "--steps", "2", *TINY]
    else:
        argv = ["data", "prepare", str(path), "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"moelab {command}: error: {path} holds 1 paragraph(s)")
    assert "split into documents at blank lines" in err
    assert not out.exists()  # refused before anything was written
