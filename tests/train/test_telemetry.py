"""Live telemetry: the TensorBoard and W&B sinks of ``--log``, read back with their own
readers (TensorBoard's EventAccumulator and HTTP server; the W&B offline run file),
against metrics.jsonl, the source of truth; resume without duplicate steps; the sink
names and the missing-extra error."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moelab.runs.checkpoints import list_checkpoints
from moelab.runs.metrics import read_rows
from moelab.train import TrainConfig, TrainingDiverged, train
from moelab.train import sinks as S

from . import free_port, make_corpus, tiny_config
from ._wandb_files import history, run_id

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

_GUIDANCE = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the sink's own default; a user's WANDB_MODE=online must not reach a test
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _tracked(corpus: Path, run: Path, **kw: Any) -> TrainConfig:
    base = dict(
        steps=30,
        log_every=5,
        eval_every=10,
        checkpoint_every=10,
        log=("tensorboard", "wandb"),
    )
    return tiny_config(corpus, run, **{**base, **kw})


@pytest.fixture(scope="module")
def tracked(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 30-step tiny run with both sinks (W&B offline), MoE layers in both blocks."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    os.environ.pop("WANDB_MODE", None)
    train(_tracked(corpus, run, model={**tiny_config(corpus, run).model, "moe_layers": "all"}))
    return run


def _accumulator(run: Path) -> EventAccumulator:
    ea = EventAccumulator(str(run / "tensorboard"), size_guidance=_GUIDANCE)
    ea.Reload()
    return ea


def _wandb_files(run: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tracked: Path) -> None:
    rows = read_rows(tracked / "metrics.jsonl")
    ea = _accumulator(tracked)
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in S.scalars(row).items():
            expected.setdefault(key, {})[row["step"]] = value
    assert set(ea.Tags()["scalars"]) == set(expected)
    # the health set is there, summarised over the two MoE layers
    for key in ("maxvio/max", "entropy/median", "top2_gap_q50/min", "seq_imbalance/max"):
        assert key in expected, key
    assert "grad_norm" in expected and "val_ppl" in expected and "elapsed_s" in expected
    for key, by_step in expected.items():
        got = {e.step: e.value for e in ea.Scalars(key)}
        assert sorted(got) == sorted(by_step), key
        for step, value in by_step.items():
            # TensorBoard keeps a scalar as float32
            assert got[step] == pytest.approx(float(np.float32(value)), rel=1e-7, abs=0), key
    # the per-layer keys stay out: their summaries are there
    assert not any(k.startswith("active_experts.") for k in ea.Tags()["scalars"])
    # a load-share histogram per MoE layer at every logged step, an image every eval
    logged = [r["step"] for r in rows if "load_share_layers" in r]
    for i in range(2):
        hists = ea.Histograms(f"load_share/layer{i}")
        assert [h.step for h in hists] == logged
        for h, row in zip(hists, [r for r in rows if "load_share_layers" in r], strict=True):
            assert h.histogram_value.num == 4  # the 4 experts
            assert h.histogram_value.sum == pytest.approx(sum(row["load_share_layers"][i]))
        assert [im.step for im in ea.Images(f"load_heatmap/layer{i}")] == [10, 20, 30]


def test_wandb_offline_run_holds_the_same(tracked: Path) -> None:
    rows = {r["step"]: r for r in read_rows(tracked / "metrics.jsonl")}
    (path,) = _wandb_files(tracked)
    state = json.loads((tracked / "wandb" / "moelab-run.json").read_text())
    assert run_id(path) == state["id"] and state["last_step"] == 30
    sent = history(path)
    assert [h["_step"] for h in sent] == sorted(rows)
    for h in sent:
        row = rows[h["_step"]]
        for key, value in S.scalars(row).items():
            assert h[key] == value, key  # JSON float64: exact
        if "load_share_layers" in row:
            assert h["load_share/layer0/_type"] == "histogram"
            assert sum(h["load_share/layer0/values"]) == 4
        assert ("load_heatmap/layer1/_type" in h) == (h["_step"] % 10 == 0)


def test_metrics_rows_carry_time_and_the_balancing_state(tracked: Path) -> None:
    rows = [r for r in read_rows(tracked / "metrics.jsonl") if "loss" in r]
    for row in rows:
        assert row["time"] > 1.7e9 and row["elapsed_s"] > 0
        assert math.isclose(row["maxvio/max"], max(row["maxvio_layers"]))
        assert math.isclose(row["entropy/min"], min(row["entropy_layers"]))
        for w, lip, tau in zip(
            row["weight_norm_layers"], row["lipschitz_layers"], row["tau_layers"], strict=True
        ):
            assert lip == pytest.approx(w / (2 * tau), rel=1e-6)
        assert sum(row["load_share_layers"][0]) == pytest.approx(1.0)
        if "val_loss" in row:
            assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]))


def test_resume_after_a_kill_repeats_no_step(corpus: Path, tmp_path: Path) -> None:
    """A part killed after step 15, with its newest checkpoint at 10: the resumed part
    trains 11-30 again. TensorBoard's reader shows every step once, with
    metrics.jsonl's values; the W&B run keeps its id and receives no step twice."""
    run = tmp_path / "run"
    train(_tracked(corpus, run), stop_after=15)
    # the kill: the checkpoint of step 15 was never written
    for folder in list_checkpoints(run):
        if folder.name.endswith("15"):
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    train(_tracked(corpus, run), resume=True)
    rows = read_rows(run / "metrics.jsonl")
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [5, 10, 15, 20, 25, 30]
    ea = _accumulator(run)
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per part
    for key in ("loss", "maxvio/max", "lr"):
        events = ea.Scalars(key)
        assert [e.step for e in events] == steps, key
        by_step = {r["step"]: r[key] for r in rows if key in r}
        for e in events:
            assert e.value == pytest.approx(float(np.float32(by_step[e.step])), rel=1e-7)
    files = _wandb_files(run)
    assert len(files) == 2 and len({run_id(p) for p in files}) == 1
    sent = [h["_step"] for p in files for h in history(p)]
    assert sorted(sent) == sorted(set(sent)) == steps


def test_tensorboard_serves_a_scalar_over_http(tracked: Path) -> None:
    """The user's view: ``tensorboard --logdir RUN`` answers a scalar of the run."""
    exe = Path(sys.executable).with_name("tensorboard")
    if not exe.exists():
        pytest.skip("no tensorboard command beside this Python")
    port = free_port()
    cmd = [str(exe), "--logdir", str(tracked), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=tensorboard&tag=loss"
    try:
        deadline, data = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                with urllib.request.urlopen(url, timeout=5) as reply:
                    data = json.loads(reply.read())
                if data:
                    break
            time.sleep(0.5)
        assert data, f"tensorboard gave no scalar (exit {proc.poll()})"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    rows = [r for r in read_rows(tracked / "metrics.jsonl") if "loss" in r]
    assert [int(d[1]) for d in data] == [r["step"] for r in rows]
    assert data[-1][2] == pytest.approx(float(np.float32(rows[-1]["loss"])), rel=1e-7)


def test_divergence_is_an_event_of_the_sinks(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(
        corpus, run, steps=40, lr=1000.0, warmup_steps=1, log_every=5, log=("tensorboard",)
    )
    cfg.model.update({"moe_layers": "none"})
    with pytest.raises(TrainingDiverged):
        train(cfg)
    ea = _accumulator(run)
    (tag,) = [t for t in ea.Tags()["tensors"] if t.startswith("warnings")]
    texts = [e.tensor_proto.string_val[0].decode() for e in ea.Tensors(tag)]
    assert any("training diverged" in t for t in texts)


# ------------------------------------------------------------ names, extras, errors


def test_sink_names() -> None:
    cfg = TrainConfig(log="tensorboard, jsonl,wandb,tensorboard")
    assert cfg.log == ("tensorboard", "wandb")
    assert TrainConfig(log=["jsonl"]).log == ()
    assert TrainConfig.from_dict(cfg.to_dict()).log == ("tensorboard", "wandb")
    with pytest.raises(ValueError, match="unknown sink 'mlflow'"):
        TrainConfig(log=("mlflow",))


def test_a_missing_extra_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, corpus: Path, capsys: Any
) -> None:
    import importlib.util

    from moelab.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs the wandb package.*moelab\[track\]"):
        S.check_available(["tensorboard", "wandb"])
    out = tmp_path / "cli"
    args = ["train", "--out", str(out), "--data", str(corpus), "--steps", "2", "--log", "wandb"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moelab train: error: --log wandb needs the wandb package, which is not installed: "
        "pip install 'moelab[track]'"
    ]
    assert not out.exists()


def test_a_failing_sink_is_closed_and_training_goes_on() -> None:
    said: list[str] = []

    class Broken:
        name = "tensorboard"
        closed = False

        def write(self, *a: Any) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            Broken.closed = True

    sinks = S.Sinks([Broken()], say=said.append)
    sinks.write({"step": 1, "loss": 1.0})
    sinks.write({"step": 2, "loss": 1.0})
    assert Broken.closed and not sinks
    assert len(said) == 1 and "the tensorboard sink failed" in said[0]
    assert "metrics.jsonl keeps every row" in said[0]


def test_a_resumed_run_hands_the_sinks_its_earlier_rows(
    four_step_run: Path, small_corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    """The heatmaps of a resumed run start from the rows already in metrics.jsonl (the
    loop once passed the run folder where the file was meant, and handed over none)."""
    from moelab.train import loop

    run = Path(shutil.copytree(four_step_run, tmp_path / "run"))
    given: list[list[dict[str, Any]]] = []

    def fake_open(log, run_dir, config, start, main, say, rows=()):
        given.append(list(rows))
        return S.Sinks()

    monkeypatch.setattr(loop, "open_sinks", fake_open)
    config = tiny_config(small_corpus, run, steps=6, checkpoint_every=2, log="tensorboard")
    train(config, resume=True)
    before = [r for r in read_rows(four_step_run / "metrics.jsonl") if "load_share_layers" in r]
    assert before, "the fixture's rows carry load shares"
    assert [r["step"] for r in given[0] if "load_share_layers" in r] == [r["step"] for r in before]
