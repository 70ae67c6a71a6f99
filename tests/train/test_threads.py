"""The thread count: the free-core default, --threads on every computing command, the
warning when the threads outnumber the free cores, and resuming with another count."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moelab.cli import build_parser, main
from moelab.train import threads as T
from moelab.train import train

from . import make_corpus, tiny_config


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """A fake machine: ``set(cores, load, quota)`` fixes the affinity mask's size, the
    1-minute load average and the cgroup quota (None: none)."""

    def set_(cores: int, load: float, quota: float | None = None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(T, "_cgroup_quota", lambda: quota)

    old = torch.get_num_threads()
    yield set_
    torch.set_num_threads(old)


@pytest.mark.parametrize(
    ("cores", "load", "quota", "share", "expected"),
    [
        (2, 0.2, None, 1, 2),  # idle: every core
        (2, 1.1, None, 1, 1),  # a second training beside us: one core left
        (2, 5.5, None, 1, 1),  # overloaded: never below 1
        (8, 2.6, None, 1, 5),  # 3 busy cores (rounded)
        (8, 2.6, None, 2, 2),  # 5 free cores shared by two ranks
        (64, 0.0, 4.0, 1, 4),  # a container's quota of 4 cores on a 64-core host
        (64, 0.0, 2.5, 1, 2),  # a fractional quota: whole cores only
    ],
)
def test_default_threads_are_the_free_cores(
    machine, cores: int, load: float, quota: float | None, share: int, expected: int
) -> None:
    machine(cores, load, quota)
    assert T.default_threads(share) == expected
    assert T.use_threads(None, share) == expected == torch.get_num_threads()


def test_oversubscribed_counts_out_our_own_threads(machine) -> None:
    machine(2, 2.0)
    # before work: 2 busy cores of others, 1 left (never 0) for 2 threads
    assert T.oversubscribed(2) == 1
    # after minutes of work our 2 threads make up the whole load: no one else
    assert T.oversubscribed(2, elapsed=1e6) is None
    machine(2, 3.0)  # ours (2) and one more
    assert T.oversubscribed(2, elapsed=1e6) == 1
    assert T.oversubscribed(1, elapsed=1e6) is None


def test_use_threads_refuses_bad_counts() -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
            T.use_threads(bad)  # type: ignore[arg-type]


def test_every_computing_command_takes_threads(tmp_path: Path) -> None:
    parser = build_parser()
    for argv in (
        ["train", "--out", "x"],
        ["eval", "run", "--top-k", "1"],
        ["stats", "run"],
        ["report", "run", "--out", "x"],
        ["demo"],
    ):
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3, argv
        assert parser.parse_args(argv).threads is None, argv


def test_stats_sets_threads_and_train_restores_them(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train(tiny_config(corpus, run, steps=2))  # threads=1 while it ran
        assert torch.get_num_threads() == 2
        assert json.loads((run / "config.json").read_text())["threads"] == 1
        assert main(["stats", str(run), "--max-batches", "1", "--threads", "1", "--json"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["eval", str(run), "--top-k", "1", "--threads", "0"]) == 2
    finally:
        torch.set_num_threads(old)


def test_more_threads_than_free_cores_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(T, "free_cores", lambda own=0.0: 1)
    corpus = make_corpus(tmp_path / "corpus")
    train(tiny_config(corpus, tmp_path / "run", steps=2, threads=2, progress=True))
    err = capsys.readouterr().err
    assert "warning: 2 threads but 1 free core(s)" in err and "--threads 1" in err
    assert "threads 2>1 free cores" in err  # the progress line (no terminal here)
    train(tiny_config(corpus, tmp_path / "run2", steps=2, threads=1, progress=True))
    assert "free core" not in capsys.readouterr().err


def test_resume_with_other_threads_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=4, threads=1), stop_after=2)
    summary = train(tiny_config(corpus, run, steps=4, threads=2), resume=True)
    assert summary["steps"] == 4 and summary["threads"] == 2
    err = capsys.readouterr().err
    assert "warning: the run trained with 1 thread(s), this part uses 2" in err
    saved = json.loads((run / "config.json").read_text())
    assert saved["threads"] == 1 and saved["run_info"]["resumes"][0]["threads"] == 2
