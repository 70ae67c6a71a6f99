from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.runs.checkpoints import verify_checkpoint
from moelab.train import CheckpointError, latest_checkpoint, load_checkpoint, lr_at, train

from . import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run = tmp_path_factory.mktemp("runs") / "run"
    cfg = tiny_config(corpus, run, steps=30, eval_every=10, checkpoint_every=10)
    return run, train(cfg)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule() -> None:
    from moelab.train import TrainConfig

    cfg = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_run_writes_files_and_learns(trained: tuple[Path, dict]) -> None:
    run, summary = trained
    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "summary.json"):
        assert (run / name).is_file(), name
    assert (run / "data" / "train.bin").is_file() and (run / "data" / "val.bin").is_file()
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == "step_00000030"
    for name in ("model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"):
        assert (ckpt / name).is_file(), name
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"loss", "lr", "tokens", "tokens_per_s", "active_experts"} <= set(rows[0])
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 32
    assert summary["val_loss"] == rows[-1]["val_loss"]
    assert 0 < summary["unigram_entropy"] < 10
    assert 0 < summary["active_experts"] <= 2
    assert summary["tokens_per_s"] > 0


def _states(run: Path) -> tuple[dict, dict]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    return load_file(ckpt / "model.safetensors"), load_file(ckpt / "optimizer.safetensors")


def test_resume_is_bit_identical(corpus: Path, tmp_path: Path) -> None:
    straight = train(tiny_config(corpus, tmp_path / "a", steps=8, eval_every=3))
    cfg_b = tiny_config(corpus, tmp_path / "b", steps=8, eval_every=3)
    half = train(cfg_b, stop_after=4)
    assert half["steps"] == 4
    resumed = train(cfg_b, resume=True)
    assert resumed["steps"] == 8
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    (model_a, optim_a), (model_b, optim_b) = _states(tmp_path / "a"), _states(tmp_path / "b")
    assert model_a.keys() == model_b.keys() and optim_a.keys() == optim_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for key in optim_a:
        assert torch.equal(optim_a[key], optim_b[key]), key
    losses_a = [r["loss"] for r in _metrics(tmp_path / "a")]
    losses_b = [r["loss"] for r in _metrics(tmp_path / "b")]
    assert losses_a == losses_b


def test_resume_refuses_other_settings(corpus: Path, tmp_path: Path) -> None:
    cfg = tiny_config(corpus, tmp_path / "run", steps=4)
    train(cfg, stop_after=2)
    with pytest.raises(ValueError, match=r"lr: 0\.01 in the run, 0\.02 given"):
        train(tiny_config(corpus, tmp_path / "run", steps=4, lr=0.02), resume=True)
    # the progress bar and the device may change
    assert (
        train(tiny_config(corpus, tmp_path / "run", steps=4, progress=True), resume=True)["steps"]
        == 4
    )


def _copy_ckpt(run: Path, tmp_path: Path) -> Path:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    return Path(shutil.copytree(ckpt, tmp_path / "ckpt"))


def test_intact_checkpoint_loads(trained: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt = _copy_ckpt(trained[0], tmp_path)
    state = load_checkpoint(ckpt, restore_rng=False)
    assert state["step"] == 30 and state["config"]["steps"] == 30


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_truncated_checkpoint_is_refused(
    trained: tuple[Path, dict], tmp_path: Path, name: str
) -> None:
    ckpt = _copy_ckpt(trained[0], tmp_path)
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or altered.*will not be loaded"):
        verify_checkpoint(ckpt)


def test_flipped_byte_is_refused(trained: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt = _copy_ckpt(trained[0], tmp_path)
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[len(data) - 10] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted: sha256 .* will not be loaded"):
        verify_checkpoint(ckpt)


def test_missing_manifest_is_refused(trained: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt = _copy_ckpt(trained[0], tmp_path)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(ckpt, restore_rng=False)


def test_refuses_existing_run_folder(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    cfg = tiny_config(corpus, run, steps=1)
    # not a run folder: only another folder helps; neither resume nor overwrite is offered
    with pytest.raises(FileExistsError, match=r"not a moelab run folder .*another folder") as err:
        train(cfg)
    assert "--resume" not in str(err.value) and "overwrite" not in str(err.value)
    assert (run / "notes.txt").read_text() == "mine"
    with pytest.raises(FileExistsError, match=r"not a moelab run folder \(it holds notes\.txt"):
        train(cfg, resume=True)
    with pytest.raises(ValueError, match="exclude each other"):
        train(cfg, resume=True, overwrite=True)
    # overwrite deletes only a folder moelab made: the user's file stays
    with pytest.raises(FileExistsError, match=r"refusing to overwrite .*notes\.txt"):
        train(cfg, overwrite=True)
    assert (run / "notes.txt").read_text() == "mine"
    (run / "notes.txt").unlink()
    summary = train(cfg)
    assert summary["steps"] == 1
    with pytest.raises(FileExistsError, match=r"resume=True \(--resume\) to continue it"):
        train(cfg)
    assert train(cfg, overwrite=True)["steps"] == 1  # a run folder: overwritten
    with pytest.raises(FileNotFoundError, match=r"does not exist or is empty; drop resume"):
        train(tiny_config(corpus, tmp_path / "none", steps=1), resume=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=r"is a file, not a run folder"):
        train(tiny_config(corpus, tmp_path / "file", steps=1), resume=True)


def test_val_loss_reads_no_batch_twice(corpus: Path, tmp_path: Path) -> None:
    """eval_batches beyond the validation split: the val loss covers the split once
    (the mean over its batches, as `moelab eval` computes it over every batch), and the
    summary says how many batches that was."""
    from moelab.data import TokenShard, batches
    from moelab.diagnostics import evaluate

    run = tmp_path / "run"
    summary = train(tiny_config(corpus, run, steps=2, eval_batches=1000, checkpoint_every=0))
    val = TokenShard.open(run / "data" / "val.bin")
    n = sum(1 for _ in batches(val, 4, 32, shuffle=False, epochs=1))
    assert 0 < n < 1000
    assert (summary["val_batches"], summary["val_tokens"]) == (n, n * 4 * 32)
    nll = evaluate(run, [2], max_batches=None)["results"][0]["nll"]
    assert summary["val_loss"] == pytest.approx(nll, rel=1e-5)
