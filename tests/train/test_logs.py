"""What a run tells as it goes: the time and throughput of its metrics rows and
summary, its progress lines without a terminal, its warnings."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from moelab.train import latest_checkpoint, load_checkpoint, loop, train
from moelab.train.progress import RunClock, Throughput

from . import make_corpus, tiny_config


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
    for prev, row in zip(rows, rows[1:]):
        # the recent rate: the window's tokens over its time (which leaves out the
        # logging between windows, a small part of it)
        window = (row["tokens"] - prev["tokens"]) / (row["elapsed_s"] - prev["elapsed_s"])
        assert row["tokens_per_s"] == pytest.approx(window, rel=0.5)
        assert row["tokens_per_s"] > 3 * row["tokens_per_s_avg"]
    # the average since the first step, the slow one included: its seconds count from
    # the first step, elapsed_s from the start of train() (data preparation first)
    since_first = [r["step"] * tokens / r["tokens_per_s_avg"] for r in rows]
    assert since_first[0] > 1.0
    offsets = [r["elapsed_s"] - t for r, t in zip(rows, since_first)]
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
