"""The text of ``moelab downstream``: the score table (run x K, one column per task and
metric), the routing per task and per MoE layer, the notes and the files saved."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab._format import fmt

__all__ = ["format_downstream", "layer_table", "routing_table", "score_table"]


def _score_columns(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(task, metric) columns: acc and acc_norm where a task has them, and perplexity
    where it has one; a task with none of these: its first metric."""
    cols: list[tuple[str, str]] = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        names = [m for m in ("acc", "acc_norm") if any(r.get(m) is not None for r in mine)]
        extra = [k for r in mine for k in r.get("metrics", {}) if "stderr" not in k]
        if "perplexity" in extra:
            names.append("metrics.perplexity")
        elif not names:
            names = [f"metrics.{extra[0]}"] if extra else ["acc"]
        cols += [(task, m) for m in names]
    return cols


def _value(row: dict[str, Any], metric: str) -> Any:
    if metric.startswith("metrics."):
        return row.get("metrics", {}).get(metric[len("metrics.") :])
    return row.get(metric)


def score_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The score table: header and text cells, one row per (run, K), one column per
    (task, metric)."""
    cols = _score_columns(rows)
    keys = list(dict.fromkeys((r["label"], r["top_k"]) for r in rows))
    header = ["run", "K"] + [f"{t} {m.removeprefix('metrics.')}" for t, m in cols]
    body = []
    for label, k in keys:
        cells = [label, fmt(k, "d")]
        for task, metric in cols:
            hit = [r for r in rows if (r["label"], r["top_k"], r["task"]) == (label, k, task)]
            cells.append(fmt(_value(hit[0], metric), ".4f") if hit else "-")
        body.append(cells)
    return header, body


ROUTING_HEADER = ["run", "K", "task", "tokens", "active", "discarded", "contrib", "load CV"]


def routing_table(routing: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Text cells of the routing-per-task table (means over the MoE layers)."""
    return [
        [
            r["label"],
            fmt(r["top_k"], "d"),
            r["task"],
            fmt(r["tokens"], ",d"),
            fmt(r["active_experts"], ".3f"),
            fmt(r["discarded_mass"], ".4f"),
            fmt(r["contributors"], ".3f"),
            fmt(r["load_cv"], ".3f"),
        ]
        for r in routing
    ]


LAYER_HEADER = ["run", "K", "task", "layer", "active", "discarded", "contrib", "load CV"]


def layer_table(routing: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Text cells of the routing-per-task table per MoE layer."""
    return [
        [
            r["label"],
            fmt(r["top_k"], "d"),
            r["task"],
            str(lay["layer"]),
            fmt(lay["active_experts"], ".3f"),
            fmt(lay["discarded_mass"], ".4f"),
            fmt(lay["contributors"], ".3f"),
            fmt(lay["load_cv"], ".3f"),
        ]
        for r in routing
        for lay in r["layers"]
    ]


def _text_table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    left = {0, 2} if header in (ROUTING_HEADER, LAYER_HEADER) else {0}
    lines = []
    for cells in [header, *body]:
        lines.append(
            "  ".join(
                c.ljust(w) if i in left else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )
    return lines


def format_downstream(result: dict[str, Any]) -> str:
    """The text of ``moelab downstream``: the score table, the routing per task, the
    notes."""
    from moelab.integrations.lm_eval.saved import FILE, describe_limit

    lim = result.get("limit")
    lines = [
        "downstream scores (rows: run x K; accuracy per task"
        + ("" if lim is None else f"; {describe_limit(lim)}")
        + ")"
    ]
    lines += _text_table(*score_table(result["rows"]))
    if result["routing"]:
        lines += ["", "routing per task (means over MoE layers; every token of every request)"]
        lines += _text_table(ROUTING_HEADER, routing_table(result["routing"]))
        if any(len(r["layers"]) > 1 for r in result["routing"]):
            lines += ["", "routing per task and MoE layer"]
            lines += _text_table(LAYER_HEADER, layer_table(result["routing"]))
    if result["notes"]:
        lines += ["", "notes:"] + [f"- {n}" for n in result["notes"]]
    if result.get("saved"):
        steps = {str(Path(i["run"]) / FILE): i["checkpoint_step"] for i in result["runs"]}
        saved = [
            f"{p} (step {steps[p]})" if steps.get(p) is not None else p for p in result["saved"]
        ]
        lines += ["", "saved: " + ", ".join(saved)]
    return "\n".join(lines)
