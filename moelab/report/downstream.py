"""The downstream section of ``moelab report``: the scores that ``moelab downstream``
saved in each run folder (``RUN/downstream.json``), read back, never recomputed.

Tables: ``downstream`` (rows: run x K, columns: acc and acc_norm per task where the task
has them, else its first metric) and ``downstream_routing`` (routing statistics of each
task's tokens: active experts, discarded mass, contributors, load CV; means over the MoE
layers). Both show the checkpoint step each score was made at and the score table the
``--limit`` it was made with; scores of another step than the checkpoint this report
shows for the run (by default its newest) are marked ``stale``, with a note below the
table ("scored at step 500; newest checkpoint 1000"), and files that record no step are
marked ``step unknown`` (never shown as current). Figure ``downstream_vs_k.png``:
accuracy against K, one line per run, checkpoint step and task, drawn when some run was
evaluated at several K. Runs without the file, and saved ``--hf`` results, are named in
a note; without any file the section is left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moelab.integrations.lm_eval.saved import (
    ARCHIVE_DIR,
    file_limit,
    limit_text,
    newest_step,
    row_step,
    score_status,
)
from moelab.report.builder import ReportBuilder
from moelab.report.table import Table

__all__ = ["downstream_section", "plot_accuracy_vs_k", "read_downstream"]


def read_downstream(run: str | Path) -> dict[str, Any] | None:
    """``RUN/downstream.json``, or None when the run has none (ValueError when it is
    not valid JSON)."""
    path = Path(run) / "downstream.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable `moelab downstream` result: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path} is not a `moelab downstream` result (no rows)")
    return doc


def _metric(row: dict[str, Any], name: str) -> Any:
    if name in ("acc", "acc_norm"):
        return row.get(name)
    return row.get("metrics", {}).get(name)


def _metrics(rows: list[dict[str, Any]], task: str) -> list[str]:
    mine = [r for r in rows if r["task"] == task]
    names = [m for m in ("acc", "acc_norm") if any(r.get(m) is not None for r in mine)]
    if not names:
        extra = [k for r in mine for k in r.get("metrics", {}) if "stderr" not in k]
        names = extra[:1]
    return names


def plot_accuracy_vs_k(rows: list[dict[str, Any]], path: Path) -> Path:
    """Accuracy (acc, else the task's first metric) against K, one line per run,
    checkpoint step and task (rows not of the report's checkpoint name their step)."""
    from moelab.report import plots

    plt = plots.plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    keys = list(dict.fromkeys((r["label"], r.get("step"), r["task"]) for r in rows))
    all_ks: set[int] = set()
    for j, key in enumerate(keys):
        label, step, task = key
        mine = sorted(
            (r for r in rows if (r["label"], r.get("step"), r["task"]) == key and r["top_k"]),
            key=lambda r: r["top_k"],
        )
        names = _metrics(rows, task)
        if len(mine) < 2 or not names:
            continue
        ks = [r["top_k"] for r in mine]
        ys = [_metric(r, names[0]) for r in mine]
        ys = [float("nan") if y is None else y for y in ys]
        all_ks.update(ks)
        status = mine[0].get("status", "current")
        at = "" if status == "current" else f" ({_status_text(status, step)})"
        ax.plot(
            ks, ys, marker="o", label=f"{label}: {task} {names[0]}{at}", color=plots.line_color(j)
        )
    ax.set_xscale("log", base=2)
    if all_ks:
        ax.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
        ax.minorticks_off()
    ax.set_xlabel("experts per token at inference (K)")
    ax.set_ylabel("accuracy")
    ax.set_title("Downstream accuracy against K")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return plots.save_figure(fig, path)


def _status_text(status: str, step: int | None) -> str:
    if status == "stale":
        return f"stale: step {step}"
    return "step unknown" if status == "unknown" else "current"


def _reference_step(d: dict[str, Any]) -> int | None:
    """The checkpoint step this report shows for the run: the one its statistics were
    computed on, else the newest checkpoint."""
    for v in (
        d.get("checkpoint_step"),
        (d.get("stats") or {}).get("checkpoint_step"),
        (d.get("sweep") or {}).get("checkpoint_step"),
    ):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return newest_step(d["run"])


def _read_all(
    rep: ReportBuilder,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The saved rows and routing rows of every run, each with ``label``, ``step`` (None:
    not recorded), ``status`` (:func:`~moelab.integrations.lm_eval.saved.score_status`
    against the checkpoint the report shows) and ``limit_text``; and what the notes
    need: ``missing`` labels, ``stale`` {label: (steps, reference, newest)},
    ``unknown`` labels, ``old_limit`` labels, ``archived`` {label: [paths]}."""
    rows: list[dict[str, Any]] = []
    routing: list[dict[str, Any]] = []
    info: dict[str, Any] = {"missing": [], "stale": {}, "unknown": [], "old_limit": [],
                            "archived": {}}  # fmt: skip
    for d in rep.data:
        doc = None if d.get("result") else read_downstream(d["run"])
        if doc is None:
            info["missing"].append(d["label"])
            continue
        label, ref = d["label"], _reference_step(d)
        for key, out in (("rows", rows), ("routing", routing)):
            for r in doc.get(key, []):
                step = row_step(r, doc)
                status = score_status(step, ref)
                out.append(dict(r, label=label, step=step, status=status,
                                limit_text=limit_text(r, doc)))  # fmt: skip
                if status == "stale":
                    steps = info["stale"].setdefault(label, (set(), ref, newest_step(d["run"])))
                    steps[0].add(step)
                elif status == "unknown" and label not in info["unknown"]:
                    info["unknown"].append(label)
        if not file_limit(doc)[0]:
            info["old_limit"].append(label)
        kept = sorted((Path(d["run"]) / ARCHIVE_DIR).glob("downstream.*.json"))
        if kept:
            info["archived"][label] = [str(p) for p in kept]
    return rows, routing, info


def _score_table(rows: list[dict[str, Any]]) -> Table:
    """The score table: one row per (run, K, checkpoint step, limit), so that one row
    never mixes scores of two checkpoints or two limits."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cols: list[tuple[str, str, str]] = [
        ("run", "label", "s"),
        ("K", "top_k", "d"),
        ("step", "step", "d"),
        ("scores", "status_text", "s"),
        ("limit", "limit_text", "s"),
    ]
    for task in tasks:
        cols += [(f"{task} {m}", f"{task}|{m}", ".4f") for m in _metrics(rows, task)]
    table_rows = []
    keys = ("label", "top_k", "step", "limit_text")
    for group in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        mine = [r for r in rows if tuple(r[k] for k in keys) == group]
        row: dict[str, Any] = dict(zip(keys, group, strict=True))
        row["status_text"] = _status_text(mine[0]["status"], mine[0]["step"])
        for r in mine:
            for m in _metrics(rows, r["task"]):
                row[f"{r['task']}|{m}"] = _metric(r, m)
        table_rows.append(row)
    return Table(cols, table_rows, "Downstream accuracy per task.")


def _notes(info: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """report.md's lines under the score table: stale and unknown steps, limits that
    were not recorded, task versions, files of earlier settings, runs without results."""
    lines = []
    for label, (steps, ref, newest) in info["stale"].items():
        shown = "newest checkpoint" if ref == newest else "this report shows step"
        extra = "" if ref == newest or newest is None else f" (newest checkpoint {newest})"
        at = ", ".join(str(s) for s in sorted(steps))
        lines.append(
            f"- Stale: `{label}` scored at step {at}; {shown} {ref}{extra}. These scores "
            "are not of the model the tables above describe: run `moelab downstream` on "
            "it again."
        )
    for label in info["unknown"]:
        lines.append(
            f"- Step unknown: `{label}`'s downstream.json records no checkpoint step; "
            "run `moelab downstream` on it again to score its checkpoint."
        )
    for label in info["old_limit"]:
        lines.append(
            f"- `{label}`'s downstream.json was saved before moelab recorded `--limit` "
            "(limit ?): its rows may have been scored on different numbers of documents."
        )
    versions: dict[str, list[str]] = {}
    for r in rows:
        v = r.get("task_version")
        text = "not recorded" if v is None else str(v)
        if text not in versions.setdefault(r["task"], []):
            versions[r["task"]].append(text)
    lines.append(
        "- Task versions (lm-evaluation-harness): "
        + "; ".join(f"`{t}` {', '.join(v)}" for t, v in versions.items())
        + "."
    )
    for label, paths in info["archived"].items():
        lines.append(
            f"- Earlier results of `{label}` (another checkpoint step, `--limit` or task "
            "version) are kept in " + ", ".join(f"`{p}`" for p in paths) + "."
        )
    if info["missing"]:
        lines.append(
            "- No downstream results for " + ", ".join(f"`{m}`" for m in info["missing"]) + "."
        )
    return [*lines, ""]


def downstream_section(rep: ReportBuilder) -> None:
    """Add the downstream section to a report under construction (``moelab report``'s
    :class:`~moelab.report.builder.ReportBuilder`: its entries ``data``, ``md`` lines,
    ``files`` and ``tables``); registered in :data:`moelab.report.builder.SECTIONS`."""
    rows, routing, info = _read_all(rep)
    if not rows:
        return
    scores = rep.tables["downstream"] = _score_table(rows)
    rep.md += [
        "## Downstream tasks",
        "",
        "Saved by `moelab downstream` in each run folder (`downstream.json`), read back "
        "here: accuracy per task (lm-evaluation-harness), each run at each K it was "
        "evaluated with, the checkpoint step it was scored at and its `--limit` (all: "
        "every document; see docs/downstream.md).",
        "",
        scores.markdown(),
        "",
        *_notes(info, rows),
    ]
    if routing:
        for r in routing:
            r["status_text"] = _status_text(r["status"], r["step"])
        rcols: list[tuple[str, str, str]] = [
            ("run", "label", "s"),
            ("K", "top_k", "d"),
            ("step", "step", "d"),
            ("scores", "status_text", "s"),
            ("task", "task", "s"),
            ("tokens", "tokens", ",d"),
            ("active experts", "active_experts", ".3f"),
            ("discarded mass", "discarded_mass", ".4f"),
            ("contributors", "contributors", ".3f"),
            ("load CV", "load_cv", ".3f"),
        ]
        table = rep.tables["downstream_routing"] = Table(rcols, routing)
        rep.md += [
            "Routing statistics of every token of each task's requests (means over the "
            "MoE layers):",
            "",
            table.markdown(),
            "",
        ]
    ks_per: dict[tuple[Any, ...], set[Any]] = {}
    for r in rows:
        ks_per.setdefault((r["label"], r["step"], r["task"]), set()).add(r["top_k"])
    if any(len(v) > 1 for v in ks_per.values()):
        path = plot_accuracy_vs_k(rows, rep.out / "downstream_vs_k.png")
        rep.files.append(path)
        rep.md += ["![downstream accuracy against K](downstream_vs_k.png)", ""]
