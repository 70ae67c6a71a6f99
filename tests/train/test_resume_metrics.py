"""A run stopped and resumed logs what the run without the stop logs: every field of
every row of metrics.jsonl, but the ones that measure wall-clock time (:data:`CLOCK`).

The stops: SIGINT in the middle of a logging window (a checkpoint of a step that is not
logged), a kill after a checkpoint written in the middle of a window (the newer
checkpoint lost), and a kill in the middle of the append of the last row (its line cut
in half, its checkpoint written)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from moelab.model import Transformer
from moelab.runs.checkpoints import list_checkpoints
from moelab.runs.metrics import read_rows
from moelab.train import TrainConfig, TrainingInterrupted, loop, train
from moelab.train import health as H

from . import free_port, make_corpus, rank_env, rank_exact_config, spawn_ranks, tiny_config

STEPS, LOG_EVERY, EVAL_EVERY = 16, 4, 8

CLOCK = ("time", "elapsed_s", "tokens_per_s", "tokens_per_s_avg")
"""The fields that may differ: ``time`` and ``elapsed_s`` are the wall clock, and the
token rates are tokens over wall-clock seconds (a resumed part times its first window
from its own start); two runs without a stop differ in them too."""

PLANTED = 3
"""The expert that the selection bias shuts out in every MoE layer: a dead expert from
the first step, so that the rows carry dead-expert warnings."""


class _WithADeadExpert(Transformer):
    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        with torch.no_grad():
            for layer in self.moe_layers:
                layer.router.bias[PLANTED] = -1e9


@pytest.fixture(autouse=True)
def _planted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "Transformer", _WithADeadExpert)
    monkeypatch.setattr(H, "DEAD_STEPS", 6, raising=False)  # warnings within 16 steps


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=16)


def _config(corpus: Path, run: Path, **kw: Any) -> TrainConfig:
    kw = {"eval_every": EVAL_EVERY, "log_every": LOG_EVERY, "dead_fraction": 0.2, **kw}
    return tiny_config(corpus, run, steps=STEPS, **kw)


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "Transformer", _WithADeadExpert)
        mp.setattr(H, "DEAD_STEPS", 6, raising=False)
        run = tmp_path_factory.mktemp("straight") / "run"
        train(_config(corpus, run))
    rows = read_rows(run / "metrics.jsonl")
    assert any(r.get("warnings") for r in rows)  # the comparison covers the warnings
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    return rows


def _same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert set(a) == set(b), a["step"]
        for key in a:
            if key not in CLOCK:
                assert a[key] == b[key], (a["step"], key)


def test_a_stop_in_the_middle_of_a_window(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight: list
) -> None:
    """SIGINT during step 6: a checkpoint of step 6, in the window of steps 5-8."""
    lr_at = loop.lr_at

    def signalled(step: int, config: Any) -> float:
        if step == 5:  # the 0-based step: the stop comes after step 6
            os.kill(os.getpid(), signal.SIGINT)
        return lr_at(step, config)

    run = tmp_path / "run"
    monkeypatch.setattr(loop, "lr_at", signalled)
    with pytest.raises(TrainingInterrupted) as stop:
        train(_config(corpus, run))
    assert stop.value.step == 6
    monkeypatch.setattr(loop, "lr_at", lr_at)
    train(_config(corpus, run), resume=True)
    _same_rows(read_rows(run / "metrics.jsonl"), straight)


def test_a_kill_after_a_checkpoint_in_the_middle_of_a_window(
    corpus: Path, tmp_path: Path, straight: list
) -> None:
    """Checkpoints every 3 steps, killed after step 8: the resumed run continues from
    the checkpoint of step 6 and logs steps 7-8 again."""
    run = tmp_path / "run"
    train(_config(corpus, run, checkpoint_every=3), stop_after=8)
    for folder in list_checkpoints(run):
        if folder.name.endswith("08"):  # the kill: its checkpoint was never written
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    assert [int(p.name[5:]) for p in list_checkpoints(run)] == [6]
    train(_config(corpus, run, checkpoint_every=3), resume=True)
    _same_rows(read_rows(run / "metrics.jsonl"), straight)


def test_a_last_row_cut_in_half_is_written_again(
    corpus: Path, tmp_path: Path, straight: list, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint of step 8 is written, the line of its row cut in half (what a disk
    keeps of an append that was never synced): the resumed run writes that row."""
    run = tmp_path / "run"
    train(_config(corpus, run), stop_after=8)
    path = run / "metrics.jsonl"
    data = path.read_bytes()
    head, last = data[:-1].rsplit(b"\n", 1)
    assert b'"step": 8' in last or b'"step":8' in last
    path.write_bytes(head + b"\n" + last[: len(last) // 2])
    train(_config(corpus, run), resume=True)
    _same_rows(read_rows(path), straight)
    err = capsys.readouterr().err
    assert "ends in a cut-off line" in err and "row of step 8 was missing" in err


def _ranks_config(corpus: str, run: Path) -> TrainConfig:
    kw = {"eval_every": EVAL_EVERY, "log_every": LOG_EVERY, "dead_fraction": 0.2}
    return rank_exact_config(Path(corpus), run, steps=STEPS, checkpoint_every=3, **kw)


def _straight_and_killed(rank: int, ports: list[int], corpus: str, root: str) -> None:
    rank_env(rank, 2, ports[0])
    train(_ranks_config(corpus, Path(root) / "straight"))
    os.environ["MASTER_PORT"] = str(ports[1])  # NOTE: a fresh rendezvous for each run
    train(_ranks_config(corpus, Path(root) / "killed"), stop_after=8)


def _resumed(rank: int, port: int, corpus: str, root: str) -> None:
    rank_env(rank, 2, port)
    train(_ranks_config(corpus, Path(root) / "killed"), resume=True)


@pytest.mark.multiprocess
def test_two_ranks_resume_the_window_of_both(tmp_path: Path) -> None:
    """Two gloo ranks: the window a checkpoint keeps is the sum of both ranks' counts
    (rank 0 takes it back, the other starts from zeros), so the resumed rows equal the
    straight run's."""
    corpus = str(make_corpus(tmp_path / "corpus", n_docs=16))
    ports = [free_port() for _ in range(3)]
    spawn_ranks(_straight_and_killed, (ports[:2], corpus, str(tmp_path)), timeout_s=150)
    run = tmp_path / "killed"
    for folder in list_checkpoints(run):
        if folder.name.endswith("08"):
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    spawn_ranks(_resumed, (ports[2], corpus, str(tmp_path)), timeout_s=150)
    _same_rows(read_rows(run / "metrics.jsonl"), read_rows(tmp_path / "straight" / "metrics.jsonl"))
