"""A run whose loss stays finite but climbs far above ln V (the loss of a uniform guess
over the V tokens) has diverged, as one whose loss is not finite: it stops with one
line, keeps no checkpoint of the diverged state and says what it keeps. Healthy runs,
their first steps included, stay far below the limit (2 ln V)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from moelab.cli import main
from moelab.model import Transformer
from moelab.runs.checkpoints import list_checkpoints
from moelab.runs.metrics import read_rows
from moelab.train import TrainingDiverged, divergence, loop, train

from . import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=16)


def _ln_v(run: Path) -> float:
    """ln V of the run's vocabulary, from config.json (the reference: a uniform guess)."""
    return math.log(json.loads((run / "config.json").read_text())["model"]["vocab_size"])


def test_a_loss_far_above_ln_v_stops_the_run(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's settings (lr = 1000 warmed up over 20,000 steps, so the lr reaches
    5 in 100 steps): the loss stays finite and climbs past 2 ln V (at steps 50-70 for
    seeds 0-3); before, the run finished with exit 0 and a train loss of 37-57, 6.5 to
    10 times ln V = 5.7."""
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--top-k", "2", "--out", str(run), "--data", str(corpus)]
    sets = {"lr": 1000, "warmup_steps": 20000, "steps": 100, "batch_size": 4, "seq_len": 32,
            "vocab_size": 300, "log_every": 5, "eval_every": 0, "eval_batches": 2,
            "checkpoint_every": 10, "model.n_layers": 2, "model.d_model": 32,
            "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64,
            "model.max_seq_len": 32, "model.n_experts": 4}  # fmt: skip
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    assert main([*args, "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    line = err[-1]
    assert line.startswith("moelab train: error: training diverged: the loss is ")
    limit = 2 * _ln_v(run)
    rows = [r for r in read_rows(run / "metrics.jsonl") if "loss" in r]
    high = [r for r in rows if r["loss"] > limit]
    assert high == rows[-1:]  # the run stopped at the first row above the limit
    step = high[0]["step"]
    assert f"at step {step}, above 2 ln V = {limit:.3g}" in line
    assert all(math.isfinite(r["loss"]) for r in rows)
    # the row says it as well (the warnings of metrics.jsonl and the sinks)
    assert any("training diverged" in w for w in high[0]["warnings"])
    # no checkpoint of the diverged state; the newest kept one is named with its loss
    kept = [int(p.name[5:]) for p in list_checkpoints(run)]
    assert kept and max(kept) < step
    at = next(r for r in rows if r["step"] == max(kept))
    if at["loss"] > _ln_v(run):  # worse than a guess already: not called a good one
        said = f"the newest checkpoint, step {max(kept)}, is kept, but its loss {at['loss']:.4g}"
    else:
        said = f"the newest checkpoint, step {max(kept)} (loss {at['loss']:.4g}), is finite and"
    assert said in line
    assert "--overwrite would delete" in line
    assert not (run / "summary.json").exists()


def test_a_checkpoint_worse_than_guessing_is_not_called_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "checkpoints" / "step_00000040"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"extra": {"loss": 9.0}}))
    monkeypatch.setattr(divergence, "latest_checkpoint", lambda run: folder)
    said = divergence.kept_checkpoint(tmp_path, 300)  # ln 300 = 5.70 < 9
    assert said.startswith("the newest checkpoint, step 40, is kept, but its loss 9 is above")
    assert "ln V = 5.7" in said and "finite and kept" not in said
    (folder / "state.json").write_text(json.dumps({"extra": {"loss": 4.25}}))
    good = divergence.kept_checkpoint(tmp_path, 300)
    assert good == "the newest checkpoint, step 40 (loss 4.25), is finite and kept"


class _Overflowing(Transformer):
    """A model whose forward fails as a map does on scores that overflowed (finite
    weights grown huge: lr = 1e5 does it within a few steps) from its third training
    step on."""

    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            type(self).calls += 1
            if type(self).calls >= FAILS_AT:
                raise ValueError("softmax: scores contain NaN or +inf (first at flattened row 0)")
        return super().forward(*args, **kwargs)


FAILS_AT = 3


def test_activations_that_overflow_are_a_divergence(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the map's refusal was the run's error, with no word of divergence; at
    the first step it still is (the configured model itself fails: not training's)."""
    monkeypatch.setattr(loop, "Transformer", _Overflowing)
    _Overflowing.calls = 0
    cfg = tiny_config(corpus, tmp_path / "run", steps=6, log_every=1)
    with pytest.raises(TrainingDiverged, match=r"the forward pass of step 3 failed \(softmax: "):
        train(cfg)
    monkeypatch.setattr(sys.modules[__name__], "FAILS_AT", 1)
    _Overflowing.calls = 0
    with pytest.raises(ValueError, match=r"^softmax: scores contain NaN"):
        train(tiny_config(corpus, tmp_path / "first", steps=6, log_every=1))


def test_healthy_runs_stay_far_below_the_limit(corpus: Path, tmp_path: Path) -> None:
    """Every step of a tiny run logged: the first loss is near ln V (a model starts
    close to a uniform guess) and no loss comes near 2 ln V."""
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=20, log_every=1, eval_every=5))
    ln_v = _ln_v(run)
    rows = read_rows(run / "metrics.jsonl")
    losses = [r[k] for r in rows for k in ("loss", "val_loss") if k in r]
    assert abs(rows[0]["loss"] - ln_v) < 0.5
    assert max(losses) < 1.2 * ln_v  # the limit, 2 ln V, is far away
    assert not any(r.get("warnings") for r in rows)
