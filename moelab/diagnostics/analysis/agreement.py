"""Agreement of two routing records of the same text (``moelab analyze agreement A B``).

Two :class:`~moelab.diagnostics.replay.RoutingRecord` of one text, e.g. an inference
engine's and moelab's, or fp32 and bf16 routing of one model: which routing decisions
differ, where they sit, and whether they are ties.

Per MoE layer: the share of tokens whose expert *set* differs (the experts their chosen
slots name, null experts included, slot order ignored: :meth:`RoutingRecord.chosen_sets`)
and the mean number of experts swapped on those tokens (|A \\ B|). Over the layers: the
share of tokens that differ in at least one layer and the histogram of how many layers
each token differs in. Where they sit: by position ``t mod S`` in buckets when the
sequence length S is known (the ``seq_len`` argument, else the records'), else by row of
the record (its call order), said so. The margins: each record that holds them
(:attr:`RoutingRecord.margins_T2`, the top-1/top-2 and top-K/top-(K+1) gaps of the scores
its selection rule ranked) gives, per layer and over all, the counts of ties (margin 0),
the infinite ones, and p10/median/p90 of the tokens that differ in that layer against
the rest; a record without margins gives none (never estimated), and the document says
so.

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from moelab.diagnostics.replay import RoutingRecord

__all__ = ["MARGIN_EDGES", "MARGIN_PERCENTILES", "POSITION_BUCKETS", "agreement"]

POSITION_BUCKETS = 8
"""The position (or row) buckets: at most this many, of equal width."""
MARGIN_PERCENTILES = (10, 50, 90)
"""The percentiles of the margins reported (numpy's linear interpolation)."""
MARGIN_EDGES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, math.inf)
"""The margin histogram's bins besides the ties (exactly 0) and the infinite ones:
(0, 1e-6), [1e-6, 1e-5), ..., [10, inf)."""
_MARGINS = ("top1", "topk")  # the two columns of margins_T2: s(1) - s(2), s(K) - s(K + 1)


def _check(a: RoutingRecord, b: RoutingRecord, labels: tuple[str, str]) -> None:
    """ValueError (one line, naming the field) unless the records describe one text."""
    la, lb = labels
    for field, va, vb in (
        ("n_layers", a.n_layers, b.n_layers),
        ("n_experts", a.n_experts, b.n_experts),
        ("n_null", a.n_null, b.n_null),
        ("tokens", a.tokens, b.tokens),
    ):
        if va != vb:
            raise ValueError(
                f"{field} differs: {la} has {va}, {lb} has {vb}; compare two records of one "
                "model on one text"
            )
    if a.n_layers == 0 or a.tokens == 0:
        raise ValueError(f"{la} and {lb} hold no routed tokens; record a forward first")


def _seq_len(
    a: RoutingRecord, b: RoutingRecord, seq_len: int | None, labels: tuple[str, str]
) -> tuple[int | None, str | None]:
    """S and where it came from (``argument``, ``record``), or (None, None)."""
    held = {lab: r.seq_len for lab, r in zip(labels, (a, b), strict=True) if r.seq_len}
    if len(set(held.values())) > 1:
        raise ValueError(
            "seq_len differs: "
            + ", ".join(f"{lab} was recorded with S={s}" for lab, s in held.items())
            + "; compare two records of one text"
        )
    if seq_len is None:
        return (next(iter(held.values())), "record") if held else (None, None)
    if seq_len <= 0 or a.tokens % seq_len:
        raise ValueError(
            f"seq_len must be a positive divisor of the {a.tokens} recorded tokens, got {seq_len}"
        )
    for lab, s in held.items():
        if s != seq_len:
            raise ValueError(f"seq_len {seq_len} differs from {lab}'s recorded S={s}")
    return seq_len, "argument"


def _stats(values: np.ndarray) -> dict[str, Any]:
    """Counts, ties and percentiles of some margins (float64)."""
    finite = values[np.isfinite(values)]
    out: dict[str, Any] = {
        "tokens": int(values.size),
        "ties": int((values == 0).sum()),
        "infinite": int(values.size - finite.size),
        "min": float(finite.min()) if finite.size else None,
    }
    pct = np.percentile(finite, MARGIN_PERCENTILES) if finite.size else [None] * 3
    for p, v in zip(MARGIN_PERCENTILES, pct, strict=True):
        out[f"p{p}"] = None if v is None else float(v)
    return out


def _bin_names() -> list[str]:
    inner = [
        f"{'(' if lo == 0 else '['}{lo:g}, {hi:g})" for lo, hi in itertools.pairwise(MARGIN_EDGES)
    ]
    return ["0", *inner, "inf"]


def _histogram(values: np.ndarray) -> list[int]:
    """Counts per bin of :func:`_bin_names`: the ties, the :data:`MARGIN_EDGES` bins, the
    infinite ones."""
    finite = values[np.isfinite(values) & (values > 0)]
    inner = np.bincount(
        np.searchsorted(np.asarray(MARGIN_EDGES[1:-1]), finite, side="right"),
        minlength=len(MARGIN_EDGES) - 1,
    )
    return [int((values == 0).sum()), *map(int, inner), int(np.isinf(values).sum())]


def _margins(rec: RoutingRecord, differ: list[np.ndarray]) -> dict[str, Any] | None:
    """Per layer and over all: the margins of the differing tokens against the rest."""
    if rec.margins_T2 is None:
        return None

    def split(m: np.ndarray, d: np.ndarray) -> dict[str, Any]:
        return {
            name: {"differing": _stats(m[d, c]), "rest": _stats(m[~d, c])}
            for c, name in enumerate(_MARGINS)
        }

    layers = []
    for i, d in enumerate(differ):
        m = rec.margins_T2[i].double().numpy()
        layers.append({"layer": i, **split(m, d)})
    m_all = np.concatenate([rec.margins_T2[i].double().numpy() for i in range(len(differ))])
    d_all = np.concatenate(differ)
    histogram = {
        name: {
            "differing": _histogram(m_all[d_all, c]),
            "rest": _histogram(m_all[~d_all, c]),
        }
        for c, name in enumerate(_MARGINS)
    }
    return {
        "layers": layers,
        "all": split(m_all, d_all),
        "histogram": {"bins": _bin_names(), **histogram},
    }


def _buckets(n: int) -> list[tuple[int, int]]:
    """At most :data:`POSITION_BUCKETS` [lo, hi) ranges of equal width covering [0, n)."""
    k = min(POSITION_BUCKETS, n)
    edges = [round(i * n / k) for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


def agreement(
    a: RoutingRecord,
    b: RoutingRecord,
    seq_len: int | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> dict[str, Any]:
    """The agreement of two routing records of one text (see the module docstring):
    the analysis document that :func:`moelab.report.analysis.write_analysis` writes.

    ``seq_len``: S of the recorded batches (T = B * S per call, sequence-major), which
    places each token at position ``t mod S``; None: the records' own S, else positions
    are not known and the rows of the record are bucketed instead. ``labels`` name the
    records in the document and in messages.

    Raises:
        ValueError: (one line naming the field) the records differ in layers, experts,
            null experts or tokens, hold no tokens, were recorded with different S, or
            ``seq_len`` does not divide T.
    """
    _check(a, b, labels)
    S, s_from = _seq_len(a, b, seq_len, labels)
    T, L = a.tokens, a.n_layers
    differ, layers = [], []
    for i in range(L):
        set_a_TE, set_b_TE = a.chosen_sets(i), b.chosen_sets(i)
        d_T = (set_a_TE != set_b_TE).any(dim=1)
        swapped = (set_a_TE & ~set_b_TE).sum(dim=1)[d_T]
        n = int(d_T.sum())
        layers.append(
            {
                "layer": i,
                "tokens": T,
                "differ_tokens": n,
                "differ": n / T,
                "swapped_mean": float(swapped.double().mean()) if n else None,
            }
        )
        differ.append(d_T.numpy())
    count_T = np.sum(differ, axis=0)  # layers in which each token differs
    any_T = count_T > 0
    pos_T = np.arange(T) % S if S else np.arange(T)
    positions = []
    for lo, hi in _buckets(S or T):
        at = (pos_T >= lo) & (pos_T < hi)
        n = int(at.sum())
        positions.append(
            {
                "lo": lo,
                "hi": hi,
                "tokens": n,
                "differ_any_tokens": int(any_T[at].sum()),
                "differ_any": float(any_T[at].mean()) if n else None,
                "differ_states": float(count_T[at].sum() / (n * L)) if n else None,
            }
        )
    margins = {"A": _margins(a, differ), "B": _margins(b, differ)}
    missing = [lab for lab, r in zip(labels, (a, b), strict=True) if r.margins_T2 is None]
    return {
        "analysis": "agreement",
        "source": labels[0],
        "kind": "records",
        "map": a.map,
        "alpha": None,
        "checkpoint_step": None,
        "records": [
            {
                "label": lab,
                "map": r.map,
                "K": r.slots,
                "seq_len": r.seq_len,
                "margins": r.margins_T2 is not None,
            }
            for lab, r in zip(labels, (a, b), strict=True)
        ],
        "n_layers": L,
        "n_experts": a.n_experts,
        "n_null": a.n_null,
        "tokens": T,
        "seq_len": S,
        "seq_len_from": s_from,
        "differ_any": float(any_T.mean()),
        "differ_any_tokens": int(any_T.sum()),
        "differ_states": float(count_T.sum() / (T * L)),
        "layers_differing": np.bincount(count_T, minlength=L + 1).tolist(),
        "layers": layers,
        "position_axis": "position" if S else "row",
        "positions": positions,
        "margins": margins,
        "margins_unavailable": (
            None
            if not missing
            else f"{' and '.join(missing)} hold{'s' if len(missing) == 1 else ''} no margins "
            "(recorded before moelab kept them, by an engine, or with a rule that does not "
            "rank each token's experts)"
        ),
    }
