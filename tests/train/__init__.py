"""Helpers shared by the training tests: a tiny generated corpus and a shrunken model."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from moelab.train import TrainConfig

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "finds", "reads", "builds", "carries", "follows"]
_OBJECTS = ["the book", "a red ball", "the river", "a new house", "the garden", "some bread"]
_ENDS = ["in the morning", "at night", "with care", "every day", "near the town", "again"]


def make_corpus(folder: Path, n_docs: int = 40, sentences: int = 10, seed: int = 0) -> Path:
    """``n_docs`` text files of short English-like sentences under ``folder``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        lines = [
            f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
            f"{rng.choice(_OBJECTS)} {rng.choice(_ENDS)}."
            for _ in range(sentences)
        ]
        (folder / f"doc{d:03d}.txt").write_text(" ".join(lines) + "\n", encoding="utf-8")
    return folder


TINY_MODEL: dict[str, Any] = dict(
    n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32, n_experts=4
)
"""ModelConfig overrides of the `tiny` preset that the training tests use."""


def tiny_config(corpus: Path, out: Path, **kw: Any) -> TrainConfig:
    """The `tiny` preset shrunk to 2 layers of width 32, vocabulary 300, 32 tokens."""
    base: dict[str, Any] = dict(
        preset="tiny",
        model=dict(TINY_MODEL),
        top_k=2,
        steps=8,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=2,
        eval_every=0,
        eval_batches=2,
        checkpoint_every=0,
        log_every=1,
        out=str(out),
        data=str(corpus),
        vocab_size=300,
        val_fraction=0.1,
        device="cpu",
        progress=False,
        threads=1,  # NOTE: one thread: the same float results whatever the machine's load
    )
    base.update(kw)
    return TrainConfig(**base)


def rank_env(rank: int, world: int, port: int) -> None:
    """Make this process rank ``rank`` of ``world`` gloo ranks on localhost, one thread."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
