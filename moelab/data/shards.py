"""Token shards: a corpus tokenised into one flat memory-mapped file, and batches from it.

A shard is two files: ``NAME.bin``, the token ids of all its documents one after the
other, each document followed by the end-of-document token, as raw little-endian
``uint16`` (``uint32`` when the vocabulary has 65536 ids or more); and ``NAME.json``, its
metadata (dtype, number of tokens and documents, vocabulary size, source, sha256 of the
``.bin``). :meth:`TokenShard.open` memory-maps the ``.bin`` after checking it against the
metadata, so a truncated or foreign file fails loudly instead of training on garbage.

    shards = write_shards(docs, tok, run / "data", val_fraction=0.05, seed=0)
    train = TokenShard.open(run / "data" / "train.bin")
    for step, (x_BS, y_BS) in zip(range(n_steps), batches(train, 8, 256, seed=0)):
        ...

Legend: B batch size, S sequence length, W number of windows of S + 1 tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.data.tokenizer import Tokenizer

FORMAT = "moelab-tokens"
VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_ENCODE_CHUNK = 256  # documents per encode_batch call

__all__ = [
    "ShardWriter",
    "TokenShard",
    "batches",
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


def _unit_hash(seed: int, index: int) -> float:
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
    u = [_unit_hash(seed, i) for i in range(n_documents)]
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
        self._file.write(data)
        self._sha.update(data)
        self.n_tokens += len(data) // self.dtype.itemsize
        self.n_documents += n_documents

    def finish(self) -> TokenShard:
        """Close the file, write the metadata, rename both into place; the opened shard."""
        self._file.close()
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
        self._meta_tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.replace(self._tmp, self.path)
        os.replace(self._meta_tmp, _meta_path(self.path))
        self.shard = TokenShard.open(self.path)
        return self.shard

    def abort(self) -> None:
        """Close and delete the temporaries (the shard in place, if any, is untouched)."""
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

        Raises ``ValueError`` when the metadata is not a moelab token shard, names an
        unknown dtype or one too small for its vocabulary, or when the file size is not
        ``n_tokens * itemsize`` (truncated or foreign file); with ``verify_hash`` also
        when the sha256 differs (reads the whole file).
        """
        path = Path(path)
        meta_path = path if path.suffix == ".json" else _meta_path(path)
        if not meta_path.is_file():
            raise FileNotFoundError(f"no shard metadata {meta_path}; write it with write_shard")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path} is not valid JSON: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} is not a {FORMAT} metadata file")
        bin_path = meta_path.with_name(meta.get("file", meta_path.with_suffix(".bin").name))
        dtype_name = meta.get("dtype")
        if dtype_name not in _DTYPES:
            raise ValueError(f"{meta_path}: dtype {dtype_name!r} is not one of {list(_DTYPES)}")
        dtype = _DTYPES[dtype_name]
        vocab, n_tokens = int(meta["vocab_size"]), int(meta["n_tokens"])
        if vocab > np.iinfo(dtype).max + 1:
            raise ValueError(f"{meta_path}: vocab_size {vocab} does not fit in {dtype_name}")
        if not bin_path.is_file():
            raise FileNotFoundError(f"{bin_path} (named by {meta_path}) does not exist")
        size, expected = bin_path.stat().st_size, n_tokens * dtype.itemsize
        if size != expected:
            raise ValueError(
                f"{bin_path} has {size} bytes but its metadata says {n_tokens} tokens of "
                f"{dtype_name} = {expected} bytes: the file is truncated or does not belong "
                f"to {meta_path.name}; write the shard again"
            )
        if n_tokens == 0:
            tokens: np.ndarray = np.empty(0, dtype=dtype)
        else:
            tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
        if verify_hash:
            digest = hashlib.sha256(bin_path.read_bytes()).hexdigest()
            if digest != meta.get("sha256"):
                raise ValueError(f"{bin_path}: sha256 {digest} differs from its metadata")
        return cls(path=bin_path, tokens=tokens, meta=meta)


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
    starts_W = offset + np.arange((n_tokens - offset) // span, dtype=np.int64) * span
    return starts_W[rng.permutation(starts_W.shape[0])]


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
        raise ValueError(
            f"{shard.path.name} has {n} tokens, too few for one step of {world_size} rank(s) x "
            f"{batch_size} sequences x {seq_len + 1} tokens; lower batch_size or seq_len, "
            f"or use more data"
        )
    per_rank = steps_per_epoch * batch_size
    arange_S1 = np.arange(seq_len + 1, dtype=np.int64)
    epoch, step = divmod(start_step, steps_per_epoch)
    while epochs is None or epoch < epochs:
        starts_W = _epoch_windows(n, seq_len, seed, epoch, shuffle)
        mine = starts_W[rank::world_size][:per_rank]
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
