"""Whether a run folder's tokenizer and data shards are those it trained on: checked
against the record of its corpus that training writes into config.json
(``run_info.corpus``: :func:`moelab.data.corpus_identity`, each file's sha256), wherever
the run is read back (:func:`check_corpus`; public as ``moelab.runs.check_corpus``).

    check_corpus(run, ("val",))     # CorpusMismatch: another run's data/val.bin
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab.data._checks import config_fix, data_fix, read_json_object
from moelab.data.shards import corpus_identity

__all__ = ["PARTS", "CorpusMismatch", "check_corpus", "corpus_record", "note_once"]


PARTS = {"tokenizer": "tokenizer.json", "train": "data/train.bin", "val": "data/val.bin"}
"""The files of a run's corpus, by the name :func:`check_corpus` takes them under."""
_RECORDED = {"tokenizer": "tokenizer.json", "train": "train.bin", "val": "val.bin"}
_WHAT = {"tokenizer": "tokenizer", "train": "training split", "val": "validation split"}


class CorpusMismatch(ValueError):
    """A run folder's tokenizer.json or data shards are not those it trained on (the
    message names the file, what config.json recorded, what was found, and what to do;
    ``what``: the same without what to do)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}; {fix}")
        self.what = what


_noted: set[str] = set()


def note_once(line: str) -> None:
    """A line for the user on stderr, once per process."""
    if line not in _noted:
        _noted.add(line)
        print(line, file=sys.stderr, flush=True)


def corpus_record(run: str | Path) -> dict[str, Any] | None:
    """The record of the data ``run`` trained on (config.json's ``run_info.corpus``, see
    :func:`moelab.data.corpus_identity`), or None for a run trained before moelab
    recorded it. ValueError (one line naming config.json) when the file, or the record,
    is not what moelab writes."""
    run = Path(run)
    if not (run / "config.json").is_file():
        return None  # not a trained run's folder (prepared data linked into one)
    path = run / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path} is not valid JSON; {config_fix(run)}") from None
    info = saved.get("run_info") if isinstance(saved, dict) else None
    record = info.get("corpus") if isinstance(info, dict) else None
    if record is None:
        return None
    digests = record.get("sha256") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("id"), str)
        or not (
            digests is None
            or (
                isinstance(digests, dict)
                and all(isinstance(digests.get(n), str) for n in _RECORDED.values())
            )
        )
    ):
        raise ValueError(
            f"{run / 'config.json'}: run_info.corpus is {json.dumps(record)[:60]}, not moelab's "
            f"record of the data the run trained on; {config_fix(run)}"
        )
    return record


def _found(run: Path, part: str) -> tuple[str, dict[str, Any]]:
    """The sha256 of a part of ``run``'s corpus as it is now (a shard's as its metadata
    gives it: the file itself is checked against that where it is opened) and the
    shard's metadata ({} for the tokenizer)."""
    if part == "tokenizer":
        path = run / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; {data_fix(run)}")
        return hashlib.sha256(path.read_bytes()).hexdigest(), {}
    meta_path = run / "data" / f"{part}.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} is missing; {data_fix(run)}")
    meta = read_json_object(meta_path, "token shard's metadata")
    digest = meta.get("sha256")
    if not isinstance(digest, str):
        raise ValueError(f"{meta_path} has no sha256 of its shard; {data_fix(run)}")
    return digest, meta


def _mismatch(
    run: Path, part: str, found: str, want: str, meta: dict[str, Any], n: Any
) -> CorpusMismatch:
    path = run / PARTS[part]
    if part == "tokenizer":
        how = "it is empty" if found == _EMPTY else f"its sha256 is {found[:16]}..."
    else:
        how = f"its sha256 ({path.with_suffix('.json').name}) is {found[:16]}..."
        if isinstance(n, int) and meta.get("n_tokens") != n:
            how += f" ({meta.get('n_tokens')} tokens; the run's had {n})"
    return CorpusMismatch(
        f"{path} is not the {_WHAT[part]} this run trained on: {how}, config.json recorded "
        f"{want[:16]}... (run_info.corpus)",
        data_fix(run),
    )


_EMPTY = hashlib.sha256(b"").hexdigest()


def check_corpus(run: str | Path, parts: Sequence[str] = ("tokenizer", "train", "val")) -> bool:
    """Check that the ``parts`` ("tokenizer", "train", "val": :data:`PARTS`) of
    ``run``'s folder are those it trained on, against config.json's record
    (``run_info.corpus``). Cheap: the tokenizer file's sha256 and the shards' metadata;
    each shard file is checked against its metadata where it is opened
    (:func:`moelab.data.open_checked_shard`).

    A run recorded by a moelab that kept one digest over all three (``id`` without
    ``sha256``) is checked as a whole (every part, which needs all three files), and the
    message says which file differs where the token counts tell. A run trained before
    any record has nothing to check against: a note says so on stderr (once), and False
    is returned. True: checked.

    Raises:
        CorpusMismatch: a part is not the run's (naming the file, what config.json
            recorded and what was found, and what to do; never to start over).
        FileNotFoundError, ValueError: a part, or config.json, is missing or damaged.
    """
    run = Path(run)
    record = corpus_record(run)
    if record is None:
        if (run / "config.json").is_file():
            note_once(
                f"note: {run / 'config.json'} holds no record of the data the run trained on (it "
                "predates run_info.corpus), so its tokenizer.json and data/ are checked against "
                "each other only"
            )
        return False
    n_tokens = record.get("n_tokens") if isinstance(record.get("n_tokens"), dict) else {}
    digests = record.get("sha256")
    if digests is None:
        return _check_id(run, record, n_tokens)
    for part in parts:
        found, meta = _found(run, part)
        want = digests[_RECORDED[part]]
        if found != want:
            raise _mismatch(run, part, found, want, meta, n_tokens.get(part))
    return True


def _check_id(run: Path, record: dict[str, Any], n_tokens: dict[str, Any]) -> bool:
    """The check of a run whose record is one digest over its tokenizer and both
    shards (written before the record held each part's)."""
    for part in PARTS:
        _found(run, part)  # missing or damaged: that file's own error
    now = corpus_identity(run / "tokenizer.json", run / "data")
    if now["id"] == record["id"]:
        return True
    for split in ("train", "val"):
        n = n_tokens.get(split)
        if isinstance(n, int) and now["n_tokens"].get(split) != n:
            raise CorpusMismatch(
                f"{run / PARTS[split]} is not the {_WHAT[split]} this run trained on: it holds "
                f"{now['n_tokens'].get(split)} tokens, config.json recorded {n} (run_info.corpus)",
                data_fix(run),
            )
    raise CorpusMismatch(
        f"{run / 'tokenizer.json'} or {run / 'data'} is not what this run trained on: together "
        f"they give corpus {now['id']}, config.json recorded {record['id']} (run_info.corpus: "
        "this run's record, from an older moelab, is one digest over the three files, so which "
        "one differs cannot be told)",
        data_fix(run),
    )
