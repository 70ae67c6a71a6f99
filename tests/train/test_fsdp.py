"""FSDP2 on two gloo ranks against one process: the same losses and weights, resumption
bit-identical to a run that never stopped, and checkpoints that move between modes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.data import Tokenizer
from moelab.model import Transformer
from moelab.train import TrainConfig, latest_checkpoint, load_checkpoint, train

from . import free_port, logged_losses, make_corpus, rank_env, rank_exact_config, spawn_ranks

STEPS, HALF = 20, 10


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == f"step_{STEPS:08d}"
    return load_file(ckpt / "model.safetensors")


def _optim(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    return load_file(ckpt / "optimizer.safetensors")


def _run(rank: int, port: int, config: TrainConfig, **kw: object) -> dict:
    os.environ["MASTER_PORT"] = str(port)  # NOTE: a fresh rendezvous for each run
    return train(config, **kw)


def _straight_and_resumed(rank: int, ports: list[int], corpus: str, root: str) -> None:
    rank_env(rank, 2, ports[0])
    c, r = Path(corpus), Path(root)
    _run(rank, ports[0], rank_exact_config(c, r / "straight", steps=STEPS, parallel="fsdp"))
    cfg = rank_exact_config(c, r / "resumed", steps=STEPS, parallel="fsdp")
    _run(rank, ports[1], cfg, stop_after=HALF)
    if rank == 0:  # the step-10 checkpoint of an FSDP run, for one process to resume
        shutil.copytree(r / "resumed", r / "fsdp_half")
    _run(rank, ports[2], cfg, resume=True)


def _resume_single_under_fsdp(rank: int, port: int, corpus: str, run: str) -> None:
    rank_env(rank, 2, port)
    train(rank_exact_config(Path(corpus), Path(run), steps=STEPS, parallel="fsdp"), resume=True)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.multiprocess
def test_fsdp_equals_one_process_and_resumes_bit_exactly(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    single = tmp_path / "single"
    train(rank_exact_config(corpus, single, steps=STEPS))
    ports = [free_port() for _ in range(3)]
    spawn_ranks(_straight_and_resumed, (ports, str(corpus), str(tmp_path)), timeout_s=150)
    # 20 steps under FSDP: the losses and the final weights of one process
    fsdp = tmp_path / "straight"
    losses, reference = logged_losses(fsdp), logged_losses(single)
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, abs=1e-5)
    _assert_close(_weights(fsdp), _weights(single))
    _assert_close(_optim(fsdp), _optim(single))
    # stopped at step 10 and resumed under FSDP: bit-identical to the straight run
    a, b = _weights(fsdp), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, b = _optim(fsdp), _optim(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged_losses(tmp_path / "resumed") == losses
    # the FSDP checkpoint of step 10 resumes in one process (and loads for eval/stats)
    half = tmp_path / "fsdp_half"
    ckpt = latest_checkpoint(half)
    assert ckpt is not None and ckpt.name == f"step_{HALF:08d}"
    vocab = Tokenizer.load(half / "tokenizer.json").vocab_size
    model = Transformer(TrainConfig.from_dict(load_checkpoint(ckpt)["config"]).model_config(vocab))
    load_checkpoint(ckpt, model, restore_rng=False)
    train(rank_exact_config(corpus, half, steps=STEPS), resume=True)
    _assert_close(_weights(half), _weights(single))
    assert logged_losses(half) == pytest.approx(reference, abs=1e-5)


@pytest.mark.multiprocess
def test_one_process_checkpoint_resumes_under_fsdp(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    single = tmp_path / "single"
    train(rank_exact_config(corpus, single, steps=STEPS))
    half = tmp_path / "half"
    train(rank_exact_config(corpus, half, steps=STEPS), stop_after=HALF)
    spawn_ranks(_resume_single_under_fsdp, (free_port(), str(corpus), str(half)), timeout_s=100)
    _assert_close(_weights(half), _weights(single))
    _assert_close(_optim(half), _optim(single))
    assert logged_losses(half) == pytest.approx(logged_losses(single), abs=1e-5)
