"""The figures of the ``temperature`` study (:mod:`moelab.studies.temperature`):
validation perplexity, load shares, certified radii, and tau with ||W||_2 over training."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moelab.studies.core import (
    Arm,
    Context,
    Section,
    metric_curve,
    seed_mean,
)
from moelab.studies.temperature.grid import SCHEDULE

# ------------------------------------------------------------------------------ figures


def metrics_rows(run: Path) -> list[dict[str, Any]]:
    from moelab.runs import read_metrics

    return read_metrics(run)


def _plt() -> Any:
    import matplotlib.pyplot as plt

    from moelab.report import plots  # noqa: F401  (selects the Agg backend)

    return plt


def _colour(ctx: Context, arm: Arm) -> str:
    """The arm's colour, the same in every figure (its place among the study's arms)."""
    return f"C{ctx.arms.index(arm) % 10}"


def plot_val_ppl(ctx: Context, path: Path) -> Path | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = False
    for arm in ctx.arms:
        per = [metric_curve(metrics_rows(run), "val_loss", x="step") for run in ctx.runs[arm.name]]
        per = [(steps, [math.exp(v) for v in loss]) for steps, loss in per]
        steps, mean, lo, hi = seed_mean(per)
        if not steps:
            continue
        ax.plot(steps, mean, marker="o", ms=3, color=_colour(ctx, arm), label=arm.label)
        if len(per) > 1:
            ax.fill_between(steps, lo, hi, color=_colour(ctx, arm), alpha=0.2, lw=0)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Validation perplexity during training")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load_shares(
    ctx: Context, results: dict[str, list[dict[str, Any]]], moe: list[Arm], path: Path
) -> Path | None:
    per_arm = []
    for arm in moe:
        seeds = []
        for r in results[arm.name]:
            layers = [sorted(s, reverse=True) for s in r["load_shares"] if s]
            if layers:
                seeds.append(np.mean(layers, axis=0))
        if seeds:
            mean, sd = np.mean(seeds, axis=0), np.std(seeds, axis=0, ddof=0)
            per_arm.append((arm.label, _colour(ctx, arm), mean, sd))
    if not per_arm:
        return None
    plt = _plt()
    n_e = len(per_arm[0][2])
    width = 0.8 / len(per_arm)
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for j, (label, colour, mean, sd) in enumerate(per_arm):
        xs = np.arange(n_e) + (j - (len(per_arm) - 1) / 2) * width
        ax.bar(xs, mean * 100, width, yerr=sd * 100, color=colour, label=label)
    ax.axhline(100.0 / n_e, color="k", ls="--", lw=1, label=f"uniform, {100 / n_e:.1f}%")
    ax.set_xticks(range(n_e))
    ax.set_xticklabels([f"#{i + 1}" for i in range(n_e)])
    ax.set_xlabel("expert, by load (largest first)")
    ax.set_ylabel("share of computed slots (%)")
    ax.set_title("Load share per expert (validation)")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_radii(
    ctx: Context, results: dict[str, list[dict[str, Any]]], moe: list[Arm], path: Path
) -> Path | None:
    from moelab.report.plots import plot_radii

    # NOTE: every arm in order (the dense one without radii), so that each arm keeps
    # its colour of the other figures
    runs = [
        {
            "label": arm.label,
            "radii": np.concatenate([r["radii"] for r in results[arm.name]])
            if arm in moe
            else None,
        }
        for arm in ctx.arms
    ]
    return plot_radii(runs, path)


def plot_tau_norm(
    ctx: Context,
    moe: list[Arm],
    path: Path,
    schedule: tuple[float, float],
    traces: Sequence[Mapping[str, Any]] = (),
) -> Path | None:
    """tau, ||W||_2 and L over training; ``schedule``: the scale's (L*, tau_min)."""
    l_star, tau_min = schedule
    plt = _plt()
    panels = (
        ("router temperature τ", lambda t, lip: t),
        ("spectral norm ‖W‖₂", lambda t, lip: 2.0 * t * lip),
        ("Lipschitz constant ‖W‖₂/(2τ)", lambda t, lip: lip),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15.0, 4.0))
    drawn = False
    for arm in moe:
        curves: list[list[dict[int, float]]] = [[], [], []]
        for run in ctx.runs[arm.name]:
            rows = [r for r in metrics_rows(run) if "tau_layers" in r and "lipschitz_layers" in r]
            for p, (_, fn) in enumerate(panels):
                curves[p].append(
                    {
                        int(r["step"]): float(
                            np.mean(
                                [
                                    fn(t, lip)
                                    for t, lip in zip(
                                        r["tau_layers"], r["lipschitz_layers"], strict=True
                                    )
                                ]
                            )
                        )
                        for r in rows
                    }
                )
        for ax, per in zip(axes, curves, strict=True):
            steps, mean, lo, hi = seed_mean([(list(c), list(c.values())) for c in per])
            if not steps:
                continue
            ax.plot(steps, mean, color=_colour(ctx, arm), label=arm.label)
            if len(per) > 1:
                ax.fill_between(steps, lo, hi, color=_colour(ctx, arm), alpha=0.2, lw=0)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, (title, _) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    axes[0].axhline(tau_min, color="grey", ls="--", lw=1, label=f"τ_min = {tau_min:g}")
    axes[1].axhline(
        2 * l_star * tau_min,
        color="grey",
        ls="--",
        lw=1,
        label=f"2 L* τ_min = {2 * l_star * tau_min:g} (τ leaves τ_min above)",
    )
    axes[2].axhline(l_star, color="k", ls="--", lw=1, label=f"L* = {l_star:g} (target)")
    left = [t["left"] for t in traces if t["left"] is not None]
    if left:
        step = sum(left) / len(left)
        for i, ax in enumerate(axes):
            ax.axvline(
                step,
                color="k",
                ls=":",
                lw=1,
                label=f"τ leaves τ_min (step {step:.0f})" if i == 0 else None,
            )
    elif traces:
        axes[0].set_title("router temperature τ (held at τ_min the whole run)")
    for ax in axes:
        ax.legend(fontsize="small")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures_section(
    ctx: Context,
    results: dict[str, list[dict[str, Any]]],
    moe: list[Arm],
    traces: Sequence[Mapping[str, Any]] = (),
) -> Section:
    figures = [
        plot_val_ppl(ctx, ctx.figure("temperature-val-ppl")),
        plot_load_shares(ctx, results, moe, ctx.figure("temperature-load-share")),
        plot_radii(ctx, results, moe, ctx.figure("temperature-radii")),
        plot_tau_norm(ctx, moe, ctx.figure("temperature-tau-norm"), SCHEDULE[ctx.scale], traces),
    ]
    text = (
        "Validation perplexity over training steps (mean over seeds, band: min to max); "
        "the share of computed slots per expert (experts sorted by load in each layer, "
        "mean over layers and seeds; error bars: sd over seeds); the certified top-1 "
        "radius r = √2 τ m(x)/‖W‖₂ (Corollary 1) relative to the token's norm, pooled "
        "over layers and seeds; and τ, ‖W‖₂ = 2τ · (‖W‖₂/(2τ)) and the gate's Lipschitz "
        "constant over training (metrics.jsonl; mean over layers and seeds), with "
        "τ_min, the norm 2 L* τ_min above which the schedule leaves it, L* and the "
        "step where the lipschitz arm's τ first left τ_min (dotted; mean over seeds)."
    )
    return Section("Figures", text, figures=[f for f in figures if f is not None])
