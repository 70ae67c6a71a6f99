"""What a run folder holds (RUN = ``TrainConfig.out``): the entries training writes,
those of its live sinks, and those other moelab commands add. A folder holding anything
else (dot files aside: the lock and the temporaries of an interrupted atomic write) is
not a moelab run: ``moelab train --overwrite`` and ``moelab report``/``study``
``--overwrite`` refuse it.

    config.json      the TrainConfig, with the model config resolved (every ModelConfig
                     and RouterConfig field), the thread count used and ``run_info``
                     (versions, git commit, device, CPU: moelab.train.provenance; the
                     corpus's identity, checked by moelab.runs.check_corpus; each
                     resumption appends to ``run_info["resumes"]``); read back with
                     moelab.runs.read_config
    tokenizer.json   byte-level BPE trained on the training documents
    data/            token shards, {train,val}.* (moelab.data.shards)
    metrics.jsonl    one JSON line per logged step (moelab.runs.metrics): loss, lr,
                     tokens, tokens_per_s of the last logging window and
                     tokens_per_s_avg, time and elapsed_s (moelab.train.progress),
                     routing numbers, dead_experts of the window
                     (moelab.train.dead_experts); val_loss when evaluated
    checkpoints/     step_NNNNNNNN/ folders and ``latest`` (moelab.runs.checkpoints)
    summary.json     what train() returns (valid JSON: a number that is not finite is
                     written as null)
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
