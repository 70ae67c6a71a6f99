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
import gzip
import json
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moelab.data._checks import (
    MANIFEST,
    int_field,
    one_line,
    plain_name,
    read_json_object,
    remedy,
)
from moelab.data.corpus import TEXT_SUFFIXES, corpus_warnings_as_lines, iter_documents
from moelab.data.shards import ShardWriter, _unit_hash, split_documents, token_dtype
from moelab.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow")
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
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_ROWS_PER_BATCH = 1024  # rows per Parquet record batch read

__all__ = [
    "DEFAULT_SAMPLE_CHARS",
    "FORMATS",
    "Source",
    "check_manifest",
    "is_prepared",
    "link_prepared",
    "open_source",
    "ordered_map",
    "prepare",
    "read_manifest",
]


# ---------------------------------------------------------------------------- sources


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError(
            "reading Parquet and saved `datasets` (Arrow) folders needs pyarrow: "
            "pip install 'moelab[data]' (or pip install pyarrow)"
        ) from e
    return pyarrow


def _kind_of(name: str) -> str | None:
    name = name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _is_saved_dataset(path: Path) -> bool:
    return any(
        (path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


@dataclass(frozen=True)
class Source:
    """A corpus to stream: its kind (``text``, ``jsonl``, ``parquet``, ``arrow``), the
    files read in order and the text field. :meth:`documents` iterates it afresh."""

    path: Path
    kind: str
    files: tuple[Path, ...]
    field: str

    def documents(self) -> Iterator[str]:
        """The documents (non-empty strings), in a fixed order."""
        if self.kind == "text":
            return iter_documents(self.path)
        reader: Callable[[Path], Iterator[str]] = {
            "jsonl": self._jsonl,
            "parquet": self._parquet,
            "arrow": self._arrow,
        }[self.kind]
        return (doc for f in self.files for doc in reader(f))

    def _text(self, value: Any, where: str) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {self.field!r} holds a {type(value).__name__}, not text; "
                f"choose the text field with --field"
            )
        return value if value.strip() else None

    def _jsonl(self, path: Path) -> Iterator[str]:
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            line_no = 0
            while True:
                try:
                    line = f.readline()
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{path}:{line_no + 1}: not UTF-8 text ({e.reason}); convert it to UTF-8"
                    ) from None
                if not line:
                    return
                line_no += 1
                if not line.strip():
                    continue
                text = self._text(
                    _jsonl_field(line, self.field, f"{path}:{line_no}"), f"{path}:{line_no}"
                )
                if text is not None:
                    yield text

    def _parquet(self, path: Path) -> Iterator[str]:
        pa = _pyarrow()
        # NOTE: buffered page reads: a row group is not loaded whole
        pf = pa.parquet.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
        _check_column(pf.schema_arrow, self.field, path, pa)
        for batch in pf.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[self.field]):
            for value in batch.column(0).to_pylist():
                if (text := self._text(value, str(path))) is not None:
                    yield text

    def _arrow(self, path: Path) -> Iterator[str]:
        pa = _pyarrow()
        with _open_arrow(path, pa) as reader:
            _check_column(reader.schema, self.field, path, pa)
            index = reader.schema.get_field_index(self.field)
            for batch in _arrow_batches(reader):
                for value in batch.column(index).to_pylist():
                    if (text := self._text(value, str(path))) is not None:
                        yield text


def _jsonl_field(line: str, field: str, where: str) -> Any:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: not valid JSON ({e.msg}); each line of a JSONL file must be one JSON object"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise ValueError(
            f"{where} has no field {field!r} (its fields: {sorted(record)}); choose the text "
            f"field with --field"
        )
    return record[field]


def _check_column(schema: Any, field: str, path: Path, pa: Any) -> None:
    if field not in schema.names:
        raise ValueError(
            f"{path} has no column {field!r} (its columns: {schema.names}); choose the text "
            f"column with --field"
        )
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise ValueError(
            f"{path}: column {field!r} is {typ}, not text; choose the text column with --field"
        )


@contextlib.contextmanager
def _open_arrow(path: Path, pa: Any) -> Iterator[Any]:
    """A reader of an Arrow IPC file: the stream format (what save_to_disk writes) or the
    random-access file format."""
    with pa.OSFile(str(path)) as source:  # NOTE: read, not mapped: RSS stays flat
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise ValueError(f"{path} is not an Arrow IPC file ({e})") from None
        yield reader


def _arrow_batches(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "num_record_batches"):  # file format
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _saved_dataset_files(path: Path, split: str | None) -> list[Path]:
    """The Arrow files of the saved dataset ``path`` in order (of its split ``split``
    when it is a DatasetDict). The split folder and the files that ``dataset_dict.json``
    and ``state.json`` name must be plain names in their folder: a data file cannot
    send the reader elsewhere."""
    index = path / "dataset_dict.json"
    if index.is_file():  # a DatasetDict: one folder per split
        splits = read_json_object(index, "datasets DatasetDict index").get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise ValueError(f"{index}: splits is {splits!r}, not a list of split names")
        key = split or "train"
        if key not in splits:
            raise ValueError(f"{path} has splits {splits}; choose one with --split")
        path = path / plain_name(key, "split", index)
    elif split is not None:
        raise ValueError(f"{path} is one dataset, not a DatasetDict with splits; drop --split")
    state = path / "state.json"
    if state.is_file():
        entries = read_json_object(state, "datasets state file").get("_data_files")
        if not isinstance(entries, list) or not all(isinstance(f, dict) for f in entries):
            raise ValueError(f"{state}: _data_files is {entries!r}, not a list of files")
        files = [path / plain_name(f.get("filename"), "filename", state) for f in entries]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{state} names Arrow files that do not exist: {missing[:3]}")
    else:
        files = sorted(path.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow files in the saved dataset {path}")
    return files


def open_source(
    src: str | Path, fmt: str = "auto", field: str = "text", split: str | None = None
) -> Source:
    """The :class:`Source` of ``src`` (see the module's docstring for the formats).

    Raises ``FileNotFoundError`` for a missing ``src`` or one without files of its
    format; ``ValueError`` for an unknown format, a folder mixing formats (choose one
    with ``fmt``), a missing or non-text field (checked on the schema, or the first
    JSONL line), or ``split`` on a source without splits.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {list(FORMATS)}")
    if isinstance(src, str) and not src.strip():
        raise ValueError("the source is an empty string; give a corpus file or folder")
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(
            f"source {str(path)!r} does not exist; give a folder or file of text, JSONL, "
            f"Parquet, or a saved `datasets` folder"
        )
    if split is not None and not (path.is_dir() and _is_saved_dataset(path)):
        raise ValueError("--split applies to a saved `datasets` folder (a DatasetDict) only")
    if path.is_dir() and _is_saved_dataset(path) and fmt in ("auto", "arrow"):
        kind, files = "arrow", _saved_dataset_files(path, split)
    elif path.is_file():
        kind = _kind_of(path.name) if fmt == "auto" else fmt
        if kind is None:
            raise ValueError(
                f"unknown format of {path} (its name ends neither in .jsonl, .jsonl.gz, "
                f".parquet, .arrow nor {'/'.join(TEXT_SUFFIXES)}); give --format "
                f"{'|'.join(FORMATS[1:])}"
            )
        files = [path]
    else:
        by_kind: dict[str, list[Path]] = collections.defaultdict(list)
        for p in path.rglob("*"):
            if p.is_file() and (k := _kind_of(p.name)) is not None:
                by_kind[k].append(p)
        if fmt == "auto":
            kinds = sorted(by_kind)
            if len(kinds) > 1:
                raise ValueError(
                    f"{path} mixes formats ({', '.join(kinds)} files); choose one with --format"
                )
            if not kinds:
                raise FileNotFoundError(
                    f"no .jsonl, .jsonl.gz, .parquet, .arrow or {'/'.join(TEXT_SUFFIXES)} "
                    f"files under {path}"
                )
            kind = kinds[0]
        else:
            kind = fmt
        files = sorted(by_kind.get(kind, []), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"no {kind} files under {path}")
    source = Source(path=path, kind=kind, files=tuple(files), field=field)
    _check_field(source)
    return source


def _check_field(source: Source) -> None:
    """Fail now, not deep into the stream, on a missing field or a file of another
    format."""
    if source.kind in ("parquet", "arrow"):
        pa = _pyarrow()
        f = source.files[0]
        if source.kind == "parquet":
            try:
                schema = pa.parquet.read_schema(f)
            except pa.ArrowInvalid as e:
                raise ValueError(f"{f} is not a Parquet file ({e})") from None
            _check_column(schema, source.field, f, pa)
        else:
            with _open_arrow(f, pa) as reader:
                _check_column(reader.schema, source.field, f, pa)
    elif source.kind == "jsonl":
        for doc in source._jsonl(source.files[0]):  # the first line with text
            del doc
            break


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


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Each encoding process uses one thread (``--workers`` counts the cores used), and
    forked workers inherit the setting (no fork warning from the tokenizers library)."""
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
        return _unit_hash(self.seed, i) < self.val_fraction


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
                methods = multiprocessing.get_all_start_methods()
                ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
                pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tok.to_json(), dtype))
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
    if int(workers) != workers or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, got {workers}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if sample_chars < 1:
        raise ValueError(f"sample_chars must be >= 1, got {sample_chars}")
    if not field:
        raise ValueError("field is empty; name the field that holds the text")
    source = open_source(src, fmt, field, split)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out} is not empty; choose another --out, or replace its prepared data "
                f"with --overwrite"
            )
    if tokenizer != "moelab":
        tok: Tokenizer | None = _hf_tokenizer(Path(tokenizer))
    else:
        tok = None
        if vocab_size < 257:
            raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 257")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # NOTE: first: out is incomplete from here on

    # NOTE: files of a text folder that are skipped: one line on stderr, however often
    # the corpus is read
    with corpus_warnings_as_lines(_stderr_line):
        n_head = _head_count(source, sample_chars)
        if n_head is not None and n_head < 2:
            raise ValueError(f"the corpus has {n_head} document(s); need at least 2")
        doc_split = _Split(val_fraction, seed, n_head)
        sample = {"documents": 0, "chars": 0}
        if tok is None:
            tok = train_tokenizer(_sample(source, doc_split, sample_chars, sample), vocab_size)
        source_name = str(src)
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
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(tok.to_json(), encoding="utf-8")
    os.replace(tmp, out / "tokenizer.json")
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
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / MANIFEST)
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
