"""The run folder: its format, in one place. Training writes through it, every other
command reads through it.

    layout        what a run folder holds (RUN_ENTRIES)
    checkpoints   the checkpoint format: write, publish, list, verify, load, read
    metrics       metrics.jsonl: append, read, a row restored
    config        config.json read back and checked; where it disagrees with a checkpoint
    weights       the checkpoint a model is loaded from (a step's, or the newest intact)
    folders       the output folders of report and study: markers, what a folder holds,
                  a folder replaced whole

What other packages read of a trained run's folder, as public functions here: its
settings (:func:`read_config`: config.json checked, one line naming the file when it is
not a run's), the check that its tokenizer and data are the ones it trained on
(:func:`check_corpus`), its metrics rows, its summary, and analysis values cached per
checkpoint (``RUN/analysis/KEY.json``).

``CorpusMismatch``, ``check_corpus`` (moelab.data.run_corpus) and ``read_config``
(moelab.runs.config), which load torch, are imported on first use, so that importing
moelab.runs loads no torch (moelab.cli imports its folder rules for every ``--help``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moelab._io import write_json
from moelab._lazy import lazy_names
from moelab._strict_json import json_safe
from moelab.runs.layout import CONFIG, DATA, SUMMARY, TOKENIZER
from moelab.runs.metrics import read_metrics

if TYPE_CHECKING:
    from moelab.data.run_corpus import CorpusMismatch, check_corpus
    from moelab.runs.config import read_config

__all__ = [
    "CorpusMismatch",
    "cached",
    "check_corpus",
    "checkpoint_stamp",
    "corpus_id",
    "read_config",
    "read_metrics",
    "read_summary",
]

_LAZY = {
    "CorpusMismatch": "moelab.data.run_corpus",
    "check_corpus": "moelab.data.run_corpus",
    "read_config": "moelab.runs.config",
}


def read_summary(run: str | Path) -> dict[str, Any]:
    """``run/summary.json`` ({} where training has not written it)."""
    path = Path(run) / SUMMARY
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def corpus_id(run: str | Path) -> str | None:
    """The identity of the data ``run`` trained on (a hash of its tokenizer and split,
    :func:`moelab.data.corpus_identity`): as its config.json recorded it at the start,
    else worked out from its tokenizer and shards (a run from before the record); None
    where the folder has neither."""
    run = Path(run)
    try:
        saved = json.loads((run / CONFIG).read_text(encoding="utf-8"))
        recorded = saved["run_info"]["corpus"]["id"]
        if isinstance(recorded, str):
            return recorded
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass
    if not (run / TOKENIZER).is_file():
        return None
    from moelab.data import corpus_identity

    try:
        return str(corpus_identity(run / TOKENIZER, run / DATA)["id"])
    except ValueError:
        return None


def checkpoint_stamp(run: Path) -> str | None:
    """What identifies the run's current checkpoint for the analysis cache (the steps
    its summary records; None without a readable summary)."""
    summary = run / SUMMARY
    try:
        return str(json.loads(summary.read_text(encoding="utf-8")).get("steps"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def cached(run: Path, key: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, saved as ``RUN/analysis/KEY.json`` for the run's current checkpoint
    so that running the analysis again does not recompute it (a retrained or extended
    run recomputes)."""
    stamp = checkpoint_stamp(run)
    path = run / "analysis" / f"{key}.json"
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("checkpoint") == stamp:
                return saved["value"]
        except (OSError, json.JSONDecodeError, AttributeError):
            pass
    value = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"checkpoint": stamp, "value": value}, indent=None)
    return json.loads(json.dumps(json_safe(value)))


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
