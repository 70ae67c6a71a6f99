"""The figures of the ``softmoe`` study (:mod:`moelab.studies.softmoe`): every layer's
learned k_l over training (the paper's Figure 6) and k_l beside the measured active
experts per layer.

Shape suffixes: L (moelab.shapes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moelab.runs.layout import CONFIG
from moelab.studies.core import Context
from moelab.studies.softmoe.run import k_layer_series, metrics_rows

__all__ = ["allocation_figure", "k_figure"]


def k_figure(ctx: Context, info: dict[str, dict[str, Any]]) -> Path | None:
    """The paper's Figure 6: every layer's k_l over training steps, one panel per seed of
    each learned-allocation arm, with the bounds 1 and K − L + 1 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for arm in ctx.arms:
        if info[arm.name]["kind"] != "learned":
            continue
        for seed, run in zip(ctx.seeds, ctx.runs[arm.name], strict=True):
            steps, k_L = k_layer_series(run)
            if steps:
                meta = info[arm.name]
                title = f"{meta['model']} k={meta['k']:g}, α={meta['alpha']:g}, seed {seed}"
                panels.append((title, steps, k_L))
    if not panels:
        return None
    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for j, ax in enumerate(axes.flat):
        if j >= n:
            ax.axis("off")
            continue
        title, steps, k_L = panels[j]
        for i, ks in enumerate(k_L):
            ax.plot(steps, ks, color=f"C{i % 10}", label=f"layer {i}")
        start = sum(k[0] for k in k_L) / len(k_L)
        ax.axhline(start, color="k", ls=":", lw=1, label="K / L")
        # the bounds of k_l = softmax(eta)_l (K - L) + 1: 1 and K - L + 1
        top = sum(k[0] for k in k_L) - len(k_L) + 1
        for bound in (1.0, top):
            ax.axhline(bound, color="0.5", ls="--", lw=0.8)
        ax.text(steps[0], top, " K − L + 1", va="bottom", fontsize="x-small", color="0.4")
        ax.set_xlabel("training step")
        ax.set_ylabel("k_l (mean active experts)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", ncol=2 if len(k_L) > 4 else 1)
    fig.tight_layout()
    path = ctx.figure("softmoe_k_layers")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def allocation_figure(ctx: Context, info: dict[str, dict[str, Any]]) -> Path | None:
    """k_l of every layer over training (the learned arm) beside the measured active
    experts per layer of SoftMoE* (seed 0 of each; k = 2, alpha = 2)."""
    from moelab.report.plots import plot_allocation

    runs = []
    for arm in ctx.arms:
        meta = info[arm.name]
        if not meta["sweep"]:  # SoftMoE* and SoftMoE k = 2, alpha = 2
            continue
        run = ctx.runs[arm.name][0]
        metrics = metrics_rows(run)
        cfg = _read_config(run)
        tokens_per_step = cfg.get("batch_size", 1) * cfg.get("seq_len", 1)
        for m in metrics:
            m.setdefault("tokens", m["step"] * tokens_per_step)
        runs.append(
            {
                "label": f"{meta['model']}, seed {ctx.seeds[0]}",
                "metrics": metrics,
                "truncating": True,
                "budget_k": meta["budget_k"],
            }
        )
    if not runs:
        return None
    return plot_allocation(runs, ctx.figure("softmoe_allocation"))


def _read_config(run: Path) -> dict[str, Any]:
    import json

    path = run / CONFIG
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
