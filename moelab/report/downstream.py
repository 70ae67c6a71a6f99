"""The downstream section of ``moelab report``: the scores that ``moelab downstream``
saved in each run folder (``RUN/downstream.json``), read back, never recomputed.

Tables: ``downstream`` (rows: run x K, columns: acc and acc_norm per task where the task
has them, else its first metric) and ``downstream_routing`` (routing statistics of each
task's tokens: active experts, discarded mass, contributors, load CV; means over the MoE
layers). Figure ``downstream_vs_k.png``: accuracy against K, one line per run and task,
drawn when some run was evaluated at several K. Runs without the file, and saved
``--hf`` results, are named in a note; without any file the section is left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    """Accuracy (acc, else the task's first metric) against K, one line per run and
    task."""
    from moelab.report import plots

    plt = plots.plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    keys = list(dict.fromkeys((r["label"], r["task"]) for r in rows))
    all_ks: set[int] = set()
    for j, (label, task) in enumerate(keys):
        mine = sorted(
            (r for r in rows if (r["label"], r["task"]) == (label, task) and r["top_k"]),
            key=lambda r: r["top_k"],
        )
        names = _metrics(rows, task)
        if len(mine) < 2 or not names:
            continue
        ks = [r["top_k"] for r in mine]
        ys = [_metric(r, names[0]) for r in mine]
        ys = [float("nan") if y is None else y for y in ys]
        all_ks.update(ks)
        ax.plot(ks, ys, marker="o", label=f"{label}: {task} {names[0]}", color=plots._color(j))
    ax.set_xscale("log", base=2)
    if all_ks:
        ax.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
        ax.minorticks_off()
    ax.set_xlabel("experts per token at inference (K)")
    ax.set_ylabel("accuracy")
    ax.set_title("Downstream accuracy against K")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return plots._save(fig, path)


def downstream_section(rep: Any) -> None:
    """Add the downstream section to a report under construction (``moelab report``'s
    ``_Report``: its entries ``data``, ``md`` lines, ``files`` and ``tables``)."""
    from moelab.report.report import Table

    rows: list[dict[str, Any]] = []
    routing: list[dict[str, Any]] = []
    missing = []
    for d in rep.data:
        doc = None if d.get("result") else read_downstream(d["run"])
        if doc is None:
            missing.append(d["label"])
            continue
        rows += [dict(r, label=d["label"]) for r in doc["rows"]]
        routing += [dict(r, label=d["label"]) for r in doc.get("routing", [])]
    if not rows:
        return
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cols: list[tuple[str, str, str]] = [("run", "label", "s"), ("K", "top_k", "d")]
    for task in tasks:
        cols += [(f"{task} {m}", f"{task}|{m}", ".4f") for m in _metrics(rows, task)]
    table_rows = []
    for label, k in dict.fromkeys((r["label"], r["top_k"]) for r in rows):
        row: dict[str, Any] = {"label": label, "top_k": k}
        for r in rows:
            if (r["label"], r["top_k"]) == (label, k):
                for m in _metrics(rows, r["task"]):
                    row[f"{r['task']}|{m}"] = _metric(r, m)
        table_rows.append(row)
    scores = rep.tables["downstream"] = Table(cols, table_rows, "Downstream accuracy per task.")
    rep.md += [
        "## Downstream tasks",
        "",
        "Saved by `moelab downstream` in each run folder (`downstream.json`), read back "
        "here: accuracy per task (lm-evaluation-harness), each run at each K it was "
        "evaluated with (see docs/downstream.md).",
        "",
        scores.markdown(),
        "",
    ]
    if missing:
        rep.md += [
            "No downstream results for " + ", ".join(f"`{m}`" for m in missing) + ".",
            "",
        ]
    if routing:
        rcols: list[tuple[str, str, str]] = [
            ("run", "label", "s"),
            ("K", "top_k", "d"),
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
    ks_per = {}
    for r in rows:
        ks_per.setdefault((r["label"], r["task"]), set()).add(r["top_k"])
    if any(len(v) > 1 for v in ks_per.values()):
        path = plot_accuracy_vs_k(rows, rep.out / "downstream_vs_k.png")
        rep.files.append(path)
        rep.md += ["![downstream accuracy against K](downstream_vs_k.png)", ""]
