from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from moelab.data.shards import (
    TokenShard,
    batches,
    split_documents,
    token_dtype,
    unigram_entropy,
    write_shard,
    write_shards,
)
from moelab.data.tokenizer import Tokenizer, train_tokenizer


def _docs(n: int = 60) -> list[str]:
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "router", "expert", "é", "🙂"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(_docs(), vocab_size=300)


def _raw_shard(path: Path, tokens: list[int], vocab_size: int = 50) -> TokenShard:
    """A shard with exactly the given ids (bypassing the tokenizer)."""
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    meta = {
        "format": "moelab-tokens",
        "version": 1,
        "file": path.name,
        "dtype": "uint16",
        "n_tokens": len(tokens),
        "vocab_size": vocab_size,
        "eos_id": 0,
        "sha256": "",
    }
    path.with_suffix(".json").write_text(json.dumps(meta))
    return TokenShard.open(path)


def test_write_read_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    docs = _docs(10)
    shard = write_shard(tmp_path / "s.bin", docs, tok, source="unit")
    expected = [i for d in docs for i in [*tok.encode(d), tok.eos_id]]
    again = TokenShard.open(tmp_path / "s.json", verify_hash=True)
    assert again.tokens.dtype == np.uint16 and again.tokens.tolist() == expected
    assert shard.tokens.tolist() == expected
    assert again.meta["n_documents"] == 10 and again.meta["source"] == "unit"
    assert again.vocab_size == tok.vocab_size and len(again) == len(expected)
    pieces = tok.decode(again.tokens.tolist()).split("<|endoftext|>")
    assert pieces == [*docs, ""]
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_truncated_or_mismatched_file_is_refused(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, _docs(5), tok)
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    with pytest.raises(ValueError, match="truncated"):
        TokenShard.open(path)
    path.write_bytes(data)
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    with pytest.raises(ValueError, match="truncated"):
        TokenShard.open(path)
    path.with_suffix(".json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ValueError, match="dtype"):
        TokenShard.open(path)
    path.with_suffix(".json").write_text(json.dumps(meta))
    other = (tok.eos_id + 1) % tok.vocab_size  # the last id is eos: another valid id
    path.write_bytes(data[:-2] + other.to_bytes(2, "little"))
    TokenShard.open(path)  # same size, ids in the vocabulary: only the hash can tell
    with pytest.raises(ValueError, match="sha256"):
        TokenShard.open(path, verify_hash=True)


def test_split_is_deterministic_and_disjoint() -> None:
    train, val = split_documents(1000, 0.1, seed=3)
    assert (train, val) == split_documents(1000, 0.1, seed=3)
    assert sorted(train + val) == list(range(1000)) and not set(train) & set(val)
    assert 60 < len(val) < 140
    assert split_documents(1000, 0.1, seed=4)[1] != val
    # Appending documents does not move the earlier ones.
    assert [i for i in split_documents(1200, 0.1, seed=3)[1] if i < 1000] == val
    assert all(len(part) == 1 for part in split_documents(2, 0.01))


def test_write_shards_split(tok: Tokenizer, tmp_path: Path) -> None:
    docs = _docs(40)
    shards = write_shards(docs, tok, tmp_path, val_fraction=0.2, seed=7)
    train_ids, val_ids = split_documents(40, 0.2, seed=7)
    assert shards["val"].meta["n_documents"] == len(val_ids)
    assert shards["train"].meta["split"] == "train"
    for name, ids in (("train", train_ids), ("val", val_ids)):
        text = tok.decode(shards[name].tokens.tolist()).split("<|endoftext|>")[:-1]
        assert text == [docs[i] for i in ids]


def test_batches_shapes_and_next_token(tmp_path: Path) -> None:
    shard = _raw_shard(tmp_path / "r.bin", [i % 50 for i in range(1000)])
    it = batches(shard, batch_size=4, seq_len=16, seed=0)
    for _ in range(30):  # crosses epoch boundaries
        x, y = next(it)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, (x + 1) % 50)  # the stream is 0,1,...,49,0,...
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_ranks_disjoint_and_deterministic(tmp_path: Path) -> None:
    shard = _raw_shard(tmp_path / "r.bin", list(range(2000)), vocab_size=2000)
    steps = 2000 // 11 // 3 // 5  # steps per epoch: 12 tokens per window, 3 ranks, B=5

    def windows(rank: int, start: int = 0) -> list[tuple[int, ...]]:
        it = batches(shard, 5, 10, seed=1, rank=rank, world_size=3, start_step=start)
        return [tuple(row.tolist()) for _ in range(steps - start) for row in next(it)[0]]

    per_rank = [windows(r) for r in range(3)]
    seen = [t for w in per_rank for row in w for t in row]
    assert len(seen) == len(set(seen))  # no token read twice in an epoch, across ranks
    assert windows(1) == per_rank[1]
    assert windows(1, start=2) == per_rank[1][2 * 5 :]  # resuming at a step
    other_seed = next(batches(shard, 5, 10, seed=2, rank=1, world_size=3))[0]
    assert not torch.equal(other_seed, torch.tensor(per_rank[1][:5]))
    evaluation = list(batches(shard, 5, 10, shuffle=False, epochs=1))
    assert len(evaluation) == 2000 // 11 // 5 and evaluation[0][0][0, 0] == 0
    with pytest.raises(ValueError, match="too few"):
        next(batches(shard, 100, 100, world_size=2))


def test_unigram_entropy_hand_example(tmp_path: Path) -> None:
    shard = _raw_shard(tmp_path / "h.bin", [0, 0, 1, 2])
    assert unigram_entropy(shard) == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    uniform = _raw_shard(tmp_path / "u.bin", list(range(8)) * 3)
    assert unigram_entropy(uniform, chunk=5) == pytest.approx(math.log(8))
