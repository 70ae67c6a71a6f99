"""What a run folder holds (RUN = ``TrainConfig.out``): the entries training writes,
those of its live sinks, and those other moelab commands add. A folder holding anything
else (dot files aside: the lock and the temporaries of an interrupted atomic write) is
not a moelab run: ``moelab train --overwrite`` and ``moelab report``/``study``
``--overwrite`` refuse it.

    config.json       the run's settings (read back with moelab.runs.read_config)
    tokenizer.json    the tokenizer trained on the training documents
    data/             token shards (moelab.data.shards)
    metrics.jsonl     one row per logged step (moelab.runs.metrics)
    checkpoints/      step_NNNNNNNN/ folders and ``latest`` (moelab.runs.checkpoints)
    summary.json      what train() returns
"""

from __future__ import annotations

__all__ = ["CHECKPOINTS", "CONFIG", "DATA", "METRICS", "RUN_ENTRIES", "SUMMARY", "TOKENIZER"]

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
DATA = "data"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"

RUN_ENTRIES = frozenset(
    {CONFIG, TOKENIZER, DATA, METRICS, CHECKPOINTS, SUMMARY}
    # the live sinks of --log (moelab.train.sinks)
    | {"tensorboard", "wandb"}
    # what other moelab commands add to a run folder: moelab study (training time, cached
    # analysis) and moelab downstream (results, the generated cloze task)
    | {"study_time.json", "analysis", "downstream.json", "downstream"}
)
"""What a run folder holds; a folder holding anything else is not a moelab run."""
