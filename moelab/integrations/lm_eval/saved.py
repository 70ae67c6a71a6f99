"""``RUN/downstream.json``: what ``moelab downstream`` saves in a run folder, how a new
call joins it, and how ``moelab report`` and the studies tell current scores from stale
ones.

The file (format ``moelab-downstream``, version 2)::

    {"format", "version", "run", "checkpoint_step" (the step of the checkpoint that was
     loaded and scored), "limit" (``--limit``; None: every document), "num_fewshot",
     "cloze_items", "trained_top_k", "task_versions" ({task: the harness's version}),
     "rows": [...], "routing": [...], "notes": [...]}

Every row (and routing row) also carries its own ``checkpoint_step``, ``limit`` and
``task_version``.

**One setting per file.** The setting is (checkpoint step, limit, num_fewshot,
cloze_items) and the version of each task. A new call whose setting equals the file's
merges into it: its (task, K) rows replace the file's, the others stay. A call with
another setting (the run was trained further, another ``--limit``, a new task version)
never mixes with the file: the file is moved, whole, to
``RUN/downstream/downstream.step_NNNNNNNN[.limit_N][.fewshot_N].json`` (``.2``, ``.3``
... when that name is taken) and a new ``downstream.json`` holds the new call's rows
only. A file saved before these fields existed (no ``format``), or one that cannot be
read, is moved the same way (``step_unknown`` when its rows disagree on the step).
Nothing is deleted; every write goes through a temporary file and ``os.replace``.

Nothing here imports the harness.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab.runs.layout import CONFIG

__all__ = [
    "ARCHIVE_DIR",
    "FILE",
    "FORMAT",
    "SETTING",
    "VERSION",
    "conflicts",
    "describe_limit",
    "file_limit",
    "limit_text",
    "newest_step",
    "row_step",
    "save_downstream",
    "score_status",
    "trained_k_scores",
]

FILE = "downstream.json"
"""The file's name in a run folder."""
ARCHIVE_DIR = "downstream"
"""Where files of an earlier setting are kept (``RUN/downstream/``)."""
FORMAT = "moelab-downstream"
VERSION = 2
SETTING = ("checkpoint_step", "limit", "num_fewshot", "cloze_items")
"""The keys that must agree for two calls' rows to share one file."""
_WHAT = {
    "checkpoint_step": "checkpoint step",
    "limit": "--limit",
    "num_fewshot": "--num-fewshot",
    "cloze_items": "cloze items",
}


def _show(key: str, value: Any) -> str:
    if key == "limit":
        return "none" if value is None else f"{value:g}"
    return "default" if value is None else str(value)


def describe_limit(limit: Any) -> str:
    """``--limit`` in words: "all documents" for None."""
    if limit is None:
        return "all documents"
    if isinstance(limit, float) and limit < 1:
        return f"{limit:g} of the documents"
    return f"at most {limit:g} documents per task"


def conflicts(old: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """Why the rows of the saved file ``old`` may not share a file with those of
    ``doc`` (a new call's document): one phrase per difference; [] when they may."""
    if old.get("format") != FORMAT:
        return ["it was saved without the checkpoint step, --limit and task versions"]
    why = [
        f"{_WHAT[k]} {_show(k, old.get(k))} then, {_show(k, doc.get(k))} now"
        for k in SETTING
        if old.get(k) != doc.get(k)
    ]
    versions = old.get("task_versions") or {}
    for task, version in (doc.get("task_versions") or {}).items():
        if task in versions and versions[task] != version:
            why.append(f"{task} version {versions[task]} then, {version} now")
    return why


def _read_any(path: Path) -> tuple[dict[str, Any] | None, bool]:
    """(the file's document, readable); (None, True) when there is no file."""
    if not path.is_file():
        return None, True
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}, False
    if not isinstance(doc, dict) or not isinstance(doc.get("rows", []), list):
        return {}, False
    return doc, True


def _archive_path(run: Path, old: dict[str, Any]) -> Path:
    """A free name under RUN/downstream/ for the file ``old``, named by its setting."""
    if old.get("format") == FORMAT:
        step = old.get("checkpoint_step")
    else:
        steps = {r.get("checkpoint_step") for r in old.get("rows", []) if isinstance(r, dict)}
        step = steps.pop() if len(steps) == 1 else None
    name = f"step_{step:08d}" if isinstance(step, int) else "step_unknown"
    if old.get("format") == FORMAT:
        if old.get("limit") is not None:
            name += f".limit_{old['limit']:g}"
        if old.get("num_fewshot") is not None:
            name += f".fewshot_{old['num_fewshot']}"
    folder = run / ARCHIVE_DIR
    path = folder / f"downstream.{name}.json"
    n = 2
    while path.exists():
        path = folder / f"downstream.{name}.{n}.json"
        n += 1
    return path


def _order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["top_k"] is None, r["top_k"] or 0, r["task"]))


def _write(path: Path, doc: dict[str, Any]) -> Path:
    """``doc`` written to a temporary beside ``path`` (a dot file, so that the run folder
    stays a run folder if it is left behind); returns the temporary."""
    from moelab._io import json_bytes

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(json_bytes(doc))
    return tmp


def save_downstream(run: str | Path, doc: dict[str, Any], label: str = "") -> dict[str, Any]:
    """Save ``doc`` (one call's document for one run: the module docstring's fields)
    as ``RUN/downstream.json`` under the one-setting rule.

    Returns ``{"path", "doc" (what the file now holds), "archived" (where the earlier
    file went, or None), "why" (the differences that moved it), "note" (the sentence
    saying so, after ``label: ``, also added to the file's notes; None)}``."""
    run = Path(run)
    path = run / FILE
    doc = {"format": FORMAT, "version": VERSION, **doc}
    old, readable = _read_any(path)
    why = ["it could not be read as JSON"] if not readable else []
    if old is not None and readable:
        why = conflicts(old, doc)
    if old is None or why:
        merged = dict(doc, rows=_order(doc["rows"]), routing=_order(doc["routing"]))
        merged["notes"] = list(dict.fromkeys(doc.get("notes", [])))
    else:
        new_keys = {(r["task"], r["top_k"]) for r in doc["rows"]}
        merged = dict(doc, task_versions={**old.get("task_versions", {}), **doc["task_versions"]})
        for key in ("rows", "routing"):
            kept = [r for r in old.get(key, []) if (r.get("task"), r.get("top_k")) not in new_keys]
            merged[key] = _order(kept + doc[key])
        merged["notes"] = list(dict.fromkeys([*old.get("notes", []), *doc.get("notes", [])]))
    archived = note = None
    if old is not None and why:
        archived = _archive_path(run, old)
        note = (
            f"{label + ': ' if label else ''}the earlier {FILE} was moved to {archived} "
            f"({'; '.join(why)}): one file never mixes two settings"
        )
        merged["notes"].append(note)
    tmp = _write(path, merged)
    if archived is not None:
        archived.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, archived)  # NOTE: moved whole, never rewritten: nothing is lost
    os.replace(tmp, path)
    return {"path": path, "doc": merged, "archived": archived, "why": why, "note": note}


# ----------------------------------------------------------------- reading back


def newest_step(run: str | Path) -> int | None:
    """The step of the run's newest checkpoint (``checkpoints/latest``), or None."""
    from moelab.runs.checkpoints import checkpoint_step, latest_checkpoint

    folder = latest_checkpoint(run)  # NOTE: only ever a step_NNNNNNNN folder
    return None if folder is None else checkpoint_step(folder)


def row_step(row: dict[str, Any], doc: dict[str, Any]) -> int | None:
    """The checkpoint step a saved row was scored at (None: not recorded)."""
    step = row.get("checkpoint_step", doc.get("checkpoint_step") if doc.get("format") else None)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def file_limit(doc: dict[str, Any]) -> tuple[bool, Any]:
    """(whether the file records ``--limit``, the limit); a file saved before the limit
    was recorded may mix limits."""
    if doc.get("format") == FORMAT and "limit" in doc:
        return True, doc["limit"]
    return False, None


def limit_text(row: dict[str, Any], doc: dict[str, Any]) -> str:
    """A saved row's ``--limit`` as a table cell: "all" (every document), the limit, or
    "?" (a file saved before the limit was recorded)."""
    known, limit = file_limit(doc)
    if not known and "limit" not in row:
        return "?"
    limit = row.get("limit", limit)
    if limit is None:
        return "all"
    return f"{limit:g}" if isinstance(limit, (int, float)) else str(limit)


def score_status(step: int | None, reference: int | None) -> str:
    """The status of scores of ``step``: "current" (scored at ``reference``, the
    checkpoint shown beside them), "stale" (scored at another step) or "unknown" (the
    step was not recorded)."""
    if step is None:
        return "unknown"
    if reference is None or step == reference:
        return "current"
    return "stale"


def trained_k_scores(run: str | Path) -> dict[str, Any]:
    """The saved scores of a run at its trained K that a table beside its newest
    checkpoint may show: ``{"run", "scores" ({task: {"acc" (acc, else acc_norm),
    "perplexity"}} from the rows at the trained K (a dense run's: top_k None) scored at
    the newest checkpoint or recording no step), "newest" (the newest checkpoint's
    step), "limits" (of the rows kept: "all", N, or "?" when not recorded), "stale" (the
    steps of the rows left out), "unknown" (some kept row records no step)}``; no scores
    without the file. Raises ValueError for a file that is not JSON."""
    path = Path(run) / FILE
    newest = newest_step(run)
    record: dict[str, Any] = {"run": str(run), "scores": {}, "newest": newest, "limits": [],
                              "stale": [], "unknown": False}  # fmt: skip
    if not path.is_file():
        return record
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path} is not a JSON file ({err}); delete it or run `moelab downstream` on "
            "the run again"
        ) from None
    trained = None
    config = Path(run) / CONFIG
    if config.is_file():
        from moelab.diagnostics.evaluate import check_run

        mc = check_run(run).model_config()
        trained = mc.router_config().top_k if mc.moe_indices else None
    rows = doc.get("rows", []) if isinstance(doc, dict) else []
    for row in rows:
        if not isinstance(row, dict) or "task" not in row:
            continue
        if row.get("top_k") != trained:  # another budget (a dense run's rows: None)
            continue
        step = row_step(row, doc)
        status = score_status(step, newest)
        if status == "stale":  # another checkpoint's scores: never beside this one's loss
            record["stale"] = sorted({*record["stale"], step})
            continue
        record["unknown"] |= status == "unknown"
        lim = limit_text(row, doc)
        if lim not in record["limits"]:
            record["limits"].append(lim)
        acc = row.get("acc") if row.get("acc") is not None else row.get("acc_norm")
        metrics = row.get("metrics") or {}
        record["scores"][str(row["task"])] = {"acc": acc, "perplexity": metrics.get("perplexity")}
    return record
