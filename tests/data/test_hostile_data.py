"""Damaged, false or hostile data files are refused in one line that names the file and
says what to do: shard contents (ids, sha256), metadata against the tokenizer, malformed
JSON, and paths that a data file names (they stay in its folder)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from moelab import cli
from moelab.data import Tokenizer, TokenShard, is_prepared, link_prepared, open_checked
from moelab.data import shards as shards_module
from moelab.data.prepare import open_source, prepare
from tests.train import make_corpus

PACKAGE = Path(__file__).resolve().parents[2] / "moelab" / "data"


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    corpus = make_corpus(root / "corpus", n_docs=24)
    prepare(corpus, root / "prep", vocab_size=300, progress=False)
    return root / "prep"


@pytest.fixture
def prep(prepared_once: Path, tmp_path: Path) -> Path:
    """A fresh copy of a small prepared folder, for one test to damage."""
    return Path(shutil.copytree(prepared_once, tmp_path / "prep"))


@pytest.fixture
def tok(prep: Path) -> Tokenizer:
    return Tokenizer.load(prep / "tokenizer.json")


def _one_line(err: pytest.ExceptionInfo[BaseException], *names: str) -> str:
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)
    return message


def _ids(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2")


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _zero_high_bytes(path: Path) -> None:
    """Rewrite the file in place (same size and inode; its mtime moves as a write moves
    it) with the high byte of every uint16 id zeroed: every id stays in the vocabulary."""
    ids = _ids(path)
    assert (ids > 0xFF).any()  # merges and the end-of-document id of a 300-token BPE
    path.write_bytes((ids & 0x00FF).astype("<u2").tobytes())


def _out_of_vocabulary(path: Path, vocab_size: int) -> None:
    """Rewrite the file in place with 1% of its ids set beyond the vocabulary."""
    ids = _ids(path)
    ids[::100] = vocab_size + 7
    path.write_bytes(ids.tobytes())


# ------------------------------------------------------------------ shard contents


def test_zeroed_high_bytes_are_caught_by_the_sha256(prep: Path, tok: Tokenizer) -> None:
    train, val = open_checked(prep, tok)
    assert (prep / "train.verified.json").is_file()  # recorded
    del train, val
    _zero_high_bytes(prep / "train.bin")
    TokenShard.open(prep / "train.bin")  # the cheap checks pass: ids are in range
    with pytest.raises(ValueError) as err:
        open_checked(prep, tok)
    _one_line(err, str(prep / "train.bin"), "sha256", "prepare the data again")


def test_sha256_is_read_once_per_version_of_the_file(
    prep: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[str] = []
    real = shards_module._sha256_file

    def counting(path: Path, *args: int) -> str:
        hashed.append(path.name)
        return real(path, *args)

    monkeypatch.setattr(shards_module, "_sha256_file", counting)
    old = time.time_ns() - 3600 * 10**9
    for name in ("train.bin", "val.bin"):
        os.utime(prep / name, ns=(old, old))
    open_checked(prep, tok)
    assert hashed == ["train.bin", "val.bin"]
    record = json.loads((prep / "train.verified.json").read_text())
    meta = json.loads((prep / "train.json").read_text())
    assert record["sha256"] == meta["sha256"] and record["mtime_ns"] == old
    assert record["size"] == (prep / "train.bin").stat().st_size
    open_checked(prep, tok)
    assert hashed == ["train.bin", "val.bin"]  # both recorded: not read again
    os.utime(prep / "train.bin")  # a new mtime: hashed again
    open_checked(prep, tok)
    assert hashed[2:] == ["train.bin"]
    # recorded less than RACY_NS after the file's mtime: a rewrite within the file
    # system's timestamp resolution could keep the mtime, so the record is not trusted
    open_checked(prep, tok)
    assert hashed[3:] == ["train.bin"]


def test_out_of_vocabulary_ids_are_refused_on_open(prep: Path, tok: Tokenizer) -> None:
    _out_of_vocabulary(prep / "val.bin", tok.vocab_size)
    with pytest.raises(ValueError) as err:
        TokenShard.open(prep / "val.bin")
    message = _one_line(err, str(prep / "val.bin"), "prepare the data again")
    assert f"token id {tok.vocab_size + 7}" in message


@pytest.mark.parametrize(
    ("file", "key"),
    [
        ("train.json", "vocab_size"),
        ("val.json", "eos_id"),
        ("prepare.json", "vocab_size"),
        ("prepare.json", "eos_id"),
    ],
)
def test_false_vocab_size_or_eos_id_is_refused(
    prep: Path, tok: Tokenizer, tmp_path: Path, file: str, key: str
) -> None:
    truth = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id}[key]
    _edit_json(prep / file, **{key: truth + 1})  # still a valid id of the vocabulary
    with pytest.raises(ValueError) as err:
        open_checked(prep, tok)
    _one_line(err, str(prep / file), f"{key} = {truth + 1}", "prepare the data again")
    if file == "prepare.json":  # the manifest is checked before it is linked into a run
        with pytest.raises(ValueError, match=f"{key} = {truth + 1}"):
            link_prepared(prep, tmp_path / "run")
        assert not (tmp_path / "run" / "tokenizer.json").exists()


# -------------------------------------------------------------------- malformed JSON


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        ("tokenizer.json", "truncate"),
        ("tokenizer.json", "latin-1"),
        ("train.json", "truncate"),
        ("train.json", "nan"),
        ("train.json", "string"),
        ("prepare.json", "truncate"),
        ("prepare.json", "string"),
    ],
)
def test_malformed_json_is_one_line_naming_the_file(prep: Path, file: str, damage: str) -> None:
    path = prep / file
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "latin-1":
        path.write_bytes(path.read_bytes()[:-2] + "é}".encode("latin-1"))
    elif damage == "nan":
        path.write_text(path.read_text().replace('"n_tokens": ', '"n_tokens": NaN, "x": '))
    else:
        key = "n_tokens" if file == "train.json" else "vocab_size"
        _edit_json(path, **{key: "300"})
    read = {
        "tokenizer.json": lambda: Tokenizer.load(path),
        "train.json": lambda: TokenShard.open(path),
        "prepare.json": lambda: is_prepared(prep),
    }[file]
    with pytest.raises(ValueError) as err:
        read()
    assert type(err.value) is ValueError or damage == "latin-1"  # UnicodeDecodeError is one
    _one_line(err, str(path), "prepare the data again")


# ------------------------------------------------------------ paths stay in their folder


@pytest.mark.parametrize(
    "name", ["../../etc/hostname", "/etc/hostname", "sub/train.bin", "..\\train.bin", "..", ""]
)
def test_shard_file_must_be_a_plain_name(prep: Path, name: str) -> None:
    _edit_json(prep / "train.json", file=name)
    with pytest.raises(ValueError) as err:
        TokenShard.open(prep / "train.json")
    _one_line(err, str(prep / "train.json"), "not a plain name")


def test_a_link_out_of_the_folder_is_refused(prep: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(prep / "train.bin", outside / "train.bin")  # the right size, even
    (prep / "train.bin").unlink()
    (prep / "train.bin").symlink_to(outside / "train.bin")
    with pytest.raises(ValueError) as err:
        TokenShard.open(prep / "train.bin")
    _one_line(err, str(prep / "train.bin"), str(outside / "train.bin"), "outside")


@pytest.mark.parametrize("links", ["hard", "symbolic"])
def test_a_prepared_folder_linked_into_a_run_opens(
    prep: Path, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: str
) -> None:
    if links == "symbolic":  # as across file systems

        def no_hard_links(src: object, dst: object) -> None:
            raise OSError("cross-device link")

        monkeypatch.setattr(os, "link", no_hard_links)
    run = tmp_path / "run"
    link_prepared(prep, run)
    assert (run / "data" / "train.bin").is_symlink() == (links == "symbolic")
    train, _ = open_checked(run / "data", tok)
    assert np.array_equal(train.tokens, TokenShard.open(prep / "train.bin").tokens)
    assert (run / "data" / "val.verified.json").is_file()  # the run's record, not prep's
    assert not (prep / "val.verified.json").exists()


def _saved_split(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    return folder


def test_saved_dataset_files_stay_in_their_folder(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    _saved_split(root / "train")
    _saved_split(tmp_path / "elsewhere")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../elsewhere"]}))
    with pytest.raises(ValueError) as err:
        open_source(root, split="../elsewhere")
    _one_line(err, str(root / "dataset_dict.json"), "not a plain name")

    state = {"_data_files": [{"filename": "../elsewhere/data-00000-of-00001.arrow"}]}
    (root / "train" / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        open_source(root)
    _one_line(err, str(root / "train" / "state.json"), "not a plain name")


def test_moelab_data_never_unpickles_or_evaluates() -> None:
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path
            elif isinstance(node, ast.Call):
                f = node.func
                assert not (isinstance(f, ast.Name) and f.id in banned_calls), (path, f.id)
                owner = getattr(getattr(f, "value", None), "id", "")
                is_load = isinstance(f, ast.Attribute) and f.attr == "load"
                assert not (is_load and owner in {"torch", "np", "numpy"}), path
                assert all(k.arg != "allow_pickle" for k in node.keywords), path


# ----------------------------------------------------- the places that open a run's data


def test_evaluation_and_lm_eval_open_a_runs_data_checked(
    prep: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    from moelab.diagnostics.evaluate import LoadedRun
    from moelab.integrations.lm_eval.cloze import run_documents

    run = tmp_path / "run"
    link_prepared(prep, run)
    assert run_documents(run)
    _out_of_vocabulary(prep / "val.bin", tok.vocab_size)  # hard-linked: the run's too
    loaded = LoadedRun(None, None, tok, 0, run)  # type: ignore[arg-type]
    for read in (loaded.val_shard, lambda: run_documents(run)):
        with pytest.raises(ValueError) as err:
            read()
        _one_line(err, str(run / "data" / "val.bin"), "--overwrite")


@pytest.mark.parametrize("damage", ["out of vocabulary", "zeroed high bytes"])
def test_train_refuses_damaged_shards_in_one_line(
    prep: Path, tok: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    if damage == "out of vocabulary":
        _out_of_vocabulary(prep / "train.bin", tok.vocab_size)
    else:
        _zero_high_bytes(prep / "train.bin")
    run = tmp_path / "run"
    argv = ["train", "--steps", "1", "--out", str(run), "--data", str(prep)]
    for item in ("n_layers=1", "d_model=32", "n_heads=2", "n_kv_heads=1", "d_ff=64",
                 "seq_len=16", "batch_size=2", "threads=1", "progress=false"):  # fmt: skip
        argv += ["--set", item]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab train: error: ") and err.count("\n") == 1
    assert str(run / "data" / "train.bin") in err and "--overwrite" in err
    assert "Traceback" not in err
