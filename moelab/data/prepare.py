"""Tokenise a large corpus into token shards, as a stream, in several processes.

``moelab data prepare SRC --out DIR`` (and :func:`prepare`) reads the documents of SRC
one after the other, encodes them in ``workers`` processes and appends the ids to the
shards as they come back, so memory stays that of a few chunks of documents whatever
the corpus size. DIR then holds what ``moelab train --data DIR`` trains on as it is:

    DIR/tokenizer.json          the tokenizer (the tokenizers JSON format)
    DIR/train.bin, train.json   token shards (moelab.data.shards: memmap + metadata)
    DIR/val.bin, val.json
    DIR/prepare.json            how DIR was made; written last: it marks DIR complete

Sources (``fmt="auto"`` tells them apart by name; ``fmt`` forces one):

* ``text``: a folder of ``.txt``/``.md``/``.rst`` files, or one such file: one
  document per file, read as :func:`moelab.data.iter_documents` reads them (sorted by
  relative path; reST converted to prose; non-UTF-8 files skipped with a warning);
* ``jsonl``: a ``.jsonl`` / ``.jsonl.gz`` file, or a folder of them (sorted by relative
  path): one JSON object per line, the document in its ``field`` (default ``"text"``);
* ``parquet``: a ``.parquet`` file or a folder of them: the string column ``field``,
  read one record batch at a time (needs pyarrow: ``pip install moelab[data]``);
* ``arrow``: a folder written by ``datasets.Dataset.save_to_disk`` (``state.json``,
  ``dataset_info.json`` and ``data-*.arrow`` files; a ``DatasetDict`` folder with
  ``dataset_dict.json`` takes ``split``, default ``"train"``), read with pyarrow (the
  ``datasets`` package is not needed).

In JSONL, Parquet and Arrow sources a row whose text is null, empty or only whitespace
is skipped; a value that is not a string is an error.

The output depends on the source and the settings only, never on ``workers``: the
documents are cut into chunks in the reading order (the same chunks for every
``workers``), and the chunks' ids are written in that order. Document ``i`` goes to
validation as in :func:`moelab.data.split_documents` (a hash of ``(seed, i)`` below
``val_fraction``). For a corpus small enough to fit the tokenizer sample the split is
exactly that function's, so a text folder prepared here gives the same tokenizer and
shards, byte for byte, as ``moelab train --data FOLDER`` prepares in its run folder.

Tokenizer: ``"moelab"`` trains the byte-level BPE (:func:`moelab.data.train_tokenizer`,
``vocab_size``) on a bounded sample: the training documents from the start of the
corpus, in order, until they reach ``sample_chars`` characters (the document that
crosses the bound is the last one). Any other value is a Hugging Face tokenizer: a
directory holding ``tokenizer.json`` (or that file itself), used as it is with its
truncation and padding turned off; ``<|endoftext|>`` is added as a special token when
it lacks one, and ends every document.

An interrupt (Ctrl-C) or an error removes the temporary files: shards are written under
``NAME.tmp`` names and renamed when complete, and ``prepare.json`` goes last, so train
never reads a half-written shard; :func:`is_prepared` refuses a folder that was left
incomplete.

Nothing a data file says is believed: ``prepare.json`` is read as strict JSON with typed
fields (:func:`read_manifest`, on every :func:`is_prepared`) and checked against the
folder's tokenizer before its shards are linked into a run (:func:`check_manifest`);
the shards are checked where they are opened (:func:`moelab.data.open_checked`); the
split folder and the files that a saved dataset's ``dataset_dict.json`` and
``state.json`` name must be plain names in their folder. Each refusal is a one-line
``ValueError`` naming the file.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moelab._io import write_atomic, write_json
from moelab.data._checks import (
    MANIFEST,
    int_field,
    one_line,
    read_json_object,
    remedy,
)
from moelab.data.corpus import corpus_warnings_as_lines
from moelab.data.shards import (
    ShardWriter,
    TokenShard,
    open_checked_shard,
    split_documents,
    token_dtype,
    unit_hash,
)
from moelab.data.sources import FORMATS, Source, open_source
from moelab.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

MANIFEST_FORMAT = "moelab-prepared"
SHARD_FILES = ("train.bin", "train.json", "val.bin", "val.json")
# NOTE: the defaults of TrainConfig (vocab_size, val_fraction, seed); a test checks them
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 0
DEFAULT_SAMPLE_CHARS = 50_000_000
"""Characters of training documents the moelab BPE is trained on (about 50 MB)."""
CHUNK_DOCS = 256
CHUNK_CHARS = 1 << 20
"""A chunk (one task of a worker) ends after this many documents or characters."""

__all__ = [
    "DEFAULT_SAMPLE_CHARS",
    "FORMATS",
    "Source",
    "check_manifest",
    "is_prepared",
    "link_prepared",
    "open_checked",
    "open_source",
    "ordered_map",
    "prepare",
    "read_manifest",
]


# ------------------------------------------------------------------------- tokenizer


def _hf_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} holds no tokenizer.json; give a Hugging Face tokenizer directory (with "
            f"tokenizer.json) or 'moelab' to train moelab's BPE"
        )
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises its own Exception
        raise ValueError(f"{file} is not a tokenizers JSON file: {one_line(e)}") from None
    hf.no_truncation()
    hf.no_padding()
    if hf.token_to_id(EOS_TOKEN) is None:
        hf.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return Tokenizer(hf)


# -------------------------------------------------------------------------- encoding

_WORKER_TOKENIZER: Tokenizer | None = None
_WORKER_DTYPE: np.dtype | None = None


def _set_tokenizer(tokenizer_json: str, dtype: str) -> None:
    global _WORKER_TOKENIZER, _WORKER_DTYPE
    _WORKER_TOKENIZER = Tokenizer.from_json(tokenizer_json)
    _WORKER_DTYPE = np.dtype(dtype)


def _worker_init(tokenizer_json: str, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker
    _set_tokenizer(tokenizer_json, dtype)


def _encode_chunk(chunk: tuple[list[str], list[bool]]) -> tuple[bytes, int, bytes, int]:
    """Ids of a chunk's documents, each followed by eos: (train bytes, train documents,
    val bytes, val documents)."""
    assert _WORKER_TOKENIZER is not None and _WORKER_DTYPE is not None
    tok, dtype = _WORKER_TOKENIZER, _WORKER_DTYPE
    texts, is_val = chunk
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    eos = np.asarray([tok.eos_id], dtype=dtype)
    for ids, val in zip(tok.encode_batch(texts), is_val, strict=True):
        parts[val] += [np.asarray(ids, dtype=dtype), eos]
    train, val = (np.concatenate(parts[v]).tobytes() if parts[v] else b"" for v in (False, True))
    n_val = sum(is_val)
    return train, len(texts) - n_val, val, n_val


def ordered_map(
    fn: Callable[[Any], Any], items: Iterable[Any], pool: Any | None, window: int
) -> Iterator[Any]:
    """``fn(item)`` for each item, in order, computed by ``pool`` (None: here) with at
    most ``window`` items taken from ``items`` ahead of the result being yielded; so a
    stream is never read faster than it is encoded (``Pool.imap`` reads its whole input)."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _pool_context() -> Any:
    """Where the encoding workers come from: a fork server (a clean process that imported
    this module, started once), else spawn.

    NOTE: not a plain fork. The caller has often run torch (its OpenMP pool) or the
    tokenizers library (its thread pool) already, and a fork copies a lock that one of
    those threads held into a child that has no thread to release it: a worker hung in
    the test suite, after training tests had run in the same process."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # import once, in the server
        return ctx
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Each encoding process uses one thread (``--workers`` counts the cores used); the
    workers set it again themselves (:func:`_worker_init`)."""
    key = "TOKENIZERS_PARALLELISM"
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


# --------------------------------------------------------------------------- prepare


class _Split:
    """Whether document ``i`` is a validation document: the hash rule of
    :func:`split_documents` while the corpus size is unknown, its exact sets once known."""

    def __init__(self, val_fraction: float, seed: int, n_documents: int | None) -> None:
        self.val_fraction, self.seed = val_fraction, seed
        self.val: set[int] | None = None
        if n_documents is not None:
            self.val = set(split_documents(n_documents, val_fraction, seed)[1])

    @property
    def exact(self) -> bool:
        return self.val is not None

    def __call__(self, i: int) -> bool:
        if self.val is not None:
            return i in self.val
        return unit_hash(self.seed, i) < self.val_fraction


def _chunks(docs: Iterable[str], split: _Split) -> Iterator[tuple[list[str], list[bool]]]:
    texts: list[str] = []
    flags: list[bool] = []
    chars = 0
    for i, doc in enumerate(docs):
        texts.append(doc)
        flags.append(split(i))
        chars += len(doc)
        if len(texts) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield texts, flags
            texts, flags, chars = [], [], 0
    if texts:
        yield texts, flags


def _head_count(source: Source, sample_chars: int) -> int | None:
    """The number of documents when the corpus ends within ``sample_chars`` characters
    (it then fits the tokenizer sample), else None."""
    n = chars = 0
    for doc in source.documents():
        n += 1
        chars += len(doc)
        if chars >= sample_chars:
            return None
    return n


def _sample(source: Source, split: _Split, sample_chars: int, counts: dict) -> Iterator[str]:
    chars = 0
    for i, doc in enumerate(source.documents()):
        if split(i):
            continue
        counts["documents"] += 1
        counts["chars"] += len(doc)
        yield doc
        chars += len(doc)
        if chars >= sample_chars:
            return


def _write_shards(
    source: Source,
    tok: Tokenizer,
    out: Path,
    split: _Split,
    workers: int,
    progress: bool,
    source_name: str,
) -> dict[str, Any]:
    from tqdm import tqdm

    dtype = token_dtype(tok.vocab_size)
    extra = {"split_seed": split.seed, "val_fraction": split.val_fraction}
    writers = {
        name: ShardWriter(
            out / f"{name}.bin",
            tok.vocab_size,
            tok.eos_id,
            source=source_name,
            extra={"split": name, **extra},
        )
        for name in ("train", "val")
    }
    pool = None
    bar = tqdm(
        desc="data prepare",
        unit=" doc",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        with _single_threaded_tokenizers():
            _set_tokenizer(tok.to_json(), dtype)  # workers=1 encodes here
            if workers > 1:
                pool = _pool_context().Pool(
                    workers, initializer=_worker_init, initargs=(tok.to_json(), dtype)
                )
            for train_b, n_train, val_b, n_val in ordered_map(
                _encode_chunk, _chunks(source.documents(), split), pool, 2 * workers
            ):
                writers["train"].append(train_b, n_train)
                writers["val"].append(val_b, n_val)
                n_tokens = writers["train"].n_tokens + writers["val"].n_tokens
                bar.set_postfix(tokens=n_tokens, refresh=False)
                bar.update(n_train + n_val)
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        return {name: w.finish() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()


def _check_settings(workers: int, val_fraction: float, sample_chars: int, field: str) -> None:
    """ValueError for a bad number of workers, validation fraction, sample size or field."""
    if int(workers) != workers or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, got {workers}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if sample_chars < 1:
        raise ValueError(f"sample_chars must be >= 1, got {sample_chars}")
    if not field:
        raise ValueError("field is empty; name the field that holds the text")


def _check_out(out: Path, overwrite: bool) -> None:
    """NotADirectoryError for an ``out`` that is a file, FileExistsError for one that
    holds files unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out} is not empty; choose another --out, or replace its prepared data "
                f"with --overwrite"
            )


def _tokenise(
    source: Source,
    tok: Tokenizer | None,
    out: Path,
    vocab_size: int,
    val_fraction: float,
    seed: int,
    sample_chars: int,
    workers: int,
    progress: bool,
    source_name: str,
    sample: dict[str, int],
) -> tuple[Tokenizer, _Split, dict[str, Any]]:
    """Split the documents, train the moelab BPE when ``tok`` is None (counting its sample
    in ``sample``) and write the shards into ``out``: (tokenizer, split, shards)."""
    # NOTE: files of a text folder that are skipped: one line on stderr, however often
    # the corpus is read
    with corpus_warnings_as_lines(_stderr_line):
        n_head = _head_count(source, sample_chars)
        if n_head is not None and n_head < 2:
            raise ValueError(f"the corpus has {n_head} document(s); need at least 2")
        doc_split = _Split(val_fraction, seed, n_head)
        if tok is None:
            tok = train_tokenizer(_sample(source, doc_split, sample_chars, sample), vocab_size)
        shards = _write_shards(source, tok, out, doc_split, workers, progress, source_name)
        n_docs = sum(s.meta["n_documents"] for s in shards.values())
        if n_docs < 2:  # one document longer than sample_chars: no head count caught it
            for name in SHARD_FILES:
                (out / name).unlink(missing_ok=True)
            raise ValueError(f"the corpus has {n_docs} document(s); need at least 2")
        if not doc_split.exact and 0 in (s.meta["n_documents"] for s in shards.values()):
            # rare: every document fell on one side; split_documents moves one over
            doc_split = _Split(val_fraction, seed, n_docs)
            shards = _write_shards(source, tok, out, doc_split, workers, progress, source_name)
    return tok, doc_split, shards


def prepare(
    src: str | Path,
    out: str | Path,
    *,
    tokenizer: str = "moelab",
    workers: int = 1,
    fmt: str = "auto",
    field: str = "text",
    split: str | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = DEFAULT_SEED,
    sample_chars: int = DEFAULT_SAMPLE_CHARS,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise the corpus ``src`` into ``out`` (see the module's docstring); return the
    manifest written to ``out/prepare.json`` (documents, tokens, settings).

    ``tokenizer``: ``"moelab"`` (BPE of ``vocab_size`` trained on the first
    ``sample_chars`` characters of training documents) or a Hugging Face tokenizer
    directory. ``workers`` encoding processes (the output is the same for any number).
    ``fmt``, ``field`` and ``split`` choose how ``src`` is read (:func:`open_source`).
    ``val_fraction`` and ``seed`` split the documents as training would.

    Raises ``FileExistsError`` when ``out`` holds files and ``overwrite`` is false (with
    ``overwrite`` only the files named in the module's docstring are replaced);
    ``ValueError`` / ``FileNotFoundError`` for bad settings and sources (checked before
    any work); ``ImportError`` when a Parquet or Arrow source lacks pyarrow.
    """
    _check_settings(workers, val_fraction, sample_chars, field)
    source = open_source(src, fmt, field, split)
    out = Path(out)
    _check_out(out, overwrite)
    if tokenizer != "moelab":
        tok: Tokenizer | None = _hf_tokenizer(Path(tokenizer))
    else:
        tok = None
        if vocab_size < 257:
            raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 257")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # NOTE: first: out is incomplete from here on

    source_name = str(src)
    sample = {"documents": 0, "chars": 0}
    tok, doc_split, shards = _tokenise(
        source, tok, out, vocab_size, val_fraction, seed, sample_chars, workers, progress,
        source_name, sample,
    )  # fmt: skip
    write_atomic(out / "tokenizer.json", tok.to_json().encode("utf-8"))
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": 1,
        "source": source_name,
        "source_format": source.kind,
        "field": field if source.kind != "text" else None,
        "split": split,
        "tokenizer": "moelab" if tokenizer == "moelab" else str(tokenizer),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer_sample": sample if tokenizer == "moelab" else None,
        "sample_chars": sample_chars if tokenizer == "moelab" else None,
        "val_fraction": val_fraction,
        "seed": seed,
        "split_rule": "exact" if doc_split.exact else "hash",
        "n_documents": {k: s.meta["n_documents"] for k, s in shards.items()},
        "n_tokens": {k: s.meta["n_tokens"] for k, s in shards.items()},
    }
    write_json(out / MANIFEST, manifest)
    return manifest


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------- for training


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The ``prepare.json`` of the prepared folder ``folder``, checked: strict JSON, the
    manifest format, ``vocab_size`` and ``eos_id`` whole numbers (the end-of-document id
    an id of the vocabulary), ``val_fraction`` a number in (0, 1). Raises
    ``ValueError`` in one line naming the file otherwise."""
    path = Path(folder) / MANIFEST
    meta = read_json_object(path, "`moelab data prepare` manifest")
    if meta.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path} is not a `moelab data prepare` manifest; {remedy(path.parent)}")
    vocab = int_field(meta, "vocab_size", path, low=1)
    int_field(meta, "eos_id", path, high=vocab)
    fraction = meta.get("val_fraction")
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not (0.0 < fraction < 1.0)
    ):
        raise ValueError(
            f"{path}: val_fraction is {fraction!r}, not a number in (0, 1); {remedy(path.parent)}"
        )
    return meta


def check_manifest(
    folder: str | Path, tokenizer: Tokenizer, shards: dict[str, Any] | None = None
) -> None:
    """Raise ``ValueError`` (one line naming ``prepare.json``) unless the manifest of
    the prepared ``folder`` agrees with ``tokenizer`` (``vocab_size``, ``eos_id``) and
    with the opened ``shards`` (``{"train": TokenShard, "val": ...}``: their token and
    document counts), where given."""
    folder = Path(folder)
    path, meta = folder / MANIFEST, read_manifest(folder)
    fix = remedy(folder)
    for key, value in (("vocab_size", tokenizer.vocab_size), ("eos_id", tokenizer.eos_id)):
        if meta[key] != value:
            raise ValueError(
                f"{path} says {key} = {meta[key]} but the folder's tokenizer has {value}: the "
                f"manifest is false or belongs to other data; {fix}"
            )
    for name, shard in (shards or {}).items():
        counts = {"n_tokens": len(shard), "n_documents": shard.meta.get("n_documents")}
        for key, value in counts.items():
            said = meta.get(key)
            if isinstance(said, dict) and name in said and said[name] != value:
                raise ValueError(
                    f"{path} says {key} of {name} = {said[name]!r} but {shard.path.name} has "
                    f"{value!r}: the manifest and the shards are of different data; {fix}"
                )


def open_checked(folder: str | Path, tokenizer: Tokenizer) -> tuple[TokenShard, TokenShard]:
    """``(train, val)``: ``folder/train.bin`` and ``folder/val.bin`` opened with
    :func:`open_checked_shard` (a run's ``data`` folder, or a ``moelab data prepare``
    folder, whose ``prepare.json`` is then checked against ``tokenizer`` and the shards
    too). What the training loop, evaluation and the studies open a run's data with."""
    folder = Path(folder)
    train = open_checked_shard(folder / "train.bin", tokenizer)
    val = open_checked_shard(folder / "val.bin", tokenizer)
    if (folder / MANIFEST).is_file():
        check_manifest(folder, tokenizer, {"train": train, "val": val})
    return train, val


def is_prepared(data: str | Path | None) -> bool:
    """Whether ``data`` is a folder written by :func:`prepare` (``prepare.json`` in it).

    Raises ``ValueError`` for a folder that :func:`prepare` left incomplete (shards or
    temporaries but no ``prepare.json``: it was interrupted), which train must not read,
    and for a ``prepare.json`` that :func:`read_manifest` refuses.
    """
    if data is None or not str(data).strip():
        return False
    path = Path(data)
    if not path.is_dir():
        return False
    manifest = path / MANIFEST
    if manifest.is_file():
        read_manifest(path)
        return True
    if any((path / n).exists() for n in ("train.bin", "val.bin")) or any(path.glob("*.tmp")):
        raise ValueError(
            f"{path} holds the incomplete output of `moelab data prepare` (no {MANIFEST}: "
            f"it was interrupted); run it again"
        )
    return False


def link_prepared(data: str | Path, run: str | Path) -> None:
    """Give the run folder ``run`` the tokenizer and shards of the prepared folder
    ``data``: the shards hard-linked into ``run/data`` (symbolic links across file
    systems; never copied), ``tokenizer.json`` copied last (train's mark of prepared
    data). The folder's tokenizer is checked against its ``prepare.json`` first
    (:func:`check_manifest`); the shards are checked where the run opens them
    (:func:`moelab.data.open_checked`)."""
    data, run = Path(data), Path(run)
    check_manifest(data, Tokenizer.load(data / "tokenizer.json"))
    (run / "data").mkdir(parents=True, exist_ok=True)
    for name in SHARD_FILES:
        src, dst = data / name, run / "data" / name
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing from the prepared folder {data}")
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            tmp.symlink_to(src.resolve())
        os.replace(tmp, dst)
    tmp = run / "tokenizer.json.tmp"
    shutil.copyfile(data / "tokenizer.json", tmp)
    os.replace(tmp, run / "tokenizer.json")
