"""Training under expert parallelism (``parallel="fsdp", ep=2``) on gloo ranks against
one process on the same global batch: losses per step, the routing numbers, the final
weights and optimiser state; resumption bit-identical to a run that never stopped; a
capacity factor counted over the EP group; EP = 2 x FSDP = 2 on four ranks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moelab.train import latest_checkpoint, train

from . import (
    TINY_MODEL,
    free_port,
    logged_losses,
    make_corpus,
    rank_env,
    rank_exact_config,
    spawn_ranks,
)

STEPS, HALF = 20, 10
PER_TOKEN = ("active_experts", "contributors", "discarded_mass", "singleton_rate")
"""Logged routing numbers that are means over tokens: the mean of the ranks' equals one
process's (load_cv is a per-rank imbalance, averaged over the ranks as under DDP)."""

E8_CAPACITY = {**TINY_MODEL, "n_experts": 8, "router": {"capacity_factor": 0.5}}


def _clip_for_dtensors() -> None:
    # NOTE: the loop clips with torch.nn.utils.clip_grad_norm_, which refuses the mix of
    # meshes of EP under FSDP (experts on "ep", the rest on the world's);
    # moelab.moe.expert_parallel.clip_grad_norm_ takes it (and is torch's in one process)
    from moelab.moe import expert_parallel

    torch.nn.utils.clip_grad_norm_ = expert_parallel.clip_grad_norm_


def _run(port: int, config: Any, **kw: Any) -> None:
    os.environ["MASTER_PORT"] = str(port)  # NOTE: a fresh rendezvous for each run
    train(config, **kw)


def _ep2_runs(rank: int, ports: list[int], corpus: str, root: str) -> None:
    rank_env(rank, 2, ports[0])
    _clip_for_dtensors()
    c, r = Path(corpus), Path(root)
    ep = dict(steps=STEPS, parallel="fsdp", ep=2)
    _run(ports[0], rank_exact_config(c, r / "ep", **ep))
    cfg = rank_exact_config(c, r / "ep_resumed", **ep)
    _run(ports[1], cfg, stop_after=HALF)
    if rank == 0:  # the step-10 checkpoint of an EP run, for one process to resume
        shutil.copytree(r / "ep_resumed", r / "ep_half")
    _run(ports[2], cfg, resume=True)
    _run(ports[3], rank_exact_config(c, r / "ep_e8_capacity", model=E8_CAPACITY, **ep))
    # a one-process checkpoint of step 10, resumed under EP
    _run(ports[4], rank_exact_config(c, r / "single_half", **ep), resume=True)


def _dp2_ep2_run(rank: int, port: int, corpus: str, root: str) -> None:
    rank_env(rank, 4, port)
    _clip_for_dtensors()
    cfg = rank_exact_config(
        Path(corpus), Path(root) / "dp2_ep2", steps=STEPS, parallel="fsdp", ep=2
    )
    train(cfg)


def _rank_major(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make one process train on each global batch in the order of the ranks'
    concatenated micro-batches: rank r of ``world`` reads the windows r, r + world, ...
    of a step (moelab.data.batches), so the group's batch is windows 0, 2, 1, 3 for
    world 2 and 4 sequences. Only a capacity limit sees the order (its priority is
    token order)."""
    from moelab.train import calibration, loop, validation

    original = loop.batches

    def reordered(*args: Any, **kw: Any) -> Any:
        for x_BS, y_BS in original(*args, **kw):
            order = torch.cat([torch.arange(r, x_BS.shape[0], world) for r in range(world)])
            yield x_BS[order], y_BS[order]

    for module in (loop, calibration, validation):  # every reader of the batches
        monkeypatch.setattr(module, "batches", reordered)


def _final(run: Path, name: str) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == f"step_{STEPS:08d}"
    return load_file(ckpt / name)


def _rows(run: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_like_one_process(run: Path, single: Path) -> None:
    assert logged_losses(run) == pytest.approx(logged_losses(single), abs=1e-5)
    for a, b in zip(_rows(run), _rows(single), strict=True):
        for key in PER_TOKEN:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for name in ("model.safetensors", "optimizer.safetensors"):
        got, want = _final(run, name), _final(single, name)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.multiprocess
def test_ep2_equals_one_process_and_resumes_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    train(rank_exact_config(corpus, tmp_path / "single", steps=STEPS))
    with monkeypatch.context() as m:
        _rank_major(2, m)
        train(
            rank_exact_config(
                corpus, tmp_path / "single_e8_capacity", steps=STEPS, model=E8_CAPACITY
            )
        )
    train(rank_exact_config(corpus, tmp_path / "single_half", steps=STEPS), stop_after=HALF)
    ports = [free_port() for _ in range(5)]
    spawn_ranks(_ep2_runs, (ports, str(corpus), str(tmp_path)), timeout_s=150)
    # E = 4: losses, routing numbers, final weights and AdamW state of one process
    _assert_like_one_process(tmp_path / "ep", tmp_path / "single")
    # E = 8 with a capacity factor: the group drops what one process drops on the
    # group's concatenated batch (rank 0's sequences, then rank 1's)
    _assert_like_one_process(tmp_path / "ep_e8_capacity", tmp_path / "single_e8_capacity")
    # stopped at step 10 and resumed under EP: bit-identical to the straight EP run
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = _final(tmp_path / "ep", name), _final(tmp_path / "ep_resumed", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged_losses(tmp_path / "ep_resumed") == logged_losses(tmp_path / "ep")
    # checkpoints move between modes: one process's under EP, EP's in one process
    _assert_like_one_process(tmp_path / "single_half", tmp_path / "single")
    train(rank_exact_config(corpus, tmp_path / "ep_half", steps=STEPS), resume=True)
    _assert_like_one_process(tmp_path / "ep_half", tmp_path / "single")


@pytest.mark.multiprocess
def test_ep2_by_fsdp2_on_four_ranks_equals_one_process(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    train(rank_exact_config(corpus, tmp_path / "single", steps=STEPS))
    spawn_ranks(_dp2_ep2_run, (free_port(), str(corpus), str(tmp_path)), world=4, timeout_s=150)
    _assert_like_one_process(tmp_path / "dp2_ep2", tmp_path / "single")
