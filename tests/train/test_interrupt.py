"""SIGINT and SIGTERM during training: a checkpoint of the step, the command that resumes,
a clean exit (130 / 143), and a resumed run that ends as if never stopped."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.cli import main
from moelab.train import latest_checkpoint, resume_command, train

from . import make_corpus, tiny_config

STEPS = 12

# The child: the CLI on the given arguments, each metrics line slowed down to 50 ms so
# that the signal surely lands mid-run.
CHILD = """
import sys, time
from moelab.train import metrics
append = metrics.write_row
metrics.write_row = lambda run, row: (append(run, row), time.sleep(0.05))
from moelab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _interrupt(args: list[str], run: Path, signum: int) -> subprocess.CompletedProcess[str]:
    """Start the CLI, send ``signum`` once it has logged 3 steps, wait for it to exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    while _rows(run) < 3 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signum)
    out, err = child.communicate(timeout=60)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_sigint_checkpoints_and_the_printed_command_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    cfg = tiny_config(corpus, tmp_path / "run", steps=STEPS)
    args = shlex.split(resume_command(cfg))[1:-1]  # the same settings, without --resume
    done = _interrupt(args, tmp_path / "run", signal.SIGINT)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None
    step = int(ckpt.name[5:])
    assert 3 <= step < STEPS
    assert f"training interrupted by SIGINT at step {step}; checkpoint written to" in done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("resume with: "))
    command = line.removeprefix("resume with: ")
    assert command == resume_command(cfg) and command.endswith("--resume")
    # the command, as printed, finishes the run: "resuming from step N"
    assert main([*shlex.split(command)[1:], "--json"]) == 0
    captured = capsys.readouterr()
    assert f"resuming from step {step}" in captured.err
    assert json.loads(captured.out)["steps"] == STEPS
    # bit-identical to a run that was never stopped
    straight = train(tiny_config(corpus, tmp_path / "straight", steps=STEPS))
    assert json.loads(captured.out)["train_loss"] == straight["train_loss"]
    a = load_file(latest_checkpoint(tmp_path / "straight") / "model.safetensors")  # type: ignore[operator]
    b = load_file(latest_checkpoint(tmp_path / "run") / "model.safetensors")  # type: ignore[operator]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Unhandled(Exception):
    """SIGTERM reached the test's own handler: training did not take it."""


def test_sigterm_exits_143_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (the signal sent from a thread once 3 steps are logged); the
    test's own SIGTERM handler stands in for the default one, which would end pytest."""
    from moelab.train import metrics

    def unhandled(signum: int, frame: object) -> None:
        raise _Unhandled

    append = metrics.write_row
    monkeypatch.setattr(metrics, "write_row", lambda r, row: (append(r, row), time.sleep(0.05)))
    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    cfg = tiny_config(corpus, run, steps=STEPS)

    def send() -> None:
        while _rows(run) < 3:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, unhandled)
    try:
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        code = main([*shlex.split(resume_command(cfg))[1:-1], "--json"])
        sender.join(timeout=10)
        assert signal.getsignal(signal.SIGTERM) is unhandled  # training put it back
    finally:
        signal.signal(signal.SIGTERM, old)
    assert code == 143
    doc = json.loads(capsys.readouterr().out)
    assert doc["interrupted"] == "SIGTERM" and doc["resume"] == resume_command(cfg)
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and doc["checkpoint"] == str(ckpt) and doc["step"] == int(ckpt.name[5:])
    assert 3 <= doc["step"] < STEPS and (ckpt / "manifest.json").is_file()
