"""Faults lose nothing (docs/training.md, "What survives a fault"): a loss or weights that
are not finite, a kill or a second Ctrl-C in the middle of a checkpoint, a full disk, a
cut-off metrics line, two trainers on one folder, ``--overwrite`` on a folder that is
not a run, a start that fails before its first step, a checkpoint of another shape.

Each promise of that table is checked here once; tests/train/fault_trials.py repeats
the faults many times for the counts."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelab import _io as io
from moelab.cli import main
from moelab.runs import checkpoints as C
from moelab.runs.checkpoints import (
    CheckpointWriteError,
    incomplete_checkpoints,
    list_checkpoints,
)
from moelab.runs.metrics import read_rows
from moelab.train import (
    TrainingAborted,
    TrainingDiverged,
    latest_checkpoint,
    train,
)
from moelab.train.lock import RunLock, RunLocked

from . import tiny_config


@pytest.fixture(scope="module")
def corpus(small_corpus: Path) -> Path:
    return small_corpus


@pytest.fixture(scope="module")
def base_run(four_step_run: Path) -> Path:
    """A finished run of 4 steps with checkpoints at 2 and 4 (copied by the tests)."""
    return four_step_run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _rewrite_model(folder: Path, change) -> None:
    """Apply ``change`` to the tensors of a checkpoint's model.safetensors and update the
    manifest, as a consistent (not damaged) checkpoint."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "moelab-checkpoint"})
    manifest = json.loads((folder / "manifest.json").read_text())
    data = path.read_bytes()
    manifest["files"]["model.safetensors"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _finite(folder: Path) -> bool:
    tensors = load_file(folder / "model.safetensors")
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def _steps(run: Path) -> list[int]:
    return [int(p.name[5:]) for p in list_checkpoints(run)]


# ------------------------------------------------------------------- 1. not finite


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_divergence_stops_without_a_nonfinite_checkpoint(
    corpus: Path, tmp_path: Path, moe: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr = 1000 diverges: the run stops with one line naming the step and what to try;
    every checkpoint it wrote is finite, and the newest finite one is never pruned."""
    run = tmp_path / "run"
    model = {} if moe else {"moe_layers": "none"}
    cfg = tiny_config(
        corpus, run, steps=40, lr=1000.0, warmup_steps=1, checkpoint_every=1, log_every=5
    )
    cfg.model.update(model)
    with pytest.raises(TrainingDiverged, match=r"training diverged: .* at step (\d+)") as err:
        train(cfg)
    assert "--set lr=" in str(err.value) and "--overwrite" in str(err.value)
    assert err.value.step < 40
    assert all(_finite(f) for f in list_checkpoints(run))
    newest = latest_checkpoint(run)
    if newest is not None:  # the checkpoints kept are the newest finite ones
        assert int(newest.name[5:]) < err.value.step
        assert f"step {int(newest.name[5:])}, is finite and kept" in str(err.value)
    # the CLI: one line, exit 2
    capsys.readouterr()
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "cli"), "--data", str(corpus)]
    sets = {"lr": 1000, "steps": 40, "batch_size": 4, "seq_len": 32, "vocab_size": 300,
            "log_every": 5, "eval_every": 0, "warmup_steps": 1, "checkpoint_every": 1}  # fmt: skip
    for k, v in {**sets, **{f"model.{k}": v for k, v in model.items()}}.items():
        args += ["--set", f"{k}={v}"]
    args += ["--set", "model.n_layers=2", "--set", "model.d_model=32", "--threads", "1"]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("moelab train: error: training diverged:")
    assert "Traceback" not in "\n".join(lines)


def test_resume_skips_a_nonfinite_checkpoint(
    base_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint with NaN weights (as a moelab that did not check wrote them) is not
    resumed from: the newest finite one is, and it survives the pruning."""
    run = _copy(base_run, tmp_path)
    _rewrite_model(
        run / "checkpoints" / "step_00000004",
        lambda t: t.update(
            {k: torch.full_like(v, float("nan")) for k, v in t.items() if v.is_floating_point()}
        ),
    )
    capsys.readouterr()
    assert main(["eval", str(run), "--top-k", "2"]) == 2  # eval: one line, no NaN result
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds weights that are NaN or infinite" in err[0]
    assert "--step N" in err[0] and "steps it has: 2, 4" in err[0]
    summary = train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)
    err = capsys.readouterr().err
    assert "NaN or infinite" in err and "resuming from step_00000002" in err
    assert summary["steps"] == 6
    assert _steps(run) == [4, 6] and all(_finite(f) for f in list_checkpoints(run))


# -------------------------------------------- 2. kills and signals in a checkpoint write

CHILD = """
import os, signal, sys, time
from moelab.runs import checkpoints as C
how, k = sys.argv[1], int(sys.argv[2])
write, calls = C.write_atomic, [0]
def patched(path, data):
    if "checkpoints" not in path.parts:  # only the writes of checkpoints are counted
        return write(path, data)
    calls[0] += 1
    if calls[0] == k and how == "kill":
        tmp = path.with_name("." + path.name + ".tmp" + str(os.getpid()))
        tmp.write_bytes(data[: len(data) // 2])  # half a file, then the kill
        os.kill(os.getpid(), signal.SIGKILL)
    if calls[0] == k and how == "sigint2":
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    return write(path, data)
C.write_atomic = patched
from moelab import _io as io
from moelab.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _cli_args(corpus: Path, run: Path, steps: int, every: int) -> list[str]:
    from moelab.train import resume_command

    cfg = tiny_config(corpus, run, steps=steps, checkpoint_every=every)
    return shlex.split(resume_command(cfg))[1:-1]  # "train" and the settings, no --resume


def _child(how: str, k: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", CHILD, how, str(k), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_kill_in_the_first_checkpoint_resumes_from_step_0(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL in the middle of the first checkpoint's model file leaves no checkpoint,
    not a damaged one: --resume starts again from step 0. (Every write is one hidden
    folder renamed whole, so each of the 6 writes is the same case: fault_trials.py
    kills at each.)"""
    run = tmp_path / "run"
    args = _cli_args(corpus, run, steps=4, every=2)
    done = _child("kill", 1, args)
    assert done.returncode == -signal.SIGKILL
    assert not list_checkpoints(run) and not incomplete_checkpoints(run)
    assert list((run / "checkpoints").glob(".step_*.partial"))  # what the kill left
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint yet: from step 0" in err
    assert _steps(run) == [2, 4] and not list((run / "checkpoints").glob(".*"))


def test_a_second_sigint_in_a_checkpoint_write_exits_130(corpus: Path, tmp_path: Path) -> None:
    """Two SIGINTs inside the first checkpoint's write: the write is abandoned whole (no
    step folder, no temporary), exit 130 with the resume command, no traceback."""
    run = tmp_path / "run"
    args = _cli_args(corpus, run, steps=4, every=2)
    done = _child("sigint2", 2, args)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert "SIGINT twice: stopped at once after step 2" in done.stderr
    assert "there is no checkpoint yet" in done.stderr
    assert "resume with: moelab train" in done.stderr
    assert not list_checkpoints(run) and not list((run / "checkpoints").glob(".step_*"))
    assert main([*args, "--resume"]) == 0 and _steps(run) == [2, 4]


def test_a_step_folder_without_manifest_is_an_absent_checkpoint(
    base_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step folder a moelab that wrote in place left without its manifest: no
    checkpoint (resume from the one before, or step 0; eval says there is none)."""
    run = _copy(base_run, tmp_path)
    (run / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    assert _steps(run) == [2] and latest_checkpoint(run) is None
    summary = train(tiny_config(corpus, run, steps=4, checkpoint_every=2), resume=True)
    err = capsys.readouterr().err
    assert "step_00000004 has no manifest" in err and "resuming from step 2" in err
    assert summary["steps"] == 4 and _steps(run) == [2, 4]
    # the only checkpoint incomplete: step 0 (not "no intact checkpoint")
    for folder in list_checkpoints(run):
        (folder / "manifest.json").unlink()
    summary = train(tiny_config(corpus, run, steps=4, checkpoint_every=2), resume=True)
    assert "no checkpoint yet: from step 0" in capsys.readouterr().err
    assert summary["steps"] == 4


# --------------------------------------------------------------- 3. metrics lines


def test_a_cut_off_metrics_line_is_dropped_with_a_warning(
    base_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines) + lines[-1][:40])  # a full disk during an append
    summary = train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)
    assert "ends in a cut-off line" in capsys.readouterr().err
    assert summary["steps"] == 6
    steps = [r["step"] for r in read_rows(path)]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_a_bad_metrics_line_inside_names_the_file_and_line(
    base_run: Path, corpus: Path, tmp_path: Path
) -> None:
    run = _copy(base_run, tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1][:30] + "\n"
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2, is not valid JSON"):
        train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)


def test_report_names_a_bad_metrics_line_instead_of_skipping_it(
    base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = "{oops\n"
    path.write_text("".join(lines))
    capsys.readouterr()
    argv = ["report", str(run), "--out", str(tmp_path / "rep"), "--max-batches", "1"]
    assert main([*argv, "--top-k", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl, line 2, is not valid JSON" in err[0]


# ------------------------------------------------------------------- 4. full disk


def _full_after(monkeypatch: pytest.MonkeyPatch, name: str, calls: int = 1) -> None:
    """Writes of files called ``name`` fail with ENOSPC (after half the bytes), from the
    ``calls``-th on."""
    seen = [0]
    write = io.write_file

    def full(f, data: bytes) -> None:
        if Path(f.name).name.startswith(f".{name}.tmp") or Path(f.name).name == name:
            seen[0] += 1
            if seen[0] >= calls:
                f.write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(f, data)

    monkeypatch.setattr(io, "write_file", full)


def test_a_full_disk_keeps_the_previous_checkpoint(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(corpus, run, steps=4, checkpoint_every=2)
    _full_after(monkeypatch, "optimizer.safetensors", calls=2)  # the second checkpoint
    with pytest.raises(CheckpointWriteError) as err:
        train(cfg)
    message = str(err.value)
    assert "the checkpoint of step 4 could not be written" in message
    assert "optimizer.safetensors: No space left on device" in message
    assert "resume with: moelab train" in message
    assert _steps(run) == [2] and latest_checkpoint(run).name == "step_00000002"
    left = [p.name for p in run.rglob("*") if ".tmp" in p.name or ".partial" in p.name]
    assert left == []
    monkeypatch.undo()
    assert train(cfg, resume=True)["steps"] == 4 and _steps(run) == [2, 4]


def test_write_atomic_names_the_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.json").write_text("old")
    _full_after(monkeypatch, "a.json")
    with pytest.raises(OSError) as err:
        C.write_atomic(tmp_path / "a.json", b"new" * 100)
    assert err.value.filename == str(tmp_path / "a.json") and err.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert (tmp_path / "a.json").read_text() == "old"


# --------------------------------------------------------------- 5. two trainers


def test_a_run_in_use_is_refused(
    base_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path)
    cfg = tiny_config(corpus, run, steps=6, checkpoint_every=2)
    before = (run / "metrics.jsonl").read_bytes()
    with RunLock(run).acquire():  # another trainer (its own open file: flock conflicts)
        with pytest.raises(RunLocked, match=rf"in use by another trainer \(process {os.getpid()}"):
            train(cfg, resume=True)
        assert (run / "metrics.jsonl").read_bytes() == before
        capsys.readouterr()
        assert main([*_cli_args(corpus, run, 6, 2), "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("moelab train: error: ")
    # a stale lock (its process gone, so its flock released) is taken over, with a line
    (run / ".lock").write_text(json.dumps({"pid": 2**22 + 7, "host": "elsewhere"}))
    assert train(cfg, resume=True)["steps"] == 6
    assert "taking over the lock" in capsys.readouterr().err


def test_two_trainers_in_two_processes(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --resume started while the run trains (another process) is refused; every
    step is logged once."""
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=2, checkpoint_every=2))
    args = [*_cli_args(corpus, run, 40, 2), "--resume"]
    slow = CHILD.replace(
        "C.write_atomic = patched",
        "from moelab.train import metrics\n"
        "append = metrics.write_row\n"
        "metrics.write_row = lambda r, row: (append(r, row), time.sleep(0.1))",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", slow, "none", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while len(read_rows(run / "metrics.jsonl")) < 4 and time.monotonic() < deadline:
            assert first.poll() is None
            time.sleep(0.05)
        capsys.readouterr()
        assert main(args) == 2  # the second trainer, here
        err = capsys.readouterr().err
        assert "in use by another trainer" in err and f"process {first.pid}" in err
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    steps = [r["step"] for r in read_rows(run / "metrics.jsonl")]
    assert len(steps) == len(set(steps))


# ----------------------------------------------------- 6, 8. folders moelab did not make


def test_overwrite_refuses_a_folder_that_is_not_a_run(corpus: Path, tmp_path: Path) -> None:
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    (folder / "data").mkdir()
    with pytest.raises(FileExistsError, match=r"refusing to overwrite .*thesis\.tex"):
        train(tiny_config(corpus, folder, steps=1), overwrite=True)
    assert (folder / "thesis.tex").read_text() == "years of work"


def test_a_failed_start_leaves_nothing(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too few tokens for the batch: the run folder is gone; the same command with a
    smaller batch then starts (no "other settings" refusal)."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="lower batch_size"):
        train(tiny_config(corpus, run, steps=2, batch_size=4096))
    assert not run.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="lower batch_size"):
        train(tiny_config(corpus, empty, steps=2, batch_size=4096))
    assert empty.is_dir() and not list(empty.iterdir())  # the folder is the user's
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("   \n")
    capsys.readouterr()
    args = ["train", "--preset", "tiny", "--out", str(run), "--data", str(blank)]
    assert main([*args, "--set", "steps=1"]) == 2
    assert not run.exists()
    assert train(tiny_config(corpus, run, steps=2))["steps"] == 2


# ----------------------------------------------------------------- 10. shapes


def test_a_checkpoint_of_another_shape_names_the_tensor(
    base_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    key = "embed.weight"

    def wider(t: dict[str, torch.Tensor]) -> None:
        assert key in t, sorted(t)[:5]
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)

    _rewrite_model(newest, wider)
    capsys.readouterr()
    assert main(["eval", str(run), "--top-k", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"tensor {key} has shape" in err[0]
    assert "model.safetensors" in err[0]
    # resume falls back to the older checkpoint, as for any damaged one
    summary = train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)
    out = capsys.readouterr().err
    assert "skipped a damaged checkpoint" in out and "resuming from step_00000002" in out
    assert summary["steps"] == 6


def test_interrupted_aborted_is_a_keyboard_interrupt() -> None:
    stop = TrainingAborted(3, None, signal.SIGINT, "moelab train --resume")
    assert isinstance(stop, KeyboardInterrupt) and stop.exit_code == 130
    assert "no checkpoint yet" in str(stop)
