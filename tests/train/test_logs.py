"""What a run tells as it goes: the time and throughput of its metrics rows and
summary, its progress lines without a terminal, its warnings."""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from moelab.data import load_corpus
from moelab.data.corpus import CorpusWarning
from moelab.data.prepare import prepare
from moelab.train import latest_checkpoint, load_checkpoint, loop, train
from moelab.train.progress import Progress, RunClock, Throughput

from . import TINY_MODEL, make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


class _Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------- time and throughput


def test_throughput_is_the_windows_rate_and_the_average_since_the_start() -> None:
    clock = _Clock()
    speed = Throughput(10, tokens_per_step=64, clock=clock)  # a run resumed at step 10
    clock.now += 9.0  # steps 11-12: compilation, 9 s
    assert speed.rates(12) == {"tokens_per_s": 2 * 64 / 9.0, "tokens_per_s_avg": 2 * 64 / 9.0}
    speed.next_window(12)
    clock.now += 0.5  # evaluation and checkpoint between the windows: only in the average
    speed.next_window(12)
    clock.now += 1.0  # steps 13-14
    assert speed.rates(14) == {"tokens_per_s": 2 * 64 / 1.0, "tokens_per_s_avg": 4 * 64 / 10.5}
    assert speed.seconds() == 10.5


def test_run_clock_counts_on_from_an_earlier_part() -> None:
    clock = _Clock()
    run = RunClock(before=30.0, clock=clock)
    clock.now += 2.5
    assert run.elapsed() == 32.5
    before = time.time()
    stamp = run.stamp()
    assert stamp["elapsed_s"] == 32.5 and before - 1e-3 <= stamp["time"] <= time.time() + 1e-3


def _slow_first_step(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Step 0 of a run takes ``seconds`` longer (as compilation would)."""
    lr_at = loop.lr_at

    def slow(step: int, config: Any) -> float:
        if step == 0:
            time.sleep(seconds)
        return lr_at(step, config)

    monkeypatch.setattr(loop, "lr_at", slow)


def test_rows_give_the_recent_rate_time_and_elapsed_seconds(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_first_step(monkeypatch, 1.0)
    run = tmp_path / "run"
    t_before = time.time()
    summary = train(tiny_config(corpus, run, steps=8, log_every=2))
    t_after = time.time()
    rows = _rows(run)
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    times = [r["time"] for r in rows]
    assert t_before <= times[0] and times == sorted(times) and times[-1] <= t_after
    elapsed = [r["elapsed_s"] for r in rows]
    assert 1.0 < elapsed[0] and elapsed == sorted(elapsed)
    assert elapsed[-1] - elapsed[0] == pytest.approx(times[-1] - times[0], abs=0.05)
    tokens = 4 * 32  # per step
    for prev, row in itertools.pairwise(rows):
        # the recent rate: the window's tokens over its time (which leaves out the
        # logging between windows, a small part of it)
        window = (row["tokens"] - prev["tokens"]) / (row["elapsed_s"] - prev["elapsed_s"])
        assert row["tokens_per_s"] == pytest.approx(window, rel=0.5)
        assert row["tokens_per_s"] > 3 * row["tokens_per_s_avg"]
    # the average since the first step, the slow one included: its seconds count from
    # the first step, elapsed_s from the start of train() (data preparation first)
    since_first = [r["step"] * tokens / r["tokens_per_s_avg"] for r in rows]
    assert since_first[0] > 1.0
    offsets = [r["elapsed_s"] - t for r, t in zip(rows, since_first, strict=True)]
    assert max(offsets) - min(offsets) < 0.05 and min(offsets) > 0
    assert rows[0]["tokens_per_s"] == pytest.approx(rows[0]["tokens_per_s_avg"], rel=1e-6)
    last = rows[-1]
    assert summary["tokens_per_s"] == last["tokens_per_s"]
    assert summary["tokens_per_s_avg"] == last["tokens_per_s_avg"]
    assert last["elapsed_s"] <= summary["wall_s"] <= last["elapsed_s"] + (t_after - times[-1])


def test_elapsed_seconds_go_on_over_a_resume(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(corpus, run, steps=6, log_every=2, eval_every=3)
    train(cfg, stop_after=4)
    ckpt = load_checkpoint(latest_checkpoint(run), restore_rng=False)  # type: ignore[arg-type]
    part = ckpt["extra"]["elapsed_s"]
    first = _rows(run)
    assert part >= first[-1]["elapsed_s"] > 0
    time.sleep(0.5)  # between the parts: not the run's time
    summary = train(cfg, resume=True)
    rows = _rows(run)
    assert rows[: len(first)] == first
    assert [r["step"] for r in first] == [2, 3, 4]  # step 3: an evaluation row
    (last,) = rows[len(first) :]
    assert last["step"] == 6 and last["elapsed_s"] > part
    wall_gap = last["time"] - first[-1]["time"]
    assert last["elapsed_s"] - first[-1]["elapsed_s"] < wall_gap - 0.45  # the pause left out
    assert summary["wall_s"] >= last["elapsed_s"]
    assert all("time" in r and "elapsed_s" in r for r in rows)


# ------------------------------------------------------ progress without a terminal


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_progress_is_a_line_per_logged_step(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(tiny_config(corpus, tmp_path / "run", steps=6, log_every=2, eval_every=3, progress=True))
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [x for x in err.splitlines() if x.startswith("step ")]
    rows = _rows(tmp_path / "run")
    logged = [r for r in rows if "loss" in r]
    assert [x.split()[1] for x in lines] == ["2/6", "4/6", "6/6"]
    for line, row in zip(lines, logged, strict=True):
        assert f"loss {row['loss']:.3f}" in line
        assert f"tok_s {row['tokens_per_s']:,.0f}" in line and "elapsed 0:00:" in line
    assert f"val_loss {logged[-1]['val_loss']:.3f}" in lines[-1]  # evaluated at the end
    assert all(f"active {r['active_experts']:.2f}" in x for x, r in zip(lines, logged, strict=True))


def test_a_dense_model_shows_no_active_experts(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense model routes nothing: its progress lines leave "active" out (they read
    "active nan")."""
    model = {**TINY_MODEL, "moe_layers": "none"}
    train(tiny_config(corpus, tmp_path / "run", steps=2, log_every=1, model=model, progress=True))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert len(lines) == 2 and not any("nan" in x or "active" in x for x in lines)


def test_a_terminal_gets_the_bar_and_slow_steps_a_heartbeat() -> None:
    tty = _Terminal()
    with Progress(4, 0, enabled=True, stream=tty) as bar:
        for step in range(1, 5):
            bar.logged(step, {"loss": "1.000"}, float(step))
            bar.advance(step, float(step))
    assert "\r" in tty.getvalue() and "step 1/4" not in tty.getvalue()
    clock, log = _Clock(), io.StringIO()
    with Progress(100, 10, enabled=True, stream=log, heartbeat_s=60.0, clock=clock) as bar:
        bar.logged(20, {"loss": "2.500"}, 75.0)
        clock.now += 59.0
        bar.advance(21, 134.0)  # within a minute of the last line: nothing
        clock.now += 1.0
        bar.advance(22, 135.0)
        clock.now += 30.0
        bar.advance(23, 165.0)
    assert log.getvalue().splitlines() == [
        "step 20/100 (20%)  loss 2.500  elapsed 0:01:15",
        "step 22/100 (22%)  elapsed 0:02:15",
    ]
    silent = io.StringIO()
    with Progress(4, 0, enabled=False, stream=silent) as bar:
        bar.logged(1, {"loss": "1.000"}, 1.0)
        bar.advance(1, 1.0)
    assert silent.getvalue() == ""


# ---------------------------------------------------------------- corpus warnings


def _with_binary_file(corpus: Path, folder: Path) -> Path:
    shutil.copytree(corpus, folder)
    (folder / "zz_image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    return folder


def test_skipped_corpus_files_are_one_line_not_a_python_warning(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _with_binary_file(corpus, tmp_path / "corpus")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tiny_config(data, tmp_path / "run", steps=2))
        prepare(data, tmp_path / "prep", vocab_size=280, progress=False)  # reads it 3 times
    assert not [w for w in caught if issubclass(w.category, CorpusWarning)]
    said = [x for x in capsys.readouterr().err.splitlines() if "skipped" in x]
    line = f"warning: skipped 1 of {len(list(data.iterdir()))} files under {data} that are not "
    assert len(said) == 2 and all(x.startswith(line) for x in said), said  # train, prepare
    assert all(x.endswith(": zz_image.txt") for x in said)
    # the library's own warning is left as it was, for whoever reads the corpus
    with pytest.warns(CorpusWarning, match="skipped 1 of"):
        load_corpus(data)


def test_every_command_says_skipped_files_in_one_line(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval and stats read a second corpus with --data: the same one formatted line."""
    from moelab.cli import main

    data = _with_binary_file(corpus, tmp_path / "corpus")
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=2))
    capsys.readouterr()
    for argv in (
        ["stats", str(run), "--data", str(data), "--max-batches", "1"],
        ["eval", str(run), "--top-k", "1", "--data", str(data), "--max-batches", "1"],
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(argv) == 0
        assert not [w for w in caught if issubclass(w.category, CorpusWarning)]
        said = [x for x in capsys.readouterr().err.splitlines() if "skipped" in x]
        assert len(said) == 1 and said[0].startswith(f"moelab {argv[0]}: warning: skipped 1 of")


def test_a_log_file_of_moelab_train(corpus: Path, tmp_path: Path) -> None:
    """The command with stderr to a file, as under a scheduler."""
    data = _with_binary_file(corpus, tmp_path / "corpus")
    sets = [f"{k}={v}" for k, v in TINY_MODEL.items()]
    sets += ["seq_len=32", "batch_size=4", "vocab_size=300", "log_every=2", "device=cpu"]
    args = [sys.executable, "-m", "moelab", "train", "--steps", "6", "--threads", "1"]
    args += ["--out", str(tmp_path / "run"), "--data", str(data)]
    args += [a for s in sets for a in ("--set", s)]
    with open(tmp_path / "err.log", "wb") as err, open(tmp_path / "out.log", "wb") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        code = subprocess.run(args, stdout=out, stderr=err, env=env, timeout=300).returncode
    log = (tmp_path / "err.log").read_bytes()
    assert code == 0, log.decode()
    assert b"\r" not in log
    lines = log.decode().splitlines()
    assert [x.split()[1] for x in lines if x.startswith("step ")] == ["2/6", "4/6", "6/6"]
    assert [x for x in lines if "skipped" in x] == [
        f"warning: skipped 1 of 41 files under {data} that are not UTF-8 text (binary or "
        "another encoding): zz_image.txt"
    ]
    assert len(lines) == 4, lines  # nothing else: no warning display, no source line
    out_lines = (tmp_path / "out.log").read_text().splitlines()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (
        f"tokens/s         {summary['tokens_per_s']:,.0f} (the last logging window)"
        in "\n".join(out_lines)
    )
    wall = next(x for x in out_lines if x.startswith("wall time"))
    assert wall.endswith(f"({summary['wall_s']:,.1f} s)")
