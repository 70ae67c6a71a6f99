"""The corpus sources that ``moelab data prepare`` streams: text folders, JSONL (also
gzipped), Parquet and saved ``datasets`` (Arrow) folders (see
:mod:`moelab.data.prepare` for what each reads). :func:`open_source` tells them apart and
checks the text field before any work; :meth:`Source.documents` streams the documents."""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab.data._checks import plain_name, read_json_object
from moelab.data.corpus import TEXT_SUFFIXES, iter_documents

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_ROWS_PER_BATCH = 1024  # rows per Parquet record batch read

__all__ = ["FORMATS", "Source", "open_source"]


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
