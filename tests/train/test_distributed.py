"""Two-rank gloo data parallelism on CPU against one process on the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.train import latest_checkpoint, train
from moelab.train.distributed import all_reduce_mean, init_distributed

from . import free_port, make_corpus, rank_env, rank_exact_config, spawn_ranks

# LapSum routers with learned allocation over two MoE layers, thresholds calibrated
ALLOCATION = {
    "moe_layers": "all",
    "k_total": 3.0,
    "router": {"map": "lapsum", "selection": "threshold"},
}


def _config(corpus: Path, out: Path, allocation: bool):
    model = {**rank_exact_config(corpus, out).model, **(ALLOCATION if allocation else {})}
    return rank_exact_config(corpus, out, steps=3, eval_batches=1, model=model, calibrate_batches=2)


def _worker(rank: int, world: int, port: int, corpus: str, out: str, allocation: bool) -> None:
    rank_env(rank, world, port)
    summary = train(_config(Path(corpus), Path(out), allocation))
    Path(out).with_name(f"summary{rank}.json").write_text(json.dumps(summary))


def test_init_without_torchrun_is_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.enabled, info.is_main) == (0, 1, False, True)
    assert all_reduce_mean({"a": 1.5}, info) == {"a": 1.5}


@pytest.mark.multiprocess
@pytest.mark.parametrize("allocation", [False, True], ids=["topk", "lapsum-allocation"])
def test_two_rank_gloo_matches_single_process(tmp_path: Path, allocation: bool) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    single = train(_config(corpus, tmp_path / "single", allocation))
    spawn_ranks(_worker, (2, free_port(), str(corpus), str(tmp_path / "ddp" / "run"), allocation))
    ddp_rows = [json.loads(x) for x in (tmp_path / "ddp" / "run" / "metrics.jsonl").open()]
    one_rows = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").open()]
    if allocation:  # the same calibrated thresholds as one process
        calib_ddp, calib_one = ddp_rows.pop(0), one_rows.pop(0)
        assert calib_ddp["calibrated_thresholds"] == pytest.approx(
            calib_one["calibrated_thresholds"], rel=1e-6
        )
    assert [r["step"] for r in ddp_rows] == [1, 2, 3]
    for a, b in zip(ddp_rows, one_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        if allocation:
            assert a["k_layers"] == pytest.approx(b["k_layers"], abs=1e-6)
            assert a["active_layers"] == pytest.approx(b["active_layers"], abs=1e-6)
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
