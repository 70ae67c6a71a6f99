"""The figure of the ``gate-norm`` study (:mod:`moelab.studies.gate_norm`): validation
loss, active experts per token and load CV over training tokens, per arm."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from moelab.runs.layout import CONFIG
from moelab.studies.core import Context, metric_curve, seed_mean

__all__ = ["mean_over_seeds", "training_figure"]


def mean_over_seeds(curves: Sequence[tuple[list[float], list[float]]]) -> tuple[list, list]:
    """The mean over seeds of curves (x, y) at the x values every seed has."""
    xs, mean, _, _ = seed_mean(curves)
    return xs, mean


def _tokens_per_step(run: Path) -> float | None:
    try:
        cfg = json.loads((run / CONFIG).read_text(encoding="utf-8"))
        return float(cfg["batch_size"]) * float(cfg["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def training_figure(ctx: Context) -> Path | None:
    """Validation loss, active experts per token and load CV over training tokens, each
    the mean over the seeds of every arm (from RUN/metrics.jsonl)."""
    from moelab.report import plots
    from moelab.runs import read_metrics

    panels_data: dict[str, list[plots.Series]] = {"val": [], "active_experts": [], "load_cv": []}
    for j, arm in enumerate(ctx.arms):
        runs = ctx.runs[arm.name]
        metrics = [read_metrics(r) for r in runs]
        style = {"color": f"C{j % 10}"}
        val = mean_over_seeds(
            [
                plots.loss_curves(m, _tokens_per_step(r))["val"]
                for m, r in zip(metrics, runs, strict=True)
            ]
        )
        if val[0]:
            style_v = {**style, "marker": "o", "ms": 3}
            panels_data["val"].append(plots.Series(arm.label, val[0], val[1], style=style_v))
        for key in ("active_experts", "load_cv"):
            xs, ys = mean_over_seeds([metric_curve(m, key) for m in metrics])
            if xs:
                panels_data[key].append(plots.Series(arm.label, xs, ys, style=style))
    titles = {
        "val": ("Validation loss", "loss (nats / token)", "the validation loss"),
        "active_experts": (
            "Active experts during training",
            "active experts per token",
            "the active experts per token",
        ),
        "load_cv": ("Load CV during training", "load CV (std / mean)", "the load CV"),
    }
    panels = [plots.Panel(*titles[key], series) for key, series in panels_data.items() if series]
    return plots.plot_panels(panels, ctx.figure("gate-norm-training"), ncols=3)
