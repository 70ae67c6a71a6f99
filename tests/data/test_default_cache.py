"""The cache of the prepared default corpus (moelab.data.cache): a second run on the
default corpus reuses the first one's tokenizer and shards, byte for byte, without
reading the corpus again; another corpus, other settings or a damaged entry are never
reused; MOELAB_CACHE_DIR=off turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.data import cache, corpus
from moelab.train import run_folder, train
from tests.train import make_corpus, tiny_config

DATA = ("tokenizer.json", "data/train.bin", "data/train.json", "data/val.bin", "data/val.json")


@pytest.fixture
def default_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small corpus as the default one, and a cache folder of the test's own."""
    folder = make_corpus(tmp_path / "python-docs", n_docs=16)
    monkeypatch.setattr(corpus, "DEFAULT_CORPUS_DIR", folder)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    return folder


def _train(out: Path, **kw: object) -> dict[str, bytes]:
    train(tiny_config(Path("unused"), out, data=None, steps=1, **kw))
    return {name: (out / name).read_bytes() for name in DATA}


def _corpus_read(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record every read of a corpus by training (load_corpus in the run folder code)."""
    reads: list[object] = []
    load = run_folder.load_corpus

    def spy(source: object = None, **kw: object) -> list[str]:
        reads.append(source)
        return load(source, **kw)

    monkeypatch.setattr(run_folder, "load_corpus", spy)
    return reads


def test_second_run_reuses_the_prepared_corpus(
    default_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    reads = _corpus_read(monkeypatch)
    first = _train(tmp_path / "a")
    assert reads == [None]
    entries = list((tmp_path / "cache" / "default-corpus").iterdir())
    assert len(entries) == 1 and (entries[0] / "cache.json").is_file()
    capsys.readouterr()
    second = _train(tmp_path / "b")
    assert reads == [None]  # not read again
    assert second == first  # byte for byte
    assert "from the cache" in capsys.readouterr().err
    ids = [
        json.loads((tmp_path / r / "config.json").read_text())["run_info"]["corpus"]["id"]
        for r in ("a", "b")
    ]
    assert ids[0] == ids[1]


def test_another_corpus_or_setting_is_prepared_again(
    default_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _corpus_read(monkeypatch)
    first = _train(tmp_path / "a")
    _train(tmp_path / "b", val_fraction=0.2)  # another split
    assert reads == [None, None]
    doc = default_corpus / "doc000.txt"
    doc.write_text(doc.read_text() + " One more sentence.\n")  # another corpus
    third = _train(tmp_path / "c")
    assert reads == [None, None, None]
    assert third["data/train.json"] != first["data/train.json"] or (
        third["data/val.json"] != first["data/val.json"]
    )
    assert len(list((tmp_path / "cache" / "default-corpus").iterdir())) == 3


def test_damaged_entry_is_not_used(
    default_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    reads = _corpus_read(monkeypatch)
    first = _train(tmp_path / "a")
    (entry,) = (tmp_path / "cache" / "default-corpus").iterdir()
    shard = bytearray((entry / "train.bin").read_bytes())
    shard[10] ^= 1
    (entry / "train.bin").write_bytes(bytes(shard))
    capsys.readouterr()
    second = _train(tmp_path / "b")
    assert reads == [None, None]  # prepared again
    assert second == first
    assert "is damaged" in capsys.readouterr().err
    assert (entry / "train.bin").read_bytes() == first["data/train.bin"]  # stored anew


def test_cache_off(default_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    reads = _corpus_read(monkeypatch)
    _train(tmp_path / "a")
    _train(tmp_path / "b")
    assert reads == [None, None]
    assert not (tmp_path / "cache").exists()


def test_other_corpora_are_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    folder = make_corpus(tmp_path / "corpus", n_docs=16)
    train(tiny_config(folder, tmp_path / "a", steps=1))
    assert not (tmp_path / "cache").exists()
