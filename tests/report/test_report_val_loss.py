"""The two validation losses of one checkpoint in a report: training's final `val loss`
(its first ``eval_batches`` batches) and the NLL of the statistics and the budget sweep
(``max_batches``), each labelled with the text it covers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.report import build_report


def test_each_loss_says_what_it_covers(
    runs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    softmax = runs[0]
    config = json.loads((softmax / "config.json").read_text(encoding="utf-8"))
    summary = json.loads((softmax / "summary.json").read_text(encoding="utf-8"))
    per_batch = config["batch_size"] * config["seq_len"]
    # the reference: training evaluates its first eval_batches batches (1 here)
    assert summary["val_batches"] == config["eval_batches"] == 1
    out = tmp_path_factory.mktemp("val_loss") / "rep"
    doc = build_report([softmax], out, top_ks=(2,), max_batches=3, threshold_scales=())
    (row,) = doc["tables"]["routing"]
    assert row["val loss"] == summary["val_loss"]
    assert row["val tokens"] == per_batch  # 1 batch of training's evaluation
    md = Path(doc["report"]).read_text(encoding="utf-8")
    sweep = md.split("## Inference-time budget sweep")[1]
    routing = md.split("## Routing statistics")[1].split("##")[0]
    covered = f"3 batches, {3 * per_batch:,} tokens"  # the report's own batches
    assert f"on the validation split ({covered})" in routing
    assert "`val loss` is training's final validation loss, on the first `eval_batches`" in routing
    assert "| val loss | val tokens |" in routing
    assert f"nats per token, on {covered} of the validation split" in sweep
    assert "not training's `val loss`" in sweep


def test_the_train_summary_says_what_eval_and_stats_cover() -> None:
    """`moelab train` prints training's val loss with its batches, and that eval and
    stats, which a user runs next, cover DEFAULT_MAX_BATCHES (64) by default."""
    from moelab.cli.common import DEFAULT_MAX_BATCHES
    from moelab.cli.train import format_train

    summary = {"run": "r", "steps": 10, "tokens": 1280, "train_loss": 5.5, "val_loss": 5.25,
               "val_batches": 8, "val_tokens": 8192, "unigram_entropy": 6.0,
               "tokens_per_s": 100.0}  # fmt: skip
    (line,) = [x for x in format_train(summary).splitlines() if x.startswith("val loss")]
    assert line == (
        "val loss         5.2500 (first 8 batches of the validation split, 8,192 tokens; "
        f"--set eval_batches=N); moelab eval and stats cover {DEFAULT_MAX_BATCHES} unless "
        "--max-batches"
    )
    assert DEFAULT_MAX_BATCHES == 64
