"""`moelab data prepare`: streaming, multi-process tokenisation into train's shards."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import sys
from multiprocessing.pool import ThreadPool
from pathlib import Path

import numpy as np
import pytest

from moelab.cli import main
from moelab.data import Tokenizer, TokenShard, is_prepared, split_documents
from moelab.data import prepare as dp
from moelab.data.prepare import ordered_map, prepare
from moelab.train import TrainConfig, train
from tests.train import make_corpus, tiny_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

OUTPUT_FILES = ("tokenizer.json", "train.bin", "train.json", "val.bin", "val.json", "prepare.json")
SMALL = dict(vocab_size=300, progress=False)


def _docs(n: int = 120, seed: int = 0) -> list[str]:
    """Stripped documents (a text file reads back the same) of words, accents, emoji."""
    rng = random.Random(seed)
    words = ["the", "router", "expert", "token", "shard", "sends", "é", "naïve", "🙂", "a"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) for _ in range(n)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    rows = [{"id": i, field: d} for i, d in enumerate(docs)]
    rows.insert(3, {"id": -1, field: "   "})  # blank text: skipped
    rows.insert(7, {"id": -2, field: None})  # null: skipped
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "")  # a blank line: skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _table(docs: list[str | None]) -> object:
    return pa.table({"id": list(range(len(docs))), "text": docs})


def _saved_dataset(folder: Path, docs: list[str], n_files: int = 2) -> Path:
    """What datasets' save_to_disk writes: Arrow IPC stream files, state.json naming
    them in order, dataset_info.json."""
    folder.mkdir(parents=True)
    per = math.ceil(len(docs) / n_files)
    names = []
    for k in range(n_files):
        name = f"data-{k:05d}-of-{n_files:05d}.arrow"
        table = _table(docs[k * per : (k + 1) * per])
        with pa.ipc.new_stream(str(folder / name), table.schema) as w:
            for batch in table.to_batches(max_chunksize=7):
                w.write_batch(batch)
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def _read(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in OUTPUT_FILES}


def _same_shards(a: Path, b: Path) -> None:
    """Same tokenizer and token files, byte for byte."""
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: chunks of 8 documents, so that two workers share every test's corpus
    monkeypatch.setattr(dp, "CHUNK_DOCS", 8)


# --------------------------------------------------------------------- 1 vs 2 workers


@pytest.mark.parametrize("sample_chars", [10**9, 2000])  # the exact split / the hash rule
def test_jsonl_same_shards_with_one_and_two_workers(tmp_path: Path, sample_chars: int) -> None:
    src = _jsonl(tmp_path / "c.jsonl", _docs())
    m1 = prepare(src, tmp_path / "w1", workers=1, sample_chars=sample_chars, **SMALL)
    m2 = prepare(src, tmp_path / "w2", workers=2, sample_chars=sample_chars, **SMALL)
    assert _read(tmp_path / "w1") == _read(tmp_path / "w2")  # manifests included
    assert m1 == m2
    assert sum(m1["n_documents"].values()) == 120  # blank and null rows skipped
    assert m1["split_rule"] == ("exact" if sample_chars > 10**6 else "hash")
    assert m1["tokenizer_sample"]["chars"] >= min(sample_chars, 1)


def test_parquet_same_shards_with_one_and_two_workers(tmp_path: Path) -> None:
    docs = _docs()
    src = tmp_path / "pq"
    src.mkdir()
    # two files, small row groups; a null and a blank row are skipped
    pq.write_table(_table([*docs[:50], None, "  "]), src / "a.parquet", row_group_size=16)
    pq.write_table(_table(docs[50:]), src / "b.parquet", row_group_size=16)
    prepare(src, tmp_path / "w1", workers=1, **SMALL)
    prepare(src, tmp_path / "w2", workers=2, **SMALL)
    assert _read(tmp_path / "w1") == _read(tmp_path / "w2")
    # the same documents as JSONL give the same shards
    prepare(_jsonl(tmp_path / "c.jsonl", docs), tmp_path / "j", **SMALL)
    _same_shards(tmp_path / "w1", tmp_path / "j")


def test_saved_dataset_and_text_folder_match_jsonl(tmp_path: Path) -> None:
    docs = _docs()
    prepare(_jsonl(tmp_path / "c.jsonl", docs), tmp_path / "j", **SMALL)
    arrow = _saved_dataset(tmp_path / "saved", docs)
    prepare(arrow, tmp_path / "a1", workers=1, **SMALL)
    prepare(arrow, tmp_path / "a2", workers=2, **SMALL)
    assert _read(tmp_path / "a1") == _read(tmp_path / "a2")
    assert json.loads((tmp_path / "a1" / "prepare.json").read_text())["source_format"] == "arrow"
    _same_shards(tmp_path / "a1", tmp_path / "j")

    text = tmp_path / "txt"
    text.mkdir()
    for i, d in enumerate(docs):  # sorted by name = document order
        (text / f"doc{i:04d}.txt").write_text(d + "\n", encoding="utf-8")
    prepare(text, tmp_path / "t1", workers=1, **SMALL)
    prepare(text, tmp_path / "t2", workers=2, **SMALL)
    assert _read(tmp_path / "t1") == _read(tmp_path / "t2")
    _same_shards(tmp_path / "t1", tmp_path / "j")


def test_dataset_dict_split(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    _saved_dataset(root / "train", _docs(40, seed=1), n_files=1)
    _saved_dataset(root / "test", _docs(30, seed=2), n_files=1)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    m = prepare(root, tmp_path / "o", split="test", **SMALL)
    assert sum(m["n_documents"].values()) == 30
    m = prepare(root, tmp_path / "o2", **SMALL)  # train by default
    assert sum(m["n_documents"].values()) == 40
    with pytest.raises(ValueError, match="has splits"):
        prepare(root, tmp_path / "o3", split="validation", **SMALL)


# ---------------------------------------------------------------- the training side


def test_text_folder_equals_trains_own_preparation(tmp_path: Path) -> None:
    """The reference: the tokenizer and shards train prepares in memory from a corpus."""
    from moelab.train.loop import prepare_data

    corpus = make_corpus(tmp_path / "corpus")
    config = tiny_config(corpus, tmp_path / "run")
    prepare_data(config, tmp_path / "run")
    prepare(
        str(corpus),
        tmp_path / "prep",
        workers=2,
        vocab_size=config.vocab_size,
        val_fraction=config.val_fraction,
        seed=config.seed,
        progress=False,
    )
    assert (tmp_path / "prep" / "tokenizer.json").read_bytes() == (
        tmp_path / "run" / "tokenizer.json"
    ).read_bytes()
    for name in ("train.bin", "train.json", "val.bin", "val.json"):
        assert (tmp_path / "prep" / name).read_bytes() == (
            tmp_path / "run" / "data" / name
        ).read_bytes(), name


def test_prepared_folder_trains(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    prep = tmp_path / "prep"
    assert main(["data", "prepare", str(corpus), "--out", str(prep), "--vocab-size", "300",
                 "--workers", "2", "--json"]) == 0  # fmt: skip
    assert is_prepared(prep) and not is_prepared(corpus)
    summary = train(tiny_config(prep, tmp_path / "run", steps=2))
    assert math.isfinite(summary["train_loss"])
    run_train = TokenShard.open(tmp_path / "run" / "data" / "train.bin")
    assert np.array_equal(run_train.tokens, TokenShard.open(prep / "train.bin").tokens)
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (
        prep / "tokenizer.json"
    ).read_bytes()


def test_defaults_are_trains() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert dp.DEFAULT_VOCAB_SIZE == defaults["vocab_size"]
    assert dp.DEFAULT_VAL_FRACTION == defaults["val_fraction"]
    assert dp.DEFAULT_SEED == defaults["seed"]


# ------------------------------------------------------------ Hugging Face tokenizer


def _hf_dir(folder: Path, vocab: list[str]) -> Path:
    """A word-level tokenizer saved as tokenizer.json; no <|endoftext|>; truncation on."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.enable_truncation(max_length=4)  # must not cut documents
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    return folder


def test_hf_tokenizer_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HF

    docs = _docs(60)
    # 70,000 ids: the shards switch to uint32
    vocab = ["[UNK]", *sorted({w for d in docs for w in d.split()}),
             *(f"w{i}" for i in range(70_000))]  # fmt: skip
    hf_dir = _hf_dir(tmp_path / "hf", vocab)
    src = _jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "o"
    prepare(src, out, tokenizer=str(hf_dir), workers=2, progress=False)
    prepare(src, tmp_path / "o1", tokenizer=str(hf_dir), workers=1, progress=False)
    assert _read(out) == _read(tmp_path / "o1")
    tok = Tokenizer.load(out / "tokenizer.json")
    assert tok.vocab_size == len(vocab) + 1 and tok.eos_id == len(vocab)  # eos added
    train_shard = TokenShard.open(out / "train.bin", verify_hash=True)
    assert train_shard.meta["dtype"] == "uint32"
    # reference: the original tokenizer, without truncation, document by document
    ref = HF.from_file(str(hf_dir / "tokenizer.json"))
    ref.no_truncation()
    train_ids, _ = split_documents(len(docs), 0.05, 0)
    expected = [i for d in train_ids for i in [*ref.encode(docs[d]).ids, len(vocab)]]
    assert train_shard.tokens.tolist() == expected
    summary = train(tiny_config(out, tmp_path / "run", steps=2))
    assert math.isfinite(summary["train_loss"])


# ------------------------------------------------------------------ errors, interrupt


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["data", "prepare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moelab data: error: "), err
    return err[0]


def test_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o")
    assert "does not exist" in _cli(capsys, str(tmp_path / "missing"), "--out", out)
    (tmp_path / "c.csv").write_text("text\nhello\n")
    assert "unknown format" in _cli(capsys, str(tmp_path / "c.csv"), "--out", out)
    src = str(_jsonl(tmp_path / "c.jsonl", _docs(10)))
    assert "no field 'body'" in _cli(capsys, src, "--out", out, "--field", "body")
    pq.write_table(_table(_docs(10)), tmp_path / "c.parquet")
    msg = _cli(capsys, str(tmp_path / "c.parquet"), "--out", out, "--field", "body")
    assert "no column 'body'" in msg
    assert "not text" in _cli(capsys, str(tmp_path / "c.parquet"), "--out", out, "--field", "id")
    assert "--split" in _cli(capsys, src, "--out", out, "--split", "train")
    assert "no tokenizer.json" in _cli(capsys, src, "--out", out, "--tokenizer", str(tmp_path))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("hello")
    (mixed / "b.jsonl").write_text('{"text": "hi"}\n')
    assert "mixes formats" in _cli(capsys, str(mixed), "--out", out)
    assert main(["data", "prepare", src, "--out", out, "--vocab-size", "300", "--json"]) == 0
    capsys.readouterr()
    assert "--overwrite" in _cli(capsys, src, "--out", out)  # not empty
    # read as text, one file is split into documents at blank lines: one paragraph is
    # too few, and the message says so
    one = tmp_path / "one.jsonl"
    one.write_text("".join(line for line in Path(src).read_text().splitlines(True) if line.strip()))
    msg = _cli(capsys, str(one), "--out", str(tmp_path / "o2"), "--format", "text")
    assert "holds 1 paragraph(s)" in msg and "split into documents at blank lines" in msg


def test_missing_pyarrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(_table(_docs(10)), tmp_path / "c.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow fails
    msg = _cli(capsys, str(tmp_path / "c.parquet"), "--out", str(tmp_path / "o"))
    assert "pip install 'moelab[data]'" in msg


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupt_leaves_nothing_train_reads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    workers: int,
) -> None:
    src = _jsonl(tmp_path / "c.jsonl", _docs())
    out = tmp_path / "o"
    prepare(src, out, **SMALL)  # a complete folder, then an interrupted --overwrite
    chunks = dp._chunks

    def interrupted(*args: object) -> object:
        for k, chunk in enumerate(chunks(*args)):  # type: ignore[arg-type]
            if k == 5:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(dp, "_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(src, out, workers=workers, overwrite=True, **SMALL)
    assert not list(out.glob("*.tmp")) and not (out / "prepare.json").exists()
    with pytest.raises(ValueError, match="incomplete"):
        is_prepared(out)
    with pytest.raises(ValueError, match="incomplete"):
        train(tiny_config(out, tmp_path / "run", steps=2))
    args = ["data", "prepare", str(src), "--out", str(out), "--overwrite", "--vocab-size", "300"]
    assert main([*args, "--workers", str(workers), "--json"]) == 130  # as a shell reports SIGINT
    assert not list(out.glob("*.tmp")) and not (out / "prepare.json").exists()
    monkeypatch.setattr(dp, "_chunks", chunks)
    assert "interrupted" in capsys.readouterr().err
    assert main([*args, "--json"]) == 0
    assert is_prepared(out)


def test_ordered_map_reads_a_bounded_window_ahead() -> None:
    """The stream is read at most `window` items ahead of the results (flat memory);
    Pool.imap would read its whole input first."""
    taken = 0

    def source() -> object:
        nonlocal taken
        for i in itertools.count():
            taken += 1
            yield i

    with ThreadPool(2) as pool:
        results = ordered_map(lambda x: x * x, source(), pool, window=4)
        first = list(itertools.islice(results, 50))
    assert first == [i * i for i in range(50)]
    assert taken <= 50 + 4
