"""Two-rank gloo data parallelism on CPU against one process on the same global batch."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from moelab.train import latest_checkpoint, train
from moelab.train.distributed import all_reduce_mean, init_distributed

from . import make_corpus, tiny_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, corpus: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    summary = train(tiny_config(Path(corpus), Path(out), steps=3, eval_batches=1))
    Path(out).with_name(f"summary{rank}.json").write_text(json.dumps(summary))


def test_init_without_torchrun_is_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.enabled, info.is_main) == (0, 1, False, True)
    assert all_reduce_mean({"a": 1.5}, info) == {"a": 1.5}


def test_two_rank_gloo_matches_single_process(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    single = train(tiny_config(corpus, tmp_path / "single", steps=3, eval_batches=1))
    mp.spawn(
        _worker,
        args=(2, _free_port(), str(corpus), str(tmp_path / "ddp" / "run")),
        nprocs=2,
        join=True,
    )
    ddp_rows = [json.loads(x) for x in (tmp_path / "ddp" / "run" / "metrics.jsonl").open()]
    one_rows = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").open()]
    assert [r["step"] for r in ddp_rows] == [1, 2, 3]
    for a, b in zip(ddp_rows, one_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    s0 = json.loads((tmp_path / "ddp" / "summary0.json").read_text())
    s1 = json.loads((tmp_path / "ddp" / "summary1.json").read_text())
    assert s0["world_size"] == 2 and s0["train_loss"] == s1["train_loss"]
    assert s0["train_loss"] == pytest.approx(single["train_loss"], abs=1e-5)
    # only rank 0 wrote a checkpoint; its weights match the single-process run
    ckpt_ddp, ckpt_one = (
        latest_checkpoint(tmp_path / "ddp" / "run"),
        latest_checkpoint(tmp_path / "single"),
    )
    assert ckpt_ddp is not None and ckpt_one is not None
    w_ddp, w_one = (
        load_file(ckpt_ddp / "model.safetensors"),
        load_file(ckpt_one / "model.safetensors"),
    )
    for key in w_one:
        torch.testing.assert_close(w_ddp[key], w_one[key], atol=1e-5, rtol=1e-4)
