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

__all__ = [
    "plot_allocation",
    "plot_gaps",
    "plot_load",
    "plot_loss_vs_k",
    "plot_nll_vs_active",
    "plot_radii",
    "plot_temperature",
    "plot_training_curves",
]

_DPI = 110


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _tokens_axis(ax: Any, ylabel: str, title: str, drawn: bool, empty: str, **legend: Any) -> None:
    """Finish a panel whose x axis is training tokens (log): labels, grid, and a legend
    when something was drawn, else the note ``empty``."""
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3, which="both")
    if drawn:
        ax.legend(**legend)
    else:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)


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
        _tokens_axis(ax, ylabel, title, drawn, "no routing metrics")
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


def _finite(v: Any) -> bool:
    """True when ``v`` is a real number that is neither None nor NaN/inf."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _layer_rows(run: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The logged rows of a run that carry a per-layer list under ``key`` and a positive
    token count (evaluation-only rows and rows without the key are skipped)."""
    return [
        m
        for m in run.get("metrics", [])
        if isinstance(m.get(key), (list, tuple))
        and m[key]
        and _finite(m.get("tokens"))
        and m["tokens"] > 0
    ]


def _layer_series(rows: Sequence[dict[str, Any]], key: str, i: int) -> tuple[list, list]:
    """Tokens and values of layer ``i`` of ``key``; None/NaN values are skipped."""
    xs, ys = [], []
    for m in rows:
        vals = m.get(key)
        if isinstance(vals, (list, tuple)) and i < len(vals) and _finite(vals[i]):
            xs.append(m["tokens"])
            ys.append(float(vals[i]))
    return xs, ys


def _layer_stats(rows: Sequence[dict[str, Any]], key: str) -> tuple[list, list, list, list]:
    """Tokens and the mean, min and max over layers of ``key`` per row (None/NaN layer
    values are left out; rows with no finite value are skipped)."""
    xs, mean, lo, hi = [], [], [], []
    for m in rows:
        vals = [float(v) for v in m[key] if _finite(v)]
        if not vals:
            continue
        xs.append(m["tokens"])
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return xs, mean, lo, hi


def plot_allocation(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Learned per-layer budget k_l (solid) and measured active experts (dashed, same
    colour) over training tokens (log x), one panel per run with ``k_layers``; the uniform
    start K / L (mean k_l of the first row) as a dotted black line. A run marked
    ``"truncating": True`` without ``k_layers`` (a fixed k) gets a panel of its active
    experts per layer, with its ``"budget_k"`` dotted. None when no run has such data
    (nothing written)."""
    panels = []
    for r in runs:
        rows = _layer_rows(r, "k_layers")
        if rows:
            panels.append((r, rows))
        elif r.get("truncating") and _layer_rows(r, "active_layers"):
            panels.append((r, []))
    if not panels:
        return None
    n = len(panels)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 3.6 * nrows), squeeze=False)
    for j, ax in enumerate(axes.flat):
        if j >= n:
            ax.axis("off")
            continue
        r, rows = panels[j]
        active_rows = _layer_rows(r, "active_layers")
        learned = bool(rows)
        key = "k_layers" if learned else "active_layers"
        n_layers = max(len(m[key]) for m in (rows or active_rows))
        drawn = False
        for i in range(n_layers):
            color = f"C{i % 10}"
            xs, ys = _layer_series(rows, "k_layers", i)
            if xs:
                ax.plot(xs, ys, color=color, ls="-", label=f"k_l layer {i}")
                drawn = True
            xs, ys = _layer_series(active_rows, "active_layers", i)
            if xs:
                ax.plot(xs, ys, color=color, ls="--", label=f"active layer {i}")
                drawn = True
        start = [float(v) for v in rows[0]["k_layers"] if _finite(v)] if learned else []
        if start:
            ax.axhline(sum(start) / len(start), color="k", ls=":", lw=1, label="K / L")
        elif _finite(r.get("budget_k")):
            ax.axhline(float(r["budget_k"]), color="k", ls=":", lw=1, label="k")
        title = f"Learned allocation: {r['label']}" if learned else f"Fixed k: {r['label']}"
        _tokens_axis(
            ax,
            "experts per token",
            title,
            drawn,
            "no allocation metrics",
            fontsize="small",
            ncol=2 if n_layers > 2 else 1,
        )
    return _save(fig, path)


def plot_temperature(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Router temperature (mean over layers, left) and gate Lipschitz constant
    ||W||_2 / (2 tau) (mean over layers, min-max band, right) over training tokens (log x),
    one line per run. None when no run logged either (nothing written)."""
    tau = [(r, rows) for r in runs if (rows := _layer_rows(r, "tau_layers"))]
    lip = [(r, rows) for r in runs if (rows := _layer_rows(r, "lipschitz_layers"))]
    if not tau and not lip:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    panels = (
        (tau, "tau_layers", "router temperature tau (mean over layers)", "Router temperature"),
        (
            lip,
            "lipschitz_layers",
            "||W||_2 / (2 tau) (mean, min-max over layers)",
            "Gate Lipschitz constant ||W||_2 / (2 tau)",
        ),
    )
    for ax, (found, key, ylabel, title) in zip(axes, panels, strict=True):
        drawn = False
        positive = True
        for r, rows in found:
            xs, mean, lo, hi = _layer_stats(rows, key)
            if not xs:
                continue
            (line,) = ax.plot(xs, mean, label=r["label"])
            if key == "lipschitz_layers":
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
                positive = positive and min(lo) > 0
            drawn = True
        if key == "lipschitz_layers" and drawn and positive:
            ax.set_yscale("log")
        _tokens_axis(ax, ylabel, title, drawn, "no router metrics")
    return _save(fig, path)


def plot_radii(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Overlaid histograms (log-spaced bins, log x) of the positive certified top-1 radii
    relative to the token norm, one per run with radii; each run's median (zeros included)
    as a dotted line, its median and share of exact zeros (ties) in the legend. The bins
    span the 0.5th percentile to the maximum of all positive radii, so the smallest 0.5%
    fall outside them. None when no run has radii (nothing written)."""
    found = []
    for r in runs:
        radii = r.get("radii")
        if radii is None:
            continue
        radii = np.asarray(radii, dtype=float).ravel()
        radii = radii[np.isfinite(radii)]
        if radii.size:
            found.append((r["label"], radii))
    if not found:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pos_all = np.concatenate([radii[radii > 0] for _, radii in found])
    bins = None
    if pos_all.size:
        lo = float(np.percentile(pos_all, 0.5))
        hi = float(pos_all.max())
        if hi <= lo:
            lo, hi = lo / 2, hi * 2
        bins = np.geomspace(lo, hi, 61)
    for j, (label, radii) in enumerate(found):
        color = f"C{j % 10}"
        med = float(np.median(radii))
        zero = 100.0 * float((radii == 0).mean())
        text = f"{label} (median {med:.3g}, {zero:.1f}% zero)"
        pos = radii[radii > 0]
        if pos.size and bins is not None:
            ax.hist(
                pos,
                bins=bins,
                histtype="step",
                lw=1.5,
                color=color,
                label=text,
            )
        else:
            ax.plot([], [], color=color, lw=1.5, label=text)
        if med > 0:
            ax.axvline(med, color=color, ls=":", lw=1.5)
    if bins is not None:
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "all radii are zero", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("certified top-1 radius / token norm")
    ax.set_ylabel("token-layer states")
    ax.set_title("Certified top-1 radii")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_nll_vs_active(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Validation NLL against the active experts per token of each inference-time budget:
    the K sweep of top-k runs (circles) and the threshold sweep of truncating runs
    (squares), one line per run, the trained budget ringed. None when no run has a
    sweep."""
    curves = []
    for r in runs:
        for key, trained_key, value, marker in (
            ("sweep", "trained_top_k", "top_k", "o"),
            ("truncation", None, "threshold_scale", "s"),
        ):
            doc = r.get(key)
            if not doc:
                continue
            rows = [x for x in doc["results"] if x.get("active_experts") is not None]
            trained = doc[trained_key] if trained_key else 1.0
            curves.append((r["label"], rows, value, trained, marker))
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, rows, value, trained, marker in curves:
        rows = sorted(rows, key=lambda x: x["active_experts"])
        xs = [x["active_experts"] for x in rows]
        ys = [x["nll"] for x in rows]
        (line,) = ax.plot(xs, ys, marker=marker, label=label)
        for x in rows:
            if x[value] == trained:
                ax.plot(
                    [x["active_experts"]],
                    [x["nll"]],
                    marker,
                    ms=12,
                    mfc="none",
                    color=line.get_color(),
                )
    ax.set_xlabel("active experts per token at inference")
    ax.set_ylabel("validation NLL (nats / token)")
    ax.set_title("Budget sweeps: K (circles), threshold scale (squares)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)
