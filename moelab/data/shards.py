"""Token shards: a corpus tokenised into one flat memory-mapped file, and batches from it.

A shard is two files: ``NAME.bin``, the token ids of all its documents one after the
other, each document followed by the end-of-document token, as raw little-endian
``uint16`` (``uint32`` when the vocabulary has 65536 ids or more); and ``NAME.json``, its
metadata (dtype, number of tokens and documents, vocabulary size, end-of-document id,
source, sha256 of the ``.bin``).

What is checked, and when (a failed check is a ``ValueError`` of one line that names
the file and what to do):

* every :meth:`TokenShard.open`: the metadata is strict JSON with fields of the right
  types; its ``file`` is a plain name of a file beside it, which, links resolved, stays
  in that folder (or in the prepared folder it was linked from); the file size is
  ``n_tokens`` ids of its dtype; every id is below ``vocab_size`` (a max over the file
  in chunks: about 1.5 ms for 10M tokens in the page cache, the cost of reading 20 MB
  from a cold disk otherwise);
* :func:`open_checked` / :func:`open_checked_shard`, which training, evaluation and the
  studies open a run's data with, also: ``vocab_size`` and ``eos_id`` equal to the
  tokenizer's, and the sha256 of the ``.bin`` (about 18 ms for 10M tokens), once per
  version of the file: ``NAME.verified.json`` beside it records the size, mtime and
  hash that were checked, and the hash is read again when the size or mtime changes
  (:meth:`TokenShard.verify_hash_once`). Only the hash catches a change that keeps the
  ids in range (e.g. a high byte zeroed). It guards against damage, not against
  someone who rewrites the metadata's hash along with the file.

    shards = write_shards(docs, tok, run / "data", val_fraction=0.05, seed=0)
    train, val = open_checked(run / "data", tok)
    for step, (x_BS, y_BS) in zip(range(n_steps), batches(train, 8, 256, seed=0)):
        ...

Legend: B batch size, S sequence length, W number of windows of S + 1 tokens.

Shape suffixes: B, S (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab._io import named, write_json
from moelab.data._checks import (
    MANIFEST,
    inside,
    int_field,
    plain_name,
    read_json_object,
    remedy,
)
from moelab.data.tokenizer import Tokenizer

FORMAT = "moelab-tokens"
VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_ENCODE_CHUNK = 256  # documents per encode_batch call

__all__ = [
    "ShardWriter",
    "TokenShard",
    "batches",
    "corpus_identity",
    "open_checked_shard",
    "split_documents",
    "token_dtype",
    "unigram_entropy",
    "write_shard",
    "write_shards",
]


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id fits in 16 bits, else ``"uint32"``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# ----------------------------------------------------------------------------- split


def unit_hash(seed: int, index: int) -> float:
    """Document ``index``'s number in [0, 1) for the split of ``seed`` (the sha256 of
    both): :func:`split_documents` puts it in validation when below ``val_fraction``."""
    digest = hashlib.sha256(f"moelab-split:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64


def split_documents(
    n_documents: int, val_fraction: float, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Deterministic train/validation split of document indices ``0 .. n-1``.

    Document ``i`` goes to validation when ``u_i < val_fraction``, with ``u_i`` in [0, 1)
    from the sha256 of ``(seed, i)``: the same corpus and seed always give the same split,
    independent of platform, and appending documents never moves the earlier ones. On tiny
    corpora, where a part would come out empty, the document with the smallest ``u`` is
    moved to validation (or the largest to training), so that with ``n >= 2`` and
    ``0 < val_fraction < 1`` each part has at least one document.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1]")
    u = [unit_hash(seed, i) for i in range(n_documents)]
    val = {i for i in range(n_documents) if u[i] < val_fraction}
    if n_documents >= 2 and 0.0 < val_fraction < 1.0:
        if not val:
            val = {min(range(n_documents), key=u.__getitem__)}
        elif len(val) == n_documents:
            val.discard(max(range(n_documents), key=u.__getitem__))
    train = [i for i in range(n_documents) if i not in val]
    return train, sorted(val)


# ----------------------------------------------------------------------------- write


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


class ShardWriter:
    """Write one shard incrementally: :meth:`append` token ids (each document already
    followed by ``eos_id``) to ``NAME.bin.tmp``; :meth:`finish` writes the metadata and
    renames both files into place; :meth:`abort` removes the temporaries. Memory stays
    that of one appended chunk, whatever the shard's size.

        with ShardWriter(out / "train.bin", tok.vocab_size, tok.eos_id) as w:
            w.append(ids_N, n_documents=3)
        shard = w.shard  # opened after finish(), which `with` calls on success
    """

    def __init__(
        self,
        path: str | Path,
        vocab_size: int,
        eos_id: int,
        *,
        source: str = "",
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.eos_id = int(vocab_size), int(eos_id)
        self.dtype_name = token_dtype(self.vocab_size)
        self.dtype = _DTYPES[self.dtype_name]
        self.source, self.extra = source, dict(extra or {})
        self.n_tokens = self.n_documents = 0
        self._sha = hashlib.sha256()
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._meta_tmp = self.path.with_name(self.path.name + ".json.tmp")
        self._file: Any = open(self._tmp, "wb")  # closed by finish() or abort()
        self.shard: TokenShard | None = None

    def append(self, ids: np.ndarray | Sequence[int] | bytes, n_documents: int) -> None:
        """Append token ids (an array, a list, or the raw bytes of this shard's dtype)."""
        data = ids if isinstance(ids, bytes) else np.asarray(ids, dtype=self.dtype).tobytes()
        if len(data) % self.dtype.itemsize:
            raise ValueError(f"{len(data)} bytes are not whole {self.dtype_name} ids")
        try:
            self._file.write(data)
        except OSError as err:  # a full disk: name the shard
            raise named(err, self.path) from err
        self._sha.update(data)
        self.n_tokens += len(data) // self.dtype.itemsize
        self.n_documents += n_documents

    def finish(self) -> TokenShard:
        """Close the file, write the metadata, rename both into place; the opened shard."""
        try:
            self._file.close()
        except OSError as err:  # a full disk: name the shard
            raise named(err, self.path) from err
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "file": self.path.name,
            "dtype": self.dtype_name,
            "n_tokens": self.n_tokens,
            "n_documents": self.n_documents,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "source": self.source,
            "sha256": self._sha.hexdigest(),
            **self.extra,
        }
        try:
            self._meta_tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            raise named(err, _meta_path(self.path)) from err
        os.replace(self._tmp, self.path)
        os.replace(self._meta_tmp, _meta_path(self.path))
        self.shard = TokenShard.open(self.path)
        return self.shard

    def abort(self) -> None:
        """Close and delete the temporaries (the shard in place, if any, is untouched)."""
        with contextlib.suppress(OSError):  # the flush of a full disk's last bytes
            self._file.close()
        self._tmp.unlink(missing_ok=True)
        self._meta_tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def write_shard(
    path: str | Path,
    documents: Iterable[str],
    tokenizer: Tokenizer,
    *,
    source: str = "",
    extra: dict[str, Any] | None = None,
) -> TokenShard:
    """Tokenise ``documents`` (each followed by ``eos_id``) into ``path`` (``.bin``) and
    its metadata ``path.with_suffix(".json")``; return the opened shard.

    Streams: documents are encoded in chunks and appended to the file
    (:class:`ShardWriter`), so the corpus never has to fit in memory as tokens. Both
    files are written to temporaries first and renamed, so an interrupted write leaves
    no half shard behind.
    """
    with ShardWriter(
        path, tokenizer.vocab_size, tokenizer.eos_id, source=source, extra=extra
    ) as writer:

        def flush(chunk: list[str]) -> None:
            ids: list[int] = []
            for doc_ids in tokenizer.encode_batch(chunk):
                ids.extend(doc_ids)
                ids.append(tokenizer.eos_id)
            writer.append(ids, len(chunk))

        chunk: list[str] = []
        for doc in documents:
            chunk.append(doc)
            if len(chunk) == _ENCODE_CHUNK:
                flush(chunk)
                chunk = []
        if chunk:
            flush(chunk)
    assert writer.shard is not None
    return writer.shard


def write_shards(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    source: str = "",
) -> dict[str, TokenShard]:
    """Split ``documents`` with :func:`split_documents` and write ``out_dir/train.bin`` and
    ``out_dir/val.bin`` (with their ``.json``); return ``{"train": ..., "val": ...}``."""
    out_dir = Path(out_dir)
    train_ids, val_ids = split_documents(len(documents), val_fraction, seed)
    split_info = {"split_seed": seed, "val_fraction": val_fraction}
    return {
        name: write_shard(
            out_dir / f"{name}.bin",
            (documents[i] for i in ids),
            tokenizer,
            source=source,
            extra={"split": name, **split_info},
        )
        for name, ids in (("train", train_ids), ("val", val_ids))
    }


# ------------------------------------------------------------------------------ read


@dataclass(frozen=True)
class TokenShard:
    """A memory-mapped token file and its metadata (open with :meth:`open`)."""

    path: Path
    tokens: np.ndarray = field(repr=False)  # (N,) uint16/uint32, read-only memmap
    meta: dict[str, Any] = field(repr=False)
    meta_path: Path | None = field(default=None, repr=False)  # None: not from a file

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def open(cls, path: str | Path, *, verify_hash: bool = False) -> TokenShard:
        """Memory-map ``path`` (the ``.bin``, or its ``.json``) after checking it.

        Raises ``ValueError``, in one line naming the file and what to do, when the
        metadata is not strict JSON or not a moelab token shard, a field has the wrong
        type, its ``file`` is not a plain name of a file beside it (or is a link that
        leads out of the folder, see :func:`_check_inside`), the dtype is unknown or too
        small for the vocabulary, ``eos_id`` is not an id of the vocabulary, the file
        size is not ``n_tokens * itemsize`` (truncated or foreign file), or an id is
        ``>= vocab_size`` (a max over the file, read in chunks: about 1.5 ms for 10M
        tokens in the page cache); with ``verify_hash`` also when the sha256 differs
        (reads the whole file; see :meth:`verify_hash_once` for the recorded check).
        """
        path = Path(path)
        meta_path = path if path.suffix == ".json" else _meta_path(path)
        if not meta_path.is_file():
            raise FileNotFoundError(f"no shard metadata {meta_path}; write it with write_shard")
        fix = remedy(meta_path.parent)
        meta = read_json_object(meta_path, "token shard's metadata")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} is not a {FORMAT} metadata file; {fix}")
        name = plain_name(meta.get("file", meta_path.with_suffix(".bin").name), "file", meta_path)
        bin_path = meta_path.with_name(name)
        dtype_name = meta.get("dtype")
        if dtype_name not in _DTYPES:
            raise ValueError(
                f"{meta_path}: dtype {dtype_name!r} is not one of {list(_DTYPES)}; {fix}"
            )
        dtype = _DTYPES[dtype_name]
        n_tokens = int_field(meta, "n_tokens", meta_path)
        vocab = int_field(meta, "vocab_size", meta_path, low=1)
        int_field(meta, "eos_id", meta_path, high=vocab)  # an id of the vocabulary
        if vocab > np.iinfo(dtype).max + 1:
            raise ValueError(f"{meta_path}: vocab_size {vocab} does not fit in {dtype_name}; {fix}")
        if not bin_path.is_file():
            raise FileNotFoundError(f"{bin_path} (named by {meta_path}) does not exist")
        _check_inside(bin_path, meta_path)
        size, expected = bin_path.stat().st_size, n_tokens * dtype.itemsize
        if size != expected:
            raise ValueError(
                f"{bin_path} has {size} bytes but its metadata says {n_tokens} tokens of "
                f"{dtype_name} = {expected} bytes: the file is truncated or does not belong "
                f"to {meta_path.name}; {fix}"
            )
        if n_tokens == 0:
            tokens: np.ndarray = np.empty(0, dtype=dtype)
        else:
            tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
        top = _max_id(tokens)
        if top >= vocab:
            raise ValueError(
                f"{bin_path} holds token id {top} but its vocabulary has {vocab} ids "
                f"(0 .. {vocab - 1}): the shard is damaged or was not made with this "
                f"vocabulary; {fix}"
            )
        shard = cls(path=bin_path, tokens=tokens, meta=meta, meta_path=meta_path)
        if verify_hash:
            shard._check_sha256()
        return shard

    def _fix(self) -> str:
        return remedy(self.path.parent)

    def check_against(self, tokenizer: Tokenizer) -> None:
        """Raise ``ValueError`` (one line naming the metadata) unless the shard's
        ``vocab_size`` and ``eos_id`` are ``tokenizer``'s (the size of its vocabulary,
        special tokens included, and its end-of-document id, which write_shard appends
        after every document)."""
        where = self.meta_path or self.path
        for key, mine, theirs in (
            ("vocab_size", self.vocab_size, tokenizer.vocab_size),
            ("eos_id", self.eos_id, tokenizer.eos_id),
        ):
            if mine != theirs:
                raise ValueError(
                    f"{where} says {key} = {mine} but the tokenizer's is {theirs}: the shard "
                    f"was not made with this tokenizer, or its metadata is false; {self._fix()}"
                )

    def _check_sha256(self) -> None:
        want = self.meta.get("sha256")
        if not isinstance(want, str) or not want:
            raise ValueError(
                f"{self.meta_path or self.path} has no sha256 to check {self.path.name} "
                f"against; {self._fix()}"
            )
        digest = _sha256_file(self.path)
        if digest != want:
            raise ValueError(
                f"{self.path}: its sha256 is {digest}, not the {want} of its metadata: the "
                f"file was changed or damaged after it was written; {self._fix()}"
            )

    def verify_hash_once(self) -> bool:
        """Check the file's sha256 against its metadata, unless a record says this very
        file (same size and modification time, same expected hash) was checked before;
        return whether it was hashed now. Raises ``ValueError`` when the hash differs.

        The record is ``NAME.verified.json`` beside the ``.bin`` (its size, mtime_ns and
        sha256), written atomically after a successful check; the record's own mtime is
        the time of the check. A record is trusted only when it was written at least
        :data:`RACY_NS` after the file's mtime: a file rewritten within the file
        system's timestamp resolution of the check keeps its mtime, and is hashed again
        (as git treats "racily clean" files). Where the folder is read-only no record is
        kept, and every open hashes.
        """
        st = os.stat(self.path)
        record = _record_path(self.path)
        want = {
            "format": RECORD_FORMAT,
            "file": self.path.name,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": self.meta.get("sha256"),
        }
        try:
            rec_mtime = record.stat().st_mtime_ns
            if (
                json.loads(record.read_text(encoding="utf-8")) == want
                and rec_mtime - st.st_mtime_ns >= RACY_NS
            ):
                return False
        except (OSError, ValueError):  # no record, or a damaged one: hash
            pass
        self._check_sha256()
        after = os.stat(self.path)
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            return True  # changed while it was read: no record
        try:
            write_json(record, want)
        except OSError:  # a read-only folder: check again next time
            pass
        return True


RECORD_FORMAT = "moelab-verified"
RECORD_SUFFIX = ".verified.json"
RACY_NS = 2_000_000_000
"""A verification record written less than this after the file's mtime (2 s, FAT's
timestamp resolution; others are finer) does not spare the next check its hash."""


def _record_path(bin_path: Path) -> Path:
    return bin_path.with_name(bin_path.stem + RECORD_SUFFIX)


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _max_id(tokens: np.ndarray, chunk: int = 1 << 22) -> int:
    """The largest id of ``tokens`` (-1 when empty), read ``chunk`` ids at a time."""
    top = -1
    for i in range(0, tokens.shape[0], chunk):
        top = max(top, int(tokens[i : i + chunk].max()))
    return top


def _check_inside(bin_path: Path, meta_path: Path) -> None:
    """A ``.bin`` is read where its metadata is, links resolved; a link out is allowed
    only into the folder of its metadata's own target (both files linked from the same
    folder), or into a ``moelab data prepare`` folder under the same name (the shards of
    a prepared folder linked into a run by :func:`moelab.data.link_prepared`)."""
    folder = meta_path.parent
    real = bin_path.resolve()
    if inside(real, folder) or inside(real, meta_path.resolve().parent):
        return
    if real.name == bin_path.name and (real.parent / MANIFEST).is_file():
        return
    raise ValueError(
        f"{bin_path} (named by {meta_path}) leads to {real}, outside {folder}: a shard is read "
        f"only from its own folder or the prepared folder it was linked from; {remedy(folder)}"
    )


def open_checked_shard(path: str | Path, tokenizer: Tokenizer) -> TokenShard:
    """The shard at ``path`` opened for training or evaluation, with every check:
    :meth:`TokenShard.open`'s (metadata, names, size, ids within the vocabulary),
    :meth:`TokenShard.check_against` ``tokenizer``, and the sha256 once per version of
    the file (:meth:`TokenShard.verify_hash_once`). Raises ``ValueError`` (one line
    naming the file and what to do) or ``FileNotFoundError``."""
    shard = TokenShard.open(path)
    shard.check_against(tokenizer)
    shard.verify_hash_once()
    return shard


# --------------------------------------------------------------------------- batches


def _epoch_windows(n_tokens: int, seq_len: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Start offsets of the disjoint (S + 1)-token windows of one epoch, in visit order.

    With ``shuffle`` the window grid is shifted by a random offset in [0, S] and the windows
    are permuted, both from ``(seed, epoch)`` only, so that every rank agrees on them.
    """
    span = seq_len + 1
    if not shuffle:
        return np.arange(n_tokens // span, dtype=np.int64) * span
    rng = np.random.default_rng([seed, epoch])
    offset = int(rng.integers(0, span))
    window_starts = offset + np.arange((n_tokens - offset) // span, dtype=np.int64) * span
    return window_starts[rng.permutation(window_starts.shape[0])]


def _too_few(
    shard: TokenShard, batch_size: int, seq_len: int, world_size: int, shuffle: bool
) -> str:
    """Why a shard gives no batch, and what to do, by what the shard is: a corpus given
    for evaluation (``--data``), a trained run's validation split, or the data a run is
    about to train on."""
    # NOTE: the windows of S + 1 tokens; a shuffled epoch starts at an offset of up to S
    need = world_size * batch_size * (seq_len + 1) + (seq_len if shuffle else 0)
    step = (
        f"one step of {world_size} rank(s) x {batch_size} sequences x {seq_len + 1} tokens "
        f"(at least {need:,} tokens)"
    )
    if shard.meta_path is None:  # tokenised in memory: a corpus to evaluate on
        return (
            f"the corpus {shard.path} has {len(shard):,} tokens, too few for {step}, the run's "
            "batch_size and seq_len: give a larger corpus (--data)"
        )
    run = shard.path.parent.parent if shard.path.parent.name == "data" else None
    if run is not None and (run / "checkpoints").is_dir():  # a trained run's split
        return (
            f"{shard.path} has {len(shard):,} tokens, too few for {step}, the batch_size and "
            "seq_len the run trained with: evaluate it on a larger corpus with --data (or, "
            "from Python, pass a smaller batch_size or seq_len)"
        )
    share = (
        ", give the validation split a larger share (--set val_fraction=F)"
        if shard.meta.get("split") == "val"
        else ""
    )
    return (
        f"{shard.path} has {len(shard):,} tokens, too few for {step}: lower batch_size or "
        f"seq_len (moelab train: --set batch_size=N, --set seq_len=N){share}, or use more data"
    )


def batches(
    shard: TokenShard,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    *,
    start_step: int = 0,
    shuffle: bool = True,
    epochs: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x_BS, y_BS)`` int64 batches; ``y_BS[:, t]`` is the token that follows
    ``x_BS[:, t]`` in the stream (the next-token target), so ``y_BS[:, :-1] == x_BS[:, 1:]``.

    Each epoch cuts the token stream into disjoint windows of S + 1 tokens (see
    :func:`_epoch_windows`); rank ``r`` of ``world_size`` takes windows ``r, r + world_size,
    ...`` of the epoch's order, so ranks read disjoint data, each the same number of steps.
    The batch at a given step depends only on (seed, rank, world_size, step); resume with
    ``start_step``. Infinite unless ``epochs`` is given; ``shuffle=False`` visits windows in
    file order (for evaluation: ``shuffle=False, epochs=1``).
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    n = len(shard)
    # The offset can shrink an epoch by one window; size steps for the smaller count.
    min_windows = max(n - seq_len, 0) // (seq_len + 1) if shuffle else n // (seq_len + 1)
    steps_per_epoch = min_windows // world_size // batch_size
    if steps_per_epoch == 0:
        raise ValueError(_too_few(shard, batch_size, seq_len, world_size, shuffle))
    per_rank = steps_per_epoch * batch_size
    arange_S1 = np.arange(seq_len + 1, dtype=np.int64)
    epoch, step = divmod(start_step, steps_per_epoch)
    while epochs is None or epoch < epochs:
        window_starts = _epoch_windows(n, seq_len, seed, epoch, shuffle)
        mine = window_starts[rank::world_size][:per_rank]
        for s in range(step, steps_per_epoch):
            starts_B = mine[s * batch_size : (s + 1) * batch_size]
            w_BS1 = torch.from_numpy(shard.tokens[starts_B[:, None] + arange_S1].astype(np.int64))
            yield w_BS1[:, :-1], w_BS1[:, 1:]
        epoch, step = epoch + 1, 0


# ------------------------------------------------------------------------- entropy


def unigram_entropy(shard: TokenShard, *, chunk: int = 1 << 24) -> float:
    """Entropy of the shard's token frequencies, in nats per token: H = -Σ_v p_v log p_v,
    p_v = count_v / N. The loss of a model that predicts every token from its frequency
    alone; a language model's validation loss should end well below it."""
    n = len(shard)
    if n == 0:
        raise ValueError(f"{shard.path} has no tokens")
    counts = np.zeros(max(shard.vocab_size, 1), dtype=np.int64)
    for i in range(0, n, chunk):
        part = np.bincount(shard.tokens[i : i + chunk], minlength=counts.shape[0])
        if part.shape[0] > counts.shape[0]:
            raise ValueError(f"{shard.path} holds token ids >= vocab_size {shard.vocab_size}")
        counts += part
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


# ------------------------------------------------------------------- corpus identity


def corpus_identity(tokenizer: str | Path, folder: str | Path) -> dict[str, Any]:
    """What names a prepared corpus: ``{"id", "split_seed", "val_fraction", "n_tokens",
    "sha256"}``. ``id`` is the first 16 hex digits of the sha256 over the tokenizer
    file's bytes and the recorded sha256 of ``folder``'s ``train.bin`` and ``val.bin``
    (so one tokenizer and one split, token for token); two runs with equal ids read the
    same data. ``sha256`` holds each part's own digest (``{"tokenizer.json", "train.bin",
    "val.bin"}``), so that a run folder can tell which file is not the one it trained on
    (:func:`moelab.runs.check_corpus`). Reads the tokenizer file and the shards'
    metadata only (a shard's hash is checked against its file where it is opened)."""
    data = Path(tokenizer).read_bytes()
    h = hashlib.sha256(data)
    out: dict[str, Any] = {"n_tokens": {}}
    files = {"tokenizer.json": hashlib.sha256(data).hexdigest()}
    for name in ("train", "val"):
        path = Path(folder) / f"{name}.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            digest = str(meta["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: no shard metadata with a sha256 ({err})") from None
        h.update(f"{name}:{digest}".encode())
        files[f"{name}.bin"] = digest
        out["n_tokens"][name] = meta.get("n_tokens")
        out.setdefault("split_seed", meta.get("split_seed"))
        out.setdefault("val_fraction", meta.get("val_fraction"))
    return {"id": h.hexdigest()[:16], **out, "sha256": files}
