"""SIGTERM to one rank of two (DDP and FSDP): every rank stops after the same step, one
checkpoint is written (gathered under FSDP), both ranks raise TrainingInterrupted, and
the resumed run ends bit-identical to one that never stopped."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.runs.checkpoints import list_checkpoints, verify_checkpoint
from moelab.train import TrainingInterrupted, latest_checkpoint, train

from . import free_port, logged_losses, make_corpus, rank_env, spawn_ranks, tiny_config

STEPS = 12


def _worker(rank: int, ports: list[int], corpus: str, root: str, parallel: str) -> None:
    from moelab.train import metrics

    rank_env(rank, 2, ports[0])
    c, r = Path(corpus), Path(root)
    (r / f"pid{rank}").write_text(str(os.getpid()))
    append = metrics.write_row
    # NOTE: rank 0 logs each step 50 ms late (rank 1 waits for it), so that the signal
    # surely lands mid-run
    metrics.write_row = lambda run, row: (append(run, row), time.sleep(0.05))
    cfg = tiny_config(c, r / "run", steps=STEPS, parallel=parallel)
    outcome: dict[str, object] = {"finished": True}
    try:
        train(cfg)
    except TrainingInterrupted as stop:
        outcome = {"step": stop.step, "code": stop.exit_code, "checkpoint": str(stop.checkpoint)}
    (r / f"outcome{rank}.json").write_text(json.dumps(outcome))
    metrics.write_row = append
    os.environ["MASTER_PORT"] = str(ports[1])
    train(cfg, resume=True)
    os.environ["MASTER_PORT"] = str(ports[2])
    train(tiny_config(c, r / "straight", steps=STEPS, parallel=parallel))


def _sigterm_rank1_after_3_steps(root: Path) -> None:
    deadline = time.monotonic() + 60
    metrics = root / "run" / "metrics.jsonl"
    while time.monotonic() < deadline:
        rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        if rows >= 3 and (root / "pid1").is_file():
            os.kill(int((root / "pid1").read_text()), signal.SIGTERM)
            return
        time.sleep(0.01)


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_both_with_one_checkpoint(tmp_path: Path, parallel: str) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    sender = threading.Thread(target=_sigterm_rank1_after_3_steps, args=(tmp_path,), daemon=True)
    sender.start()
    ports = [free_port() for _ in range(3)]
    spawn_ranks(_worker, (ports, str(corpus), str(tmp_path), parallel), timeout_s=150)
    sender.join(timeout=1)
    outcomes = [json.loads((tmp_path / f"outcome{r}.json").read_text()) for r in (0, 1)]
    # both ranks stopped after the same step, with SIGTERM's exit code
    assert outcomes[0] == outcomes[1], outcomes
    step = outcomes[0]["step"]
    assert outcomes[0]["code"] == 143 and 3 <= step < STEPS
    # one checkpoint of that step (none later), intact; the resumed run went on from it
    folders = [int(p.name[5:]) for p in list_checkpoints(tmp_path / "run")]
    assert step in folders and folders[-1] == STEPS and all(f in (step, STEPS) for f in folders)
    verify_checkpoint(outcomes[0]["checkpoint"])
    # bit-identical to the run that never stopped
    assert logged_losses(tmp_path / "run") == logged_losses(tmp_path / "straight")
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(latest_checkpoint(tmp_path / "straight") / name)  # type: ignore[operator]
        b = load_file(latest_checkpoint(tmp_path / "run") / name)  # type: ignore[operator]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
