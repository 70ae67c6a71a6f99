"""A cache of the prepared default corpus: a run on the Python documentation (``--data``
left out) reuses the tokenizer and token shards that an earlier run with the same
settings made, instead of preparing them again (about 13-17 s: reading and converting
500 reST files, training the tokenizer, encoding 7 M characters).

    entry = default_corpus_entry(vocab_size=2048, val_fraction=0.05, split_seed=0)
    restore_default_corpus(entry, run)   # True: run/tokenizer.json and run/data/ written
    store_default_corpus(entry, run)     # after a run prepared them itself

Never a different corpus: an entry's key is a sha256 over

* the default corpus's text files: each one's path below the folder and the sha256 of
  its bytes (every file that :func:`moelab.data.load_corpus` reads; an update of the
  ``python3-doc`` package is another corpus);
* the settings of the data: ``vocab_size``, ``val_fraction``, the split seed;
* the code that prepares it: the bytes of moelab/data/corpus.py, tokenizer.py and
  shards.py, moelab's and the tokenizers package's versions (a change of the reST
  conversion or of the tokenizer training is another corpus);

and a restored file must have the sha256 the entry recorded when it was stored (a
damaged entry is removed, and the data prepared again). The files restored are
byte-identical to what preparing them again would write, so a run's corpus identity
(:func:`moelab.data.corpus_identity`, recorded in config.json) is the same either way.

The cache lives in ``$MOELAB_CACHE_DIR`` (``off`` or an empty value: no cache), else
``$XDG_CACHE_HOME/moelab``, else ``~/.cache/moelab``; each entry is
``default-corpus/KEY/`` (about 30 MB at the default settings), written whole through a
temporary folder and a rename. Removing the folder is always safe. A failure to store
an entry (a full disk, a read-only home) costs the next run its preparation, nothing
else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab import __version__
from moelab.data import corpus

__all__ = [
    "CACHE_ENV",
    "CacheEntry",
    "cache_root",
    "default_corpus_entry",
    "restore_default_corpus",
    "store_default_corpus",
]

CACHE_ENV = "MOELAB_CACHE_DIR"
_FORMAT = 1
_DATA_FILES = ("train.bin", "train.json", "val.bin", "val.json")
_CODE = ("corpus.py", "tokenizer.py", "shards.py")
"""The modules whose code decides the prepared bytes (conversion, tokenizer, shards)."""


@dataclass(frozen=True)
class CacheEntry:
    """Where the prepared default corpus of one key is (or would be) cached."""

    path: Path
    key: str
    settings: dict[str, Any]


def cache_root() -> Path | None:
    """The cache folder (module docstring), or None when ``$MOELAB_CACHE_DIR`` turns the
    cache off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        if value.strip().lower() in ("", "off", "0", "no", "none"):
            return None
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moelab"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _code_digest() -> str:
    import tokenizers

    h = hashlib.sha256(f"moelab {__version__} tokenizers {tokenizers.__version__}".encode())
    here = Path(__file__).parent
    for name in _CODE:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()


def default_corpus_entry(
    vocab_size: int, val_fraction: float, split_seed: int
) -> CacheEntry | None:
    """The cache entry of the default corpus prepared with these settings, or None: no
    cache (:func:`cache_root`), or no default corpus installed (preparing it says so)."""
    root = cache_root()
    folder = corpus.DEFAULT_CORPUS_DIR
    if root is None or not folder.is_dir():
        return None
    files = sorted(
        (
            p
            for p in folder.rglob("*")
            if p.is_file() and p.name.lower().endswith(corpus.TEXT_SUFFIXES)
        ),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(folder).as_posix()}\0{_sha256(p)}\n".encode())
    settings = {
        "format": _FORMAT,
        "corpus": str(folder),
        "corpus_sha256": h.hexdigest(),
        "files": len(files),
        "vocab_size": int(vocab_size),
        "val_fraction": float(val_fraction),
        "split_seed": int(split_seed),
        "code_sha256": _code_digest(),
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]
    return CacheEntry(root / "default-corpus" / key, key, settings)


def _say(line: str) -> None:
    print(f"moelab: {line}", file=sys.stderr, flush=True)


def restore_default_corpus(entry: CacheEntry | None, run: Path) -> bool:
    """Copy the cached tokenizer and shards of ``entry`` into the run folder ``run``
    (``run/data/``, then ``run/tokenizer.json``, which marks the data complete), each
    checked against the sha256 the entry recorded; True when done. False (nothing left
    in ``run``) when there is no entry or it is damaged (then it is removed)."""
    if entry is None or not (entry.path / "cache.json").is_file():
        return False
    written: list[Path] = []
    try:
        record = json.loads((entry.path / "cache.json").read_text(encoding="utf-8"))
        if record.get("settings") != entry.settings:
            raise ValueError("its settings are not the key's")
        digests = record["sha256"]
        (run / "data").mkdir(parents=True, exist_ok=True)
        for src, dst in [
            *((entry.path / n, run / "data" / n) for n in _DATA_FILES),
            (entry.path / "tokenizer.json", run / "tokenizer.json"),
        ]:
            tmp = dst.with_name(f".{dst.name}.cached{os.getpid()}")
            written.append(tmp)
            shutil.copyfile(src, tmp)
            if _sha256(tmp) != digests[src.name]:
                raise ValueError(f"{src.name} is not the file it stored")
            os.replace(tmp, dst)
            written.append(dst)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        if not isinstance(err, OSError):  # a damaged entry: prepared again, stored anew
            shutil.rmtree(entry.path, ignore_errors=True)
            _say(f"the cached default corpus {entry.path} is damaged ({err}); preparing it again")
        return False
    _say(
        f"the default corpus as prepared before, from the cache {entry.path} "
        f"(same files, settings and code; {CACHE_ENV}=off prepares it again)"
    )
    return True


def store_default_corpus(entry: CacheEntry | None, run: Path) -> None:
    """Keep the tokenizer and shards the run ``run`` prepared as ``entry`` for later
    runs: copied into a temporary folder beside it, then renamed into place. A failure
    leaves no entry and is not an error (the cache only saves time)."""
    if entry is None or entry.path.exists():
        return
    tmp = entry.path.with_name(f".{entry.key}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        digests = {}
        for src in [*(run / "data" / n for n in _DATA_FILES), run / "tokenizer.json"]:
            shutil.copyfile(src, tmp / src.name)
            digests[src.name] = _sha256(tmp / src.name)
        record = {"settings": entry.settings, "sha256": digests}
        (tmp / "cache.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, entry.path)
    except OSError:
        pass  # NOTE: another process stored it first, or the disk is full: no entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
