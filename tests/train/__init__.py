"""Helpers shared by the training tests: a tiny generated corpus and a shrunken model."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from moelab.train import TrainConfig, train

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


RANK_EXACT: dict[str, Any] = {"aux_weight": 0.0}
"""Router keys of the tests that compare N ranks with one process: the default Switch
loss counts each rank's own tokens (``aux_scope="micro_batch"``), so N ranks equal one
process only without it (``aux_scope="global"`` is compared in test_distributed_aux_scope)."""


def rank_exact_config(corpus: Path, out: Path, **kw: Any) -> TrainConfig:
    """:func:`tiny_config` with :data:`RANK_EXACT` merged into the model's router."""
    model = dict(kw.pop("model", TINY_MODEL))
    model["router"] = {**model.get("router", {}), **RANK_EXACT}
    return tiny_config(corpus, out, model=model, **kw)


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


def logged_losses(run: Path) -> list[float]:
    """The training loss of every logged step of a run (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def train_learns(corpus: Path, run: Path, steps: int = 50, **kw: Any) -> dict[str, Any]:
    """Train :func:`tiny_config` with ``kw`` for ``steps`` steps, check that every step
    logged a finite loss and that the mean of the last three fell more than 0.5 nats
    below the mean of the first three, and return the summary."""
    summary = train(tiny_config(corpus, run, steps=steps, **kw))
    assert math.isfinite(summary["train_loss"])
    losses = logged_losses(run)
    assert len(losses) == steps
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, (first, last)
    return summary


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on localhost that is free now (for a process group's rendezvous), below
    Linux's ephemeral range (32768-60999): a port the kernel hands out for binding to
    port 0 is also one it hands to outgoing connections, so a test that chose several
    ports up front could find one taken by a connection of its own earlier runs
    (EADDRINUSE, seen in CI). Never the same port twice in one process."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port in 20000-32767 on localhost")


def spawn_ranks(fn: Any, args: tuple, world: int = 2, timeout_s: float = 120) -> None:
    """``fn(rank, *args)`` in ``world`` processes; every rank is stopped and TimeoutError
    raised if they have not all finished within ``timeout_s`` (a hung collective must
    not hang the test suite)."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            raise TimeoutError(f"the {world} ranks did not finish in {timeout_s} s")
