"""The sparse-maps paper's own numbers, set beside what the ``sparse-maps`` study
(:mod:`moelab.studies.sparse_maps`) measured, with the scale of each.

The values are the paper's (*How Sparse Probability Maps Shape Mixture-of-Experts
Routing*): Table 1 (validation loss, 300M), Table 2 (routing statistics, 300M; its 1B
rows are not in the text moelab holds), Table 3 (frozen-weight budgets), Table 5 (own
threshold shares, equal to the singleton rates at 1B) and Table 7 (score RMS and gap
median, on the Paloma WikiText-103 test documents). None: the paper gives no value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PAPER", "PAPER_SCALES", "paper_table"]

PAPER_SCALES = {
    "300m": "paper 300M (297M total, 108M active)",
    "1b": "paper 1B (1.01B total, 302M active)",
}
"""The paper's two scales as the table's headers name them (Table 4)."""

_MAPS = ("softmax", "entmax15", "sparsemax", "normmax2")

PAPER: dict[str, dict[str, dict[str, tuple[float | None, ...]]]] = {
    # statistic -> size -> values of softmax, 1.5-entmax, sparsemax, 2-normmax
    "val_loss": {"300m": (3.534, 3.536, 3.538, 3.536), "1b": (None,) * 4},
    "discarded_mass": {"300m": (0.566, 0.311, 0.099, 0.146), "1b": (None,) * 4},
    "contributors": {"300m": (2.000, 1.997, 1.904, 1.769), "1b": (None,) * 4},
    "singleton_pct": {"300m": (0.0, 0.295, 9.598, 23.144), "1b": (0.0, 0.048, 6.883, 21.256)},
    "score_rms": {"300m": (0.98, 0.52, 0.41, 0.53), "1b": (0.86, 0.36, 0.32, 0.38)},
    "gap_p50": {"300m": (0.91, 0.45, 0.36, 0.64), "1b": (0.90, 0.44, 0.40, 0.61)},
    "nll_increase": {
        "300m": (0.354, 0.131, 0.004, 0.024),
        "1b": (0.582, 0.250, 0.021, 0.064),
    },
}
"""The paper's values: statistic -> size -> one value per map, in :data:`_MAPS` order."""

STATISTICS: list[tuple[str, str, str]] = [
    ("val_loss", "validation loss (Table 1)", ".3f"),
    ("discarded_mass", "discarded mass (Table 2)", ".3f"),
    ("contributors", "contributors K+ (Table 2)", ".3f"),
    ("singleton_pct", "s=1 % (Tables 2, 5)", ".3f"),
    ("score_rms", "score RMS (Table 7)", ".3f"),
    ("spread_ratio", "RMS / softmax's RMS (Table 7)", ".3f"),
    ("gap_p50", "g50 (Table 7)", ".3f"),
    ("nll_increase", "Delta NLL K=2 -> 8 (Table 3)", "+.3f"),
]
"""(key, row text, format) of the rows, per map."""


def _paper(key: str, size: str, i: int) -> float | None:
    if key == "spread_ratio":
        rms = PAPER["score_rms"][size]
        return None if rms[i] is None or not rms[0] else rms[i] / rms[0]
    return PAPER[key][size][i]


def paper_table(
    measured: Mapping[str, Sequence[Mapping[str, Any]]],
    labels: Mapping[str, str],
    scale_text: str,
    values: Callable[[Sequence[Mapping[str, Any]], Callable[[Mapping[str, Any]], Any]], list],
) -> tuple[list[tuple[str, str, str]], list[dict[str, Any]]]:
    """The columns and rows of the table: one row per statistic and map (``measured``:
    map arm name -> the study's measurement of each seed; ``labels``: its label), with
    moelab's value per seed under ``scale_text`` and the paper's at 300M and 1B."""
    getters: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "val_loss": lambda m: m["nll"],
        "discarded_mass": lambda m: m["mean"]["discarded_mass"],
        "contributors": lambda m: m["mean"]["contributors"],
        "singleton_pct": lambda m: 100.0 * m["mean"]["singleton_rate"],
        "score_rms": lambda m: m["mean"]["score_rms"],
        "gap_p50": lambda m: m["mean"]["gap_p50"],
        "nll_increase": lambda m: m["sweep"]["nll_increase"],
    }
    columns: list[tuple[str, str, str]] = [
        ("statistic", "stat", "s"),
        ("map", "map", "s"),
        (scale_text, "moelab", ".4f"),
        (PAPER_SCALES["300m"], "p300m", ".3f"),
        (PAPER_SCALES["1b"], "p1b", ".3f"),
    ]
    rows = []
    for key, text, _ in STATISTICS:
        for i, m in enumerate(_MAPS):
            if m not in measured:
                continue
            if key == "spread_ratio":
                if m == "softmax":
                    continue
                ref = measured["softmax"]
                ours = [
                    None
                    if a["mean"].get("score_rms") is None or not b["mean"].get("score_rms")
                    else a["mean"]["score_rms"] / b["mean"]["score_rms"]
                    for a, b in zip(measured[m], ref, strict=True)
                ]
            else:
                ours = values(measured[m], getters[key])
            p300, p1b = _paper(key, "300m", i), _paper(key, "1b", i)
            rows.append(
                {
                    "stat": text,
                    "map": labels[m],
                    "moelab": ours,
                    "p300m": "-" if p300 is None else format(p300, ".3f"),
                    "p1b": "-" if p1b is None else format(p1b, ".3f"),
                }
            )
    return columns, rows
