"""The figures of the ``sparse-maps`` study (:mod:`moelab.studies.sparse_maps`): routing
during training over the seeds, the loss curves, the K sweep and the top-2 gaps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab.studies.core import Arm, Context, Section, SeedCurve, metric_curve, seed_mean

__all__ = ["figures_section", "training_curves", "training_section"]


def training_curves(runs: Sequence[Path], key: str) -> SeedCurve:
    """``key`` of metrics.jsonl (a number logged on training batches) over training
    tokens, for the seeds of one arm: its :class:`~moelab.studies.core.SeedCurve` (x the
    tokens; mean, lowest and highest value) over the seeds at the
    token counts every seed logged (the token counts of rows without the value, or at 0
    tokens, are left out)."""
    from moelab.runs import read_metrics

    return seed_mean([metric_curve(read_metrics(Path(run)), key) for run in runs])


def training_section(ctx: Context, moe: list[Arm]) -> Section:
    from moelab.report import plots

    panels = []
    for key, ylabel, title, what in (
        ("discarded_mass", "discarded mass", "(a) Discarded mass during training", "mass"),
        ("contributors", "contributors K+ per token", "(b) Contributors during training", "K+"),
    ):
        series = []
        for arm in moe:
            xs, mean, lo, hi = training_curves(ctx.runs[arm.name], key)
            if not xs:
                continue
            colour = {"color": f"C{ctx.arms.index(arm) % 10}"}  # as in the other figures
            series.append(plots.Series(arm.label, xs, mean, style=colour))
            if len(ctx.runs[arm.name]) >= 2:  # the lowest and highest seed, unlabelled
                faint = {**colour, "ls": ":", "lw": 0.8}
                series.append(plots.Series(f"_{arm.name} min", xs, lo, style=faint))
                series.append(plots.Series(f"_{arm.name} max", xs, hi, style=faint))
        if series:
            panels.append(plots.Panel(title, ylabel, what, series))
    figures = []
    path = plots.plot_panels(panels, ctx.figure("training_routing"))
    if path is not None:
        figures.append(path)
    seeds = len(ctx.seeds)
    text = (
        "Discarded mass and contributors per token as logged on the training batches "
        "(metrics.jsonl), over training tokens on a log axis (the paper's Figures 2 and 4)"
        + (
            ": the mean over the seeds (solid) between the lowest and the highest seed (dotted)."
            if seeds >= 2
            else "."
        )
    )
    if path is None:
        text += " No run logged them."
    return Section("Routing during training", text, figures=figures)


def figures_section(ctx: Context, full: dict[str, dict[str, Any]]) -> Section:
    """The loss curves, the budget sweep and the top-2 gap histograms of the first seed,
    drawn by moelab.report.plots from collect_run's data."""
    from moelab.report import plots

    data = [full[a.name] for a in ctx.arms if a.name in full]
    figures = []
    loss = plots.loss_panel(data)
    if loss is not None:
        path = plots.plot_panels([loss], ctx.figure("loss_curves"), ncols=1)
        if path is not None:
            figures.append(path)
    # NOTE: every figure gets all the arms, so an arm has one colour throughout (the
    # sweep and the gaps leave out the dense arm, which has neither)
    if any(d.get("sweep") for d in data):
        figures.append(plots.plot_loss_vs_k(data, ctx.figure("loss_vs_k")))
    hist = plots.gap_histograms(data)
    if hist is not None:
        figures.append(plots.plot_gap_histograms(hist, ctx.figure("gaps")))
    text = (
        f"Seed {ctx.seeds[0]}: training and validation loss over training tokens, the NLL "
        "against the inference budget K, and the top-2 score gaps of every MoE layer with "
        "each map's singleton threshold (the paper's Figure 3). `moelab report` on the run "
        "folders gives the full per-run report (loads, certified radii)."
    )
    return Section("Figures", text, figures=figures)
