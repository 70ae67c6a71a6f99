"""The report's figures (matplotlib, Agg backend: no display needed).

Every function takes plain data (what :mod:`moelab.report.report` collects), writes one
PNG and returns its path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["plot_gaps", "plot_load", "plot_loss_vs_k", "plot_training_curves"]

_DPI = 110


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_loss_vs_k(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """NLL against K, one line per run; the trained K is marked with a larger dot."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = False
    for r in runs:
        sweep = r.get("sweep")
        if not sweep:
            continue
        ks = [row["top_k"] for row in sweep["results"]]
        nll = [row["nll"] for row in sweep["results"]]
        (line,) = ax.plot(ks, nll, marker="o", label=r["label"])
        trained = sweep["trained_top_k"]
        if trained in ks:
            i = ks.index(trained)
            ax.plot([trained], [nll[i]], "o", ms=11, mfc="none", color=line.get_color())
        drawn = True
    ax.set_xscale("log", base=2)
    all_ks = sorted({row["top_k"] for r in runs if r.get("sweep") for row in r["sweep"]["results"]})
    if all_ks:
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.minorticks_off()
    ax.set_xlabel("experts per token at inference (K)")
    ax.set_ylabel("validation NLL (nats / token)")
    ax.set_title("Inference-time budget sweep (ring: trained K)")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no MoE runs", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_gaps(
    label: str,
    gaps: np.ndarray,
    threshold: float | None,
    map_desc: str,
    path: Path,
) -> Path:
    """Histogram of the top-2 score gaps z(1) - z(2) of one run (all MoE layers), with
    the map's singleton threshold as a dashed line, annotated with the share at or
    above it."""
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    finite = gaps[np.isfinite(gaps)]
    if finite.size:
        hi = float(np.percentile(finite, 99.5))
        if threshold is not None:
            hi = max(hi, threshold * 1.2)
        hi = max(hi, 1e-3)
        ax.hist(np.clip(finite, 0, hi), bins=60, range=(0, hi), color="tab:blue", alpha=0.8)
    ax.set_xlabel("top-2 score gap  z(1) - z(2)")
    ax.set_ylabel("token-layer states")
    ax.set_title(f"Top-2 score gaps: {label} ({map_desc})")
    if threshold is not None and finite.size:
        frac = float((finite >= threshold).mean())
        ax.axvline(threshold, color="tab:red", ls="--", lw=1.5, label=f"threshold {threshold:g}")
        ax.annotate(
            f"{100 * frac:.1f}% at or above\n(singletons)",
            xy=(threshold, 0.85),
            xycoords=("data", "axes fraction"),
            xytext=(6, 0),
            textcoords="offset points",
            color="tab:red",
            bbox={"boxstyle": "round", "fc": "white", "ec": "tab:red", "alpha": 0.9},
        )
        ax.legend(loc="upper right")
    elif finite.size:
        ax.text(
            0.97,
            0.9,
            "no singleton threshold\n(dense map)",
            ha="right",
            va="top",
            transform=ax.transAxes,
        )
    else:
        ax.text(0.5, 0.5, "no gaps", ha="center", va="center", transform=ax.transAxes)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_training_curves(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """Discarded mass and active experts over training tokens (log x), one line per run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    keys = (
        ("discarded_mass", "discarded map mass", "Discarded mass during training"),
        ("active_experts", "active experts per token", "Active experts during training"),
    )
    for ax, (key, ylabel, title) in zip(axes, keys, strict=True):
        drawn = False
        for r in runs:
            rows = [m for m in r.get("metrics", []) if key in m and m.get("tokens")]
            if not rows:
                continue
            ax.plot([m["tokens"] for m in rows], [m[key] for m in rows], label=r["label"])
            drawn = True
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3, which="both")
        if drawn:
            ax.legend()
        else:
            ax.text(
                0.5, 0.5, "no routing metrics", ha="center", va="center", transform=ax.transAxes
            )
    return _save(fig, path)


def plot_load(label: str, layers: Sequence[dict[str, Any]], path: Path) -> Path:
    """Expert load shares per MoE layer (bars), uniform share as a dashed line."""
    n = max(len(layers), 1)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(layers):
            ax.axis("off")
            continue
        lay = layers[i]
        shares = lay.get("load_shares")
        ax.set_title(f"layer {lay['layer']} (block {lay.get('block', '?')})")
        ax.set_xlabel("expert")
        ax.set_ylabel("share of computed slots")
        if shares:
            e = len(shares)
            ax.bar(range(e), shares, color="tab:green", label="load share")
            ax.axhline(1.0 / e, color="k", ls="--", lw=1, label=f"uniform 1/{e}")
            ax.set_xticks(range(e))
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no load", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"Expert load per layer: {label}")
    return _save(fig, path)
