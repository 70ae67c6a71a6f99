"""Loss-free bias balancing under two gloo ranks: the bias follows the load of the whole
global batch, as in one process on the same batch (not rank 0's share alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moelab.routing import balancing
from moelab.train import latest_checkpoint, train

from . import free_port, make_corpus, rank_env, rank_exact_config, spawn_ranks

STEPS = 10
RATE = 0.01


def _config(corpus: Path, out: Path):
    model = {**rank_exact_config(corpus, out).model, "router": {"bias_rate": RATE}}
    return rank_exact_config(corpus, out, steps=STEPS, eval_batches=1, model=model, threads=1)


def _train_worker(rank: int, world: int, port: int, corpus: str, out: str) -> None:
    rank_env(rank, world, port)
    train(_config(Path(corpus), Path(out)))


def _biases(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    weights = load_file(ckpt / "model.safetensors")
    return {k: v for k, v in weights.items() if k.endswith("router.bias")}


@pytest.mark.multiprocess
def test_bias_follows_the_global_load(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    train(_config(corpus, tmp_path / "single"))
    run = tmp_path / "ddp" / "run"
    spawn_ranks(_train_worker, (2, free_port(), str(corpus), str(run)))
    one, two = _biases(tmp_path / "single"), _biases(run)
    assert one and one.keys() == two.keys()
    for key in one:
        assert one[key].abs().max() > 0  # the bias did move
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=0)
    rows_one = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").open()]
    rows_two = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows_two] == list(range(1, STEPS + 1))
    for a, b in zip(rows_two, rows_one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def _sum_worker(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    try:
        local_E = torch.tensor([float(rank + 1), 0.0, 2.0 * rank])
        Path(out).with_name(f"sum{rank}.json").write_text(
            json.dumps(balancing.global_load(local_E).tolist())
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_global_load_sums_over_ranks(tmp_path: Path) -> None:
    spawn_ranks(_sum_worker, (2, free_port(), str(tmp_path / "x")))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"sum{rank}.json").read_text()) == [3.0, 0.0, 2.0]


def test_global_load_is_identity_in_one_process() -> None:
    load_E = torch.tensor([1.0, 5.0])
    assert not dist.is_initialized()
    assert balancing.global_load(load_E) is load_E
