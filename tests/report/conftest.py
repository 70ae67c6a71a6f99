"""The tiny runs every report test reads (trained once per test session), their full
report, and a spy that records what each saved figure draws."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.patches import StepPatch

from moelab.report import build_report, panels, plots
from moelab.train import train
from tests.train import make_corpus, tiny_config


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """softmax and sparsemax top-2 (fixed tau = 1, one MoE layer) and LapSum with learned
    allocation over two MoE layers and an annealed temperature; 10 steps each. The
    sparsemax run also evaluates every 3 steps, so its metrics.jsonl has validation rows
    without a token count (steps 3 and 9)."""
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)
    root = tmp_path_factory.mktemp("runs")
    out = []
    for name, extra in (("softmax", {}), ("sparsemax", {"eval_every": 3})):
        run = root / name
        train(tiny_config(corpus, run, map=name, steps=10, eval_batches=1, log_every=2, **extra))
        out.append(run)
    run = root / "lapsum"
    model = {
        **tiny_config(corpus, run).model,
        "moe_layers": "all",
        "k_total": 3.0,
        "router": {
            "map": "lapsum",
            "selection": "threshold",
            "schedule": "cosine",
            "temperature": 3.0,
            "anneal_steps": 10,
        },
    }
    train(tiny_config(corpus, run, model=model, steps=10, eval_batches=1, log_every=2))
    out.append(run)
    return out


def describe_figure(fig: Any) -> dict[str, Any]:
    """What a figure draws, as plain data: its suptitle and, per visible axes, the title,
    the legend's texts, the lines (label, x, y, marker, linestyle, marker size, face
    colour), the step histograms (label, values) and the number of filled bands."""
    axes = []
    for ax in fig.axes:
        if not ax.axison:
            continue  # a spare grid cell, turned off
        legend = ax.get_legend()
        axes.append(
            {
                "title": ax.get_title(),
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
                "lines": [
                    {
                        "label": line.get_label(),
                        "x": [float(v) for v in line.get_xdata()],
                        "y": [float(v) for v in line.get_ydata()],
                        "marker": line.get_marker(),
                        "ls": line.get_linestyle(),
                        "ms": line.get_markersize(),
                        "mfc": line.get_markerfacecolor(),
                    }
                    for line in ax.get_lines()
                ],
                "stairs": [
                    {"label": p.get_label(), "values": [float(v) for v in p.get_data().values]}
                    for p in ax.patches
                    if isinstance(p, StepPatch)
                ],
                "bands": sum(isinstance(c, PolyCollection) for c in ax.collections),
            }
        )
    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
    return {"suptitle": suptitle, "axes": axes}


@contextmanager
def capture_figures() -> Iterator[dict[str, dict[str, Any]]]:
    """While open, every figure the report saves is also described (``describe_figure``)
    under its file name in the yielded dict."""
    figures: dict[str, dict[str, Any]] = {}
    save = plots.save_figure

    def spy(fig: Any, path: Path, **kwargs: Any) -> Path:
        figures[Path(path).name] = describe_figure(fig)
        return save(fig, path, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plots, "save_figure", spy)
        mp.setattr(panels, "save_figure", spy)  # plot_panels saves from there
        yield figures


@pytest.fixture(scope="session")
def full_report(
    runs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The report of the three ``runs`` (1 validation batch) and what its figures draw."""
    with capture_figures() as figures:
        doc = build_report(runs, tmp_path_factory.mktemp("full") / "rep", max_batches=1)
    return doc, figures
