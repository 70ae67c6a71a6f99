"""ReLU routing's adaptive L1 under two gloo ranks: lambda moves by the sparsity of the
whole global batch, so every rank moves it alike and as one process on that batch would
(not by a rank's own share)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moelab.routing import Router, RouterConfig
from moelab.routing.router import step_routers
from moelab.train import train

from . import TINY_MODEL, free_port, make_corpus, rank_env, rank_exact_config, spawn_ranks

WORLD = 2
TIMEOUT_S = 120
STEPS = 8


def _step(rank: int, out: Path) -> None:
    """One router step on this rank's share of a hand-made batch."""
    cfg = RouterConfig(
        d_model=4, n_experts=4, map="relu", selection="threshold", l1_target=2, aux_weight=0.0
    )
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    # rank 0: 3 of 4 experts per token (too dense alone); rank 1: none (too sparse)
    x = torch.tensor([[1.0, 2.0, 3.0, -1.0]] * 4) if rank == 0 else -torch.ones(4, 4)
    step_routers([router], [router(x)])
    (out / f"rank{rank}.json").write_text(
        json.dumps([float(router.l1_coef), float(router.l1_sparsity)])
    )


def _config(corpus: Path, out: Path):
    router = {"map": "relu", "selection": "threshold", "l1_target": 2}
    model = dict(TINY_MODEL, router=router)
    return rank_exact_config(corpus, out, steps=STEPS, eval_batches=1, model=model, lr=3e-3)


def _worker(rank: int, ports: tuple[int, int], corpus: str, out: str) -> None:
    # NOTE: one spawn for both checks (starting the ranks is most of the cost)
    rank_env(rank, WORLD, ports[0])
    dist.init_process_group("gloo")
    try:
        _step(rank, Path(out).parent)
    finally:
        dist.destroy_process_group()
    rank_env(rank, WORLD, ports[1])
    train(_config(Path(corpus), Path(out)))


def _rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.multiprocess
def test_every_rank_moves_lambda_by_the_global_sparsity(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus", n_docs=8)
    run = tmp_path / "ddp" / "run"
    run.parent.mkdir()
    spawn_ranks(_worker, ((free_port(), free_port()), str(corpus), str(run)))
    # one router step: together 12 of 32 gates active, sparsity 0.625 > target 0.5, so
    # lambda / 1.2 on both ranks (rank 0 alone would raise it)
    for rank in range(WORLD):
        coef, sparsity = json.loads((run.parent / f"rank{rank}.json").read_text())
        assert coef == pytest.approx(1e-8 / 1.2)
        assert sparsity == pytest.approx(0.625)
    # training: the same lambda and sparsity as one process on the same global batches
    train(_config(corpus, tmp_path / "single"))
    one, two = _rows(tmp_path / "single"), _rows(run)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert len({r["l1_coef"] for r in one}) > 1  # lambda moved
    for a, b in zip(one, two, strict=True):
        # the sparsity of the global batch, not of rank 0's half
        assert b["l1_sparsity"] == pytest.approx(a["l1_sparsity"], abs=1e-9)
        assert b["l1_coef"] == pytest.approx(a["l1_coef"], rel=1e-6)
