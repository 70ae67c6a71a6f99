"""Curves over training tokens: the data model of the report's line figures
(:class:`Series`, :class:`Panel`), the panels of the report built from its runs (the
loss, routing during training, temperature), and their drawing (:func:`plot_panels`),
with the figure helpers every plot shares. Importable from :mod:`moelab.report.plots`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from moelab._io import named

__all__ = [
    "FLAT_RTOL",
    "Panel",
    "Series",
    "loss_curves",
    "loss_panel",
    "plot_panels",
    "temperature_panels",
    "training_panels",
]

_DPI = 110


def save_figure(fig: Any, path: Path, tight: bool = True) -> Path:
    """Draw ``fig`` into ``path`` and close it. ``tight``: lay it out with
    ``tight_layout`` first (not with a colour bar beside the panels). A failed write (a
    full disk) is an OSError that names ``path``."""
    if tight:
        fig.tight_layout()
    try:
        fig.savefig(path, dpi=_DPI)
    except OSError as err:
        raise named(err, path) from err
    finally:
        plt.close(fig)
    return path


def tokens_axis(ax: Any, ylabel: str, title: str, drawn: bool, empty: str, **legend: Any) -> None:
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


def is_finite(v: Any) -> bool:
    """True when ``v`` is a real number that is neither None nor NaN/inf."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def layer_rows(run: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The logged rows of a run that carry a per-layer list under ``key`` and a positive
    token count (evaluation-only rows and rows without the key are skipped)."""
    return [
        m
        for m in run.get("metrics", [])
        if isinstance(m.get(key), (list, tuple))
        and m[key]
        and is_finite(m.get("tokens"))
        and m["tokens"] > 0
    ]


def layer_series(rows: Sequence[dict[str, Any]], key: str, i: int) -> tuple[list, list]:
    """Tokens and values of layer ``i`` of ``key``; None/NaN values are skipped."""
    xs, ys = [], []
    for m in rows:
        vals = m.get(key)
        if isinstance(vals, (list, tuple)) and i < len(vals) and is_finite(vals[i]):
            xs.append(m["tokens"])
            ys.append(float(vals[i]))
    return xs, ys


def _layer_stats(rows: Sequence[dict[str, Any]], key: str) -> tuple[list, list, list, list]:
    """Tokens and the mean, min and max over layers of ``key`` per row (None/NaN layer
    values are left out; rows with no finite value are skipped)."""
    xs, mean, lo, hi = [], [], [], []
    for m in rows:
        vals = [float(v) for v in m[key] if is_finite(v)]
        if not vals:
            continue
        xs.append(m["tokens"])
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return xs, mean, lo, hi


# --- curves over training tokens -------------------------------------------------------

FLAT_RTOL = 1e-6
"""A series is flat when its values span at most this fraction of their magnitude (at
least 1): the logged float32 values of a fixed quantity differ by rounding only."""


@dataclass
class Series:
    """One line of a panel: ``x`` training tokens, ``y`` values, ``lo``/``hi`` an optional
    band around it (min and max over layers), ``style`` matplotlib keywords."""

    label: str
    x: list[float]
    y: list[float]
    lo: list[float] | None = None
    hi: list[float] | None = None
    style: dict[str, Any] = field(default_factory=dict)

    @property
    def flat(self) -> bool:
        """True when every value (band included) is the same, up to :data:`FLAT_RTOL`."""
        vals = [*self.y, *(self.lo or []), *(self.hi or [])]
        if not vals:
            return True
        return max(vals) - min(vals) <= FLAT_RTOL * max(1.0, max(abs(v) for v in vals))

    @property
    def has_band(self) -> bool:
        """True when the band has a visible width somewhere."""
        if self.lo is None or self.hi is None:
            return False
        return any(h > lo for lo, h in zip(self.lo, self.hi, strict=True))


@dataclass
class Panel:
    """One set of axes over training tokens: ``what`` names the quantity in prose (for
    the report's note when the panel is left out as flat)."""

    title: str
    ylabel: str
    what: str
    series: list[Series]
    logy: bool = False

    @property
    def flat(self) -> bool:
        """True when the panel would be a flat line for every run."""
        return all(s.flat for s in self.series)

    def constants(self) -> dict[str, float]:
        """The first value of each series (its value throughout, when the panel is flat)."""
        return {s.label: s.y[0] for s in self.series if s.y}


def line_color(j: int) -> str:
    """The colour of the run at position ``j`` of the report, the same in every figure."""
    return f"C{j % 10}"


def _row_tokens(row: dict[str, Any], tokens_per_step: float | None) -> float | None:
    """The training tokens of a metrics row: its ``tokens``, else ``step`` times the tokens
    per step (evaluation-only rows carry no ``tokens``), else None."""
    if is_finite(row.get("tokens")):
        return float(row["tokens"])
    if tokens_per_step and is_finite(row.get("step")):
        return float(row["step"]) * float(tokens_per_step)
    return None


def loss_curves(
    metrics: Sequence[dict[str, Any]], tokens_per_step: float | None
) -> dict[str, tuple[list[float], list[float]]]:
    """Training and validation loss over training tokens from the rows of metrics.jsonl:
    ``{"train": (tokens, loss), "val": (tokens, val_loss)}`` in file order. A row without
    ``tokens`` (an evaluation-only row) is placed at ``step * tokens_per_step``; rows with
    a missing or non-finite value, or at 0 tokens, are left out."""
    out: dict[str, tuple[list[float], list[float]]] = {"train": ([], []), "val": ([], [])}
    for row in metrics:
        for name, key in (("train", "loss"), ("val", "val_loss")):
            if not is_finite(row.get(key)):
                continue
            tokens = _row_tokens(row, tokens_per_step)
            if tokens is None or tokens <= 0:
                continue
            out[name][0].append(tokens)
            out[name][1].append(float(row[key]))
    return out


def loss_panel(runs: Sequence[dict[str, Any]]) -> Panel | None:
    """Training loss (solid) and validation loss (dashed, dots) of every run over training
    tokens; each run dict has ``label``, ``metrics`` and ``tokens_per_step``. None when no
    run logged a loss."""
    series = []
    for j, r in enumerate(runs):
        curves = loss_curves(r.get("metrics", []), r.get("tokens_per_step"))
        for name, style in (
            ("train", {"ls": "-"}),
            ("val", {"ls": "--", "marker": "o", "ms": 4}),
        ):
            xs, ys = curves[name]
            if xs:
                style = {**style, "color": line_color(j)}
                series.append(Series(f"{r['label']}: {name}", xs, ys, style=style))
    if not series:
        return None
    return Panel("Training and validation loss", "loss (nats / token)", "loss", series)


def training_panels(runs: Sequence[dict[str, Any]]) -> list[Panel]:
    """Discarded map mass and active experts per token over training tokens, one line per
    run that logged them (flat panels included: the caller decides)."""
    panels = []
    for key, ylabel, title, what in (
        (
            "discarded_mass",
            "discarded map mass",
            "Discarded mass during training",
            "the discarded mass",
        ),
        (
            "active_experts",
            "active experts per token",
            "Active experts during training",
            "the number of active experts per token",
        ),
    ):
        series = []
        for j, r in enumerate(runs):
            rows = [
                m
                for m in r.get("metrics", [])
                if is_finite(m.get(key)) and is_finite(m.get("tokens")) and m["tokens"] > 0
            ]
            if rows:
                series.append(
                    Series(
                        r["label"],
                        [float(m["tokens"]) for m in rows],
                        [float(m[key]) for m in rows],
                        style={"color": line_color(j)},
                    )
                )
        if series:
            panels.append(Panel(title, ylabel, what, series))
    return panels


def temperature_panels(runs: Sequence[dict[str, Any]]) -> list[Panel]:
    """Router temperature tau (mean over layers) and gate Lipschitz constant
    ||W||_2 / (2 tau) (mean over layers, band from min to max over layers, log y when
    positive) over training tokens, one line per run that logged them (flat panels
    included: the caller decides)."""
    panels = []
    for key, ylabel, title, what in (
        (
            "tau_layers",
            "router temperature tau (mean over layers)",
            "Router temperature",
            "the router temperature tau",
        ),
        (
            "lipschitz_layers",
            "||W||_2 / (2 tau) (mean over layers)",
            "Gate Lipschitz constant ||W||_2 / (2 tau)",
            "the gate Lipschitz constant",
        ),
    ):
        series = []
        for j, r in enumerate(runs):
            xs, mean, lo, hi = _layer_stats(layer_rows(r, key), key)
            if not xs:
                continue
            band = key == "lipschitz_layers"
            series.append(
                Series(
                    r["label"],
                    xs,
                    mean,
                    lo if band else None,
                    hi if band else None,
                    style={"color": line_color(j)},
                )
            )
        if series:
            positive = all(min(s.lo or s.y) > 0 for s in series)
            panels.append(Panel(title, ylabel, what, series, logy=key != "tau_layers" and positive))
    return panels


def plot_panels(panels: Sequence[Panel], path: Path, ncols: int = 2) -> Path | None:
    """Draw ``panels`` side by side (``ncols`` per row), x = training tokens (log); a
    band's legend entry is added only when a band is visible. None when there is no
    panel (nothing written)."""
    if not panels:
        return None
    n = len(panels)
    cols = min(n, ncols)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.8 * cols, 4.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels, strict=False):
        banded = False
        for s in panel.series:
            (line,) = ax.plot(s.x, s.y, label=s.label, **s.style)
            if s.has_band:
                assert s.lo is not None and s.hi is not None
                ax.fill_between(s.x, s.lo, s.hi, color=line.get_color(), alpha=0.2, lw=0)
                banded = True
        if panel.logy:
            ax.set_yscale("log")
        handles, labels = ax.get_legend_handles_labels()
        if banded:
            handles.append(plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.3, lw=0))
            labels.append("band: min to max over layers")
        tokens_axis(
            ax,
            panel.ylabel,
            panel.title,
            True,
            "",
            handles=handles,
            labels=labels,
            fontsize="small",
        )
    return save_figure(fig, path)
