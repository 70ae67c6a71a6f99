"""The report's figures (matplotlib, Agg backend: no display needed).

Each figure is two steps: a pure function turns what :mod:`moelab.report.report` collects
into plain data (:class:`Panel` and :class:`Series` for curves over training tokens,
:func:`gap_histograms` for the gap histograms), and a ``plot_*`` function draws that data
into one PNG and returns its path. Tests check the data; the figure draws exactly it.
The curves over training tokens (:class:`Panel`, :class:`Series`, the report's panels and
:func:`plot_panels`) live in :mod:`moelab.report.panels` and are importable from here.

Titles name what a panel shows, never its marks: which line is which (solid, dashed,
ringed, ...) is in the legend, built from what was drawn.
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

from moelab._format import fmt
from moelab.report.panels import FLAT_RTOL as FLAT_RTOL
from moelab.report.panels import (
    Panel,
    Series,
    is_finite,
    layer_rows,
    layer_series,
    line_color,
    loss_curves,
    loss_panel,
    plot_panels,
    save_figure,
    temperature_panels,
    tokens_axis,
    training_panels,
)

__all__ = [
    "Panel",
    "Series",
    "gap_histograms",
    "loss_curves",
    "loss_panel",
    "plot_active_hist",
    "plot_allocation",
    "plot_gap_histograms",
    "plot_load",
    "plot_loss_vs_k",
    "plot_nll_vs_active",
    "plot_panels",
    "plot_radii",
    "temperature_panels",
    "training_panels",
]


def _ring_entry(ax: Any, marker: str, label: str) -> None:
    """A grey legend entry for the rings that mark the trained budget."""
    ax.plot([], [], marker, ms=11, mfc="none", color="grey", ls="none", label=label)


def plot_loss_vs_k(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """NLL against K, one line per run; the trained K is ringed (with a legend entry
    when a ring is drawn)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = ringed = False
    for j, r in enumerate(runs):
        sweep = r.get("sweep")
        if not sweep:
            continue
        ks = [row["top_k"] for row in sweep["results"]]
        nll = [row["nll"] for row in sweep["results"]]
        ax.plot(ks, nll, marker="o", label=r["label"], color=line_color(j))
        trained = sweep["trained_top_k"]
        if trained in ks:
            i = ks.index(trained)
            ax.plot([trained], [nll[i]], "o", ms=11, mfc="none", color=line_color(j))
            ringed = True
        drawn = True
    if ringed:
        _ring_entry(ax, "o", "trained K")
    ax.set_xscale("log", base=2)
    all_ks = sorted({row["top_k"] for r in runs if r.get("sweep") for row in r["sweep"]["results"]})
    if all_ks:
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.minorticks_off()
    ax.set_xlabel("experts per token at inference (K)")
    ax.set_ylabel("validation NLL (nats / token)")
    ax.set_title("Inference-time budget sweep")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no MoE runs", ha="center", va="center", transform=ax.transAxes)
    return save_figure(fig, path)


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
        block = lay.get("block")  # saved HF statistics have no block
        ax.set_title(f"layer {lay['layer']}" + ("" if block is None else f" (block {block})"))
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
    return save_figure(fig, path)


def plot_active_hist(label: str, shares: Sequence[Sequence[float]], path: Path) -> Path:
    """The distribution of active experts per token, per MoE layer (the SoftMoE paper's
    Figure 1): ``shares[l][n]``, the share of tokens computing n experts at layer l
    (:func:`moelab.diagnostics.active_histograms` with ``shares=True``), as bars grouped
    by n, one colour per layer."""
    n_layers = max(len(shares), 1)
    width = len(shares[0]) if shares else 1
    fig, ax = plt.subplots(figsize=(max(4.5, 0.9 * width + 2.5), 3.4))
    bar = 0.8 / n_layers
    x = np.arange(width)
    for i, row in enumerate(shares):
        ax.bar(x - 0.4 + bar * (i + 0.5), row, bar, color=line_color(i), label=f"layer {i}")
    ax.set_xticks(x)
    ax.set_xlabel("experts computed per token")
    ax.set_ylabel("share of tokens")
    ax.set_ylim(0.0, 1.0)
    if shares:
        ax.legend(fontsize="small", ncols=min(n_layers, 5))
    ax.set_title(f"Active experts per token: {label}")
    return save_figure(fig, path)


def plot_allocation(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Learned per-layer budget k_l (solid) and measured active experts (dashed, same
    colour) over training tokens (log x), one panel per run with ``k_layers``; the uniform
    start K / L (mean k_l of the first row) as a dotted black line. A run marked
    ``"truncating": True`` without ``k_layers`` (a fixed k) gets a panel of its active
    experts per layer, with its ``"budget_k"`` dotted. None when no run has such data
    (nothing written)."""
    panels = []
    for r in runs:
        rows = layer_rows(r, "k_layers")
        if rows:
            panels.append((r, rows))
        elif r.get("truncating") and layer_rows(r, "active_layers"):
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
        active_rows = layer_rows(r, "active_layers")
        learned = bool(rows)
        key = "k_layers" if learned else "active_layers"
        n_layers = max(len(m[key]) for m in (rows or active_rows))
        drawn = False
        for i in range(n_layers):
            color = f"C{i % 10}"
            xs, ys = layer_series(rows, "k_layers", i)
            if xs:
                ax.plot(xs, ys, color=color, ls="-", label=f"k_l layer {i}")
                drawn = True
            xs, ys = layer_series(active_rows, "active_layers", i)
            if xs:
                ax.plot(xs, ys, color=color, ls="--", label=f"active layer {i}")
                drawn = True
        start = [float(v) for v in rows[0]["k_layers"] if is_finite(v)] if learned else []
        if start:
            ax.axhline(sum(start) / len(start), color="k", ls=":", lw=1, label="K / L")
        elif is_finite(r.get("budget_k")):
            ax.axhline(float(r["budget_k"]), color="k", ls=":", lw=1, label="k")
        title = f"Learned allocation: {r['label']}" if learned else f"Fixed k: {r['label']}"
        tokens_axis(
            ax,
            "experts per token",
            title,
            drawn,
            "no allocation metrics",
            fontsize="small",
            ncol=2 if n_layers > 2 else 1,
        )
    return save_figure(fig, path)


def plot_radii(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Overlaid histograms (log-spaced bins, log x) of the positive certified top-1 radii
    relative to the token norm, one per run with radii; each run's median (zeros included)
    as a dotted line, its median and share of exact zeros (ties) in the legend. The bins
    span the 0.5th percentile to the maximum of all positive radii; the share of each run
    below them is counted in its legend entry. None when no run has radii (nothing
    written)."""
    found = []
    for j, r in enumerate(runs):
        radii = r.get("radii")
        if radii is None:
            continue
        radii = np.asarray(radii, dtype=float).ravel()
        radii = radii[np.isfinite(radii)]
        if radii.size:
            found.append((j, r["label"], radii))
    if not found:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pos_all = np.concatenate([radii[radii > 0] for _, _, radii in found])
    bins = None
    if pos_all.size:
        lo = float(np.percentile(pos_all, 0.5))
        hi = float(pos_all.max())
        if hi <= lo:
            lo, hi = lo / 2, hi * 2
        bins = np.geomspace(lo, hi, 61)
    medians = False
    for j, label, radii in found:
        color = line_color(j)
        med = float(np.median(radii))
        parts = [f"median {fmt(med, '.3g')}", f"{share_text(float((radii == 0).mean()))} zero"]
        pos = radii[radii > 0]
        below = int((pos < bins[0]).sum()) if bins is not None else 0
        if below:
            parts.append(f"{share_text(below / radii.size)} < {fmt(bins[0], '.2g')}")
        text = f"{label} ({', '.join(parts)})"
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
        if med > 0 and bins is not None:
            ax.axvline(med, color=color, ls=":", lw=1.5)
            medians = True
    if medians:
        ax.plot([], [], color="grey", ls=":", lw=1.5, label="median")
    if bins is not None:
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "all radii are zero", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("certified top-1 radius / token norm")
    ax.set_ylabel("token-layer states")
    ax.set_title("Certified top-1 radii")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return save_figure(fig, path)


def plot_nll_vs_active(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Validation NLL against the active experts per token of each inference-time budget:
    the K sweep of top-k runs (circles) and the threshold sweep of truncating runs
    (squares), one line per run named by its sweep in the legend, the trained budget
    ringed (with a legend entry when a ring is drawn). None when no run has a sweep."""
    curves = []
    for j, r in enumerate(runs):
        for key, trained_key, value, marker, kind in (
            ("sweep", "trained_top_k", "top_k", "o", "K"),
            ("truncation", None, "threshold_scale", "s", "threshold scale"),
        ):
            doc = r.get(key)
            if not doc:
                continue
            rows = [x for x in doc["results"] if x.get("active_experts") is not None]
            trained = doc[trained_key] if trained_key else 1.0
            curves.append((f"{r['label']} ({kind})", rows, value, trained, marker, line_color(j)))
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ringed = False
    for label, rows, value, trained, marker, color in curves:
        rows = sorted(rows, key=lambda x: x["active_experts"])
        xs = [x["active_experts"] for x in rows]
        ys = [x["nll"] for x in rows]
        ax.plot(xs, ys, marker=marker, label=label, color=color)
        for x in rows:
            if x[value] == trained:
                ax.plot([x["active_experts"]], [x["nll"]], marker, ms=12, mfc="none", color=color)
                ringed = True
    if ringed:
        _ring_entry(ax, "o", "trained budget")
    ax.set_xlabel("active experts per token at inference")
    ax.set_ylabel("validation NLL (nats / token)")
    ax.set_title("Budget sweeps against active experts")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


# --- top-2 gap histograms ------------------------------------------------------------

MAX_GAP_PANELS = 4
"""At most this many gap panels: one per MoE layer, or groups of layers by depth."""

GAP_QUANTILE = 99.0
"""The shared x range reaches this percentile of all gaps (and past every threshold),
rounded up to a round number; the share beyond it is counted in each legend."""


def _nice_ceil(x: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is at
    least ``x`` (1 for a non-positive ``x``)."""
    if not (math.isfinite(x) and x > 0):
        return 1.0
    e = math.floor(math.log10(x))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        v = round(m * 10.0**e, 12)
        if v >= x:
            return v
    return round(10.0 ** (e + 1), 12)


def share_text(frac: float) -> str:
    """A share as a percentage with one decimal; "<0.1%" for a positive share that would
    print as 0.0%."""
    pct = 100.0 * frac
    return "<0.1%" if 0 < pct < 0.05 else f"{fmt(pct, '.1f')}%"


def _gap_groups(
    found: Sequence[dict[str, Any]], max_panels: int
) -> tuple[list[tuple[str, dict[str, list[int]]]], bool]:
    """Panels as (title, {run label: indices of its MoE layers}), and whether they are
    groups by depth: one panel per MoE layer when every run has the same MoE blocks (at
    most ``max_panels``), else up to ``max_panels`` groups of equal depth
    (block + 1/2) / blocks of the model."""
    blocks = {tuple(r["gap_blocks"]) for r in found}
    if len(blocks) == 1 and len(next(iter(blocks))) <= max_panels:
        per_layer = [
            (f"MoE layer {i} (block {b})", {r["label"]: [i] for r in found})
            for i, b in enumerate(next(iter(blocks)))
        ]
        return per_layer, False
    n = min(max_panels, max(len(r["gap_blocks"]) for r in found))
    members: list[dict[str, list[int]]] = [{} for _ in range(n)]
    for r in found:
        for i, b in enumerate(r["gap_blocks"]):
            g = min(n - 1, int((b + 0.5) / r["n_blocks"] * n))
            members[g].setdefault(r["label"], []).append(i)
    by_depth = [
        (f"MoE layers at depth {100 * g / n:.0f}-{100 * (g + 1) / n:.0f}%", m)
        for g, m in enumerate(members)
        if m
    ]
    return by_depth, True


def gap_histograms(
    runs: Sequence[dict[str, Any]],
    bins: int = 50,
    max_panels: int = MAX_GAP_PANELS,
    quantile: float = GAP_QUANTILE,
) -> dict[str, Any] | None:
    """The top-2 gap histograms of all runs on one shared x range [0, hi], one panel per
    layer group (see :func:`_gap_groups`).

    Each run dict has ``label``, ``gap_layers`` (an array of top-2 gaps per MoE layer),
    ``gap_blocks`` (the block of each), ``n_blocks`` (blocks of the model) and
    ``threshold`` (the map's singleton threshold, or None); runs without ``gap_layers``
    are left out. Returns None when no run has gaps, else ``{"hi", "edges", "panels":
    [{"title", "series": [{"label", "blocks", "n", "percent" (per bin, of the run's states
    in the panel), "tail_frac" (share > hi), "threshold", "above_threshold_frac" (share
    >= threshold), "legend", "color"}], "thresholds": [(value, [run labels])]}]}``.
    NaN and infinite gaps are left out."""
    found = [(j, r) for j, r in enumerate(runs) if r.get("gap_layers")]
    if not found:
        return None
    layers = {}
    for _, r in found:
        arrays = [np.asarray(a, dtype=float).ravel() for a in r["gap_layers"]]
        layers[r["label"]] = [a[np.isfinite(a)] for a in arrays]
    pooled = np.concatenate([a for arrays in layers.values() for a in arrays])
    hi = float(np.percentile(pooled, quantile)) if pooled.size else 1.0
    thresholds = [float(r["threshold"]) for _, r in found if is_finite(r.get("threshold"))]
    if thresholds:
        hi = max(hi, 1.1 * max(thresholds))
    hi = _nice_ceil(hi)
    edges = np.linspace(0.0, hi, bins + 1)
    groups, grouped = _gap_groups([r for _, r in found], max_panels)
    panels = []
    for title, members in groups:
        series = []
        by_threshold: dict[float, list[str]] = {}
        for j, r in found:
            idx = members.get(r["label"])
            if not idx:
                continue
            gaps = np.concatenate([layers[r["label"]][i] for i in idx])
            n = int(gaps.size)
            counts, _ = np.histogram(gaps, bins=edges)
            tail = float((gaps > hi).mean()) if n else 0.0
            threshold = float(r["threshold"]) if is_finite(r.get("threshold")) else None
            above = float((gaps >= threshold).mean()) if n and threshold is not None else None
            name = r["label"]
            if grouped:
                blocks = [r["gap_blocks"][i] for i in idx]
                word = "block" if len(blocks) == 1 else "blocks"
                name += f", {word} " + ", ".join(str(b) for b in blocks)
            parts = []
            if threshold is not None and above is not None:
                parts.append(f"{share_text(above)} \u2265 {threshold:g}")
                by_threshold.setdefault(threshold, []).append(r["label"])
            parts.append(f"{share_text(tail)} > {hi:g}")
            series.append(
                {
                    "label": r["label"],
                    "blocks": [r["gap_blocks"][i] for i in idx],
                    "n": n,
                    "percent": (100.0 * counts / n if n else counts * 0.0).tolist(),
                    "tail_frac": tail,
                    "threshold": threshold,
                    "above_threshold_frac": above,
                    "legend": f"{name} ({'; '.join(parts)})",
                    "color": line_color(j),
                }
            )
        panels.append(
            {"title": title, "series": series, "thresholds": sorted(by_threshold.items())}
        )
    return {"hi": hi, "edges": edges.tolist(), "panels": panels}


def plot_gap_histograms(hist: dict[str, Any], path: Path) -> Path:
    """Draw :func:`gap_histograms`'s data: per panel, each run's histogram as a step
    line (share of its token-layer states per bin) and each singleton threshold as a
    black vertical line naming its runs, all panels on the same x range."""
    panels = hist["panels"]
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(6.4 * cols, 4.3 * rows), squeeze=False, sharex=True
    )
    for ax in axes.flat[n:]:
        ax.axis("off")
    edges = np.asarray(hist["edges"])
    for ax, panel in zip(axes.flat, panels, strict=False):
        for s in panel["series"]:
            ax.stairs(s["percent"], edges, color=s["color"], lw=1.6, label=s["legend"])
        for k, (value, labels) in enumerate(panel["thresholds"]):
            ax.axvline(
                value,
                color="k",
                ls=("--", ":", "-.")[k % 3],
                lw=1.2,
                label=f"threshold {value:g}: " + ", ".join(labels),
            )
        ax.set_xlim(0.0, hist["hi"])
        ax.set_xlabel("top-2 score gap  z(1) - z(2)")
        ax.set_ylabel("% of the run's token-layer states")
        ax.set_title(panel["title"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Top-2 score gaps")
    return save_figure(fig, path)
