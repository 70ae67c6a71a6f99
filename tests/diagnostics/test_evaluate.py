"""Evaluation of trained runs: the K sweep reproduces the model's own loss, rows and
statistics follow the DESIGN.md contracts, the CLI prints them, errors are clear."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from moelab.cli import main
from moelab.data import TokenShard, batches
from moelab.diagnostics import corpus_shard, evaluate, load_run, stats
from moelab.train import train
from tests.train import make_corpus, tiny_config

EVAL_KEYS = {"run", "trained_top_k", "results"}
ROW_KEYS = {"top_k", "nll", "retained_mass", "contributors"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def moe_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run = tmp_path_factory.mktemp("runs") / "moe"
    cfg = tiny_config(corpus, run, map="sparsemax", steps=20, eval_batches=3, log_every=10)
    return run, train(cfg)


def _reference_nll(run: Path, k: int, n_batches: int) -> float:
    """Mean loss of the model run directly on the first batches of the val split."""
    loaded = load_run(run)
    cfg = loaded.config
    for layer in loaded.model.moe_layers:
        layer.router.top_k = k
    shard = TokenShard.open(run / "data" / "val.bin")
    it = batches(shard, cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1)
    losses = []
    with torch.no_grad():
        for _, (x, y) in zip(range(n_batches), it, strict=False):
            out = loaded.model(x, y)
            assert out.loss is not None
            losses.append(float(out.loss))
    return sum(losses) / len(losses)


def test_load_run(moe_run: tuple[Path, dict]) -> None:
    run, _ = moe_run
    loaded = load_run(run)
    assert not loaded.model.training and loaded.step == 20
    assert next(loaded.model.parameters()).device.type == "cpu"
    assert all(layer.router.top_k == 2 for layer in loaded.model.moe_layers)
    with pytest.raises(FileNotFoundError, match="not a moelab run"):
        load_run(run / "nothing")


def test_trained_k_reproduces_validation_loss(moe_run: tuple[Path, dict]) -> None:
    run, summary = moe_run
    result = evaluate(run, [2], max_batches=3)
    assert set(result) >= EVAL_KEYS | {"nll_increase"}
    assert result["trained_top_k"] == 2 and result["nll_increase"] == 0.0
    (row,) = result["results"]
    # training's val loss: the first eval_batches = 3 batches of the val split, in order
    assert row["nll"] == pytest.approx(summary["val_loss"], abs=1e-6)
    assert row["nll"] == pytest.approx(_reference_nll(run, 2, 3), abs=1e-6)


def test_sweep_rows_and_k_restored(moe_run: tuple[Path, dict]) -> None:
    run, _ = moe_run
    result = evaluate(run, [1, 2, 4], max_batches=2)
    assert [r["top_k"] for r in result["results"]] == [1, 2, 4]
    for r in result["results"]:
        assert set(r) >= ROW_KEYS
        assert 0.0 <= r["retained_mass"] <= 1.0 + 1e-9
        assert 0.0 < r["contributors"] <= r["top_k"]
        assert r["nll"] > 0
    by_k = {r["top_k"]: r for r in result["results"]}
    assert by_k[1]["contributors"] == 1.0
    assert by_k[1]["retained_mass"] <= by_k[2]["retained_mass"] <= by_k[4]["retained_mass"]
    assert result["nll_increase"] == pytest.approx(by_k[4]["nll"] - by_k[2]["nll"])
    # any K: the model's own loss with that K on the same batches
    assert by_k[1]["nll"] == pytest.approx(_reference_nll(run, 1, 2), abs=1e-6)
    # the checkpoint's top_k is untouched and the in-memory routers are restored
    assert all(layer.router.top_k == 2 for layer in load_run(run).model.moe_layers)


def test_k_restored_on_error(moe_run: tuple[Path, dict]) -> None:
    ev_mod = importlib.import_module("moelab.diagnostics.evaluate")
    run, _ = moe_run
    loaded = load_run(run)
    with pytest.raises(RuntimeError, match="boom"), ev_mod._top_k(loaded.model, 3):
        assert all(layer.router.top_k == 3 for layer in loaded.model.moe_layers)
        raise RuntimeError("boom")
    assert all(layer.router.top_k == 2 for layer in loaded.model.moe_layers)


def test_second_corpus(moe_run: tuple[Path, dict], corpus: Path) -> None:
    run, _ = moe_run
    result = evaluate(run, [2, 4], data=corpus, max_batches=1)
    assert result["data"] == str(corpus)
    assert [r["top_k"] for r in result["results_data"]] == [2, 4]
    assert all(set(r) >= ROW_KEYS for r in result["results_data"])
    shard = corpus_shard(corpus, load_run(run).tokenizer)
    assert int(shard.tokens[-1]) == shard.eos_id and len(shard) > 1000


def test_stats_contract(moe_run: tuple[Path, dict]) -> None:
    run, _ = moe_run
    result = stats(run, max_batches=2)
    assert set(result) >= {"run", "map", "mean", "layers", "alpha"}
    assert result["map"] == "sparsemax" and result["top_k"] == 2
    assert {"discarded_mass", "contributors", "singleton_rate", "threshold"} <= set(result["mean"])
    assert [lay["layer"] for lay in result["layers"]] == [0]  # tiny: 2 blocks, MoE in block 1
    assert result["layers"][0]["block"] == 1
    assert 0 < result["mean"]["contributors"] <= 2
    # stats' NLL and contributors agree with the eval row of the trained K
    (row,) = evaluate(run, [2], max_batches=2)["results"]
    assert result["nll"] == pytest.approx(row["nll"])
    assert result["mean"]["contributors"] == pytest.approx(row["contributors"])
    json.dumps(result)


def test_cli_json_and_text(moe_run: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = moe_run
    assert main(["eval", str(run), "--top-k", "1", "2", "--max-batches", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= EVAL_KEYS and [r["top_k"] for r in doc["results"]] == [1, 2]
    assert all(set(r) >= ROW_KEYS for r in doc["results"])
    assert main(["stats", str(run), "--max-batches", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"run", "map", "mean", "layers"} and doc["layers"][0]["layer"] == 0
    assert main(["eval", str(run), "--top-k", "1", "2", "--max-batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "retained" in text and "NLL increase" in text
    assert main(["stats", str(run), "--max-batches", "1"]) == 0
    assert "discarded_mass" in capsys.readouterr().out


def test_errors(moe_run: tuple[Path, dict], corpus: Path, tmp_path: Path) -> None:
    run, _ = moe_run
    with pytest.raises(ValueError, match=r"outside \[1, 4\]"):
        evaluate(run, [2, 8], max_batches=1)
    with pytest.raises(ValueError, match="at least one K"):
        evaluate(run, [], max_batches=1)
    dense = tmp_path / "dense"
    model = {**tiny_config(corpus, dense).model, "moe_layers": "none"}
    train(tiny_config(corpus, dense, steps=2, model=model))
    with pytest.raises(ValueError, match="dense model"):
        evaluate(dense, [1], max_batches=1)
    with pytest.raises(ValueError, match="dense model"):
        stats(dense, max_batches=1)
