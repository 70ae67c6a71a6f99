"""The claims of the sparse-maps paper that the ``sparse-maps`` study tests, as findings,
and the checks that what they rest on happened (:mod:`moelab.studies.sparse_maps`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moelab.studies.core import Context
from moelab.studies.paired import Finding, Source, interval, paired_difference

REFERENCE = "softmax"
"""The reference arm: the router every framework ships."""

SPARSE = ("entmax15", "sparsemax", "normmax2")
"""The arm names of the three sparse maps (at the paper scale with a size suffix)."""

LABELS = {"softmax": "softmax", "entmax15": "1.5-entmax", "sparsemax": "sparsemax"}
LABELS["normmax2"] = "2-normmax"
"""The maps' names in the findings' text."""

SINGLETON_TOLERANCE = 1e-4
"""How far a sparse map's singleton rate may lie from its share of top-2 gaps at or above
its threshold: the two agree state by state but for gaps within float32 rounding of the
threshold, about 3 states in the 32,768 of the cpu scale's analysis."""

CLAIMS: tuple[str, ...] = (
    *(f"k_sensitivity_{m}" for m in SPARSE),
    *(f"retained_mass_sparsemax_vs_{m}" for m in ("softmax", "entmax15", "normmax2")),
    "retained_mass_entmax15_vs_softmax",
    *(f"singleton_identity_{m}" for m in SPARSE),
)
"""The keys of the paper's claims that the study tests, in the findings table's order."""


def claim_arms(ctx: Context) -> dict[str, str]:
    """Map arm name (softmax, entmax15, ...) -> the arm of this study that the claims read:
    the arm itself at the small scales, its 1B arm at the paper scale (the paper's headline
    numbers)."""
    names = {a.name for a in ctx.arms}
    out = {}
    for m in (REFERENCE, *SPARSE):
        out[m] = m if m in names else f"{m}-1b" if f"{m}-1b" in names else f"{m}-300m"
    missing = [a for a in out.values() if a not in names]
    if missing:
        raise ValueError(f"sparse-maps: the findings need the arms {missing}")
    return out


def _retained(m: Mapping[str, Any]) -> float | None:
    """1 - the discarded mass at the trained K (mean over MoE layers)."""
    dm = m["mean"].get("discarded_mass")
    return None if dm is None else 1.0 - dm


def findings(per_map: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Finding]:
    """The paper's claims (:data:`CLAIMS`) as findings, from each map's measurements
    (``per_map``: map arm name -> one :func:`_measure` result per seed, seed order).

    - K-sensitivity (Table 3): the NLL increase from the trained K = 2 to K = 8 of softmax
      minus that of each sparse map, seed by seed; the paper: softmax loses the most.
    - Retained mass (Table 2): sparsemax's 1 - discarded mass minus each other map's
      (sparsemax retains the most), and 1.5-entmax's minus softmax's (entmax discards
      less than softmax).
    - The singleton law (Section 3, Table 5): for a sparse map the share of states with a
      single expert equals the share of top-2 gaps at or above its threshold; exact, seed
      by seed."""
    out = []
    ref = per_map[REFERENCE]
    inc_ref = [m["sweep"]["nll_increase"] for m in ref]
    for name in SPARSE:
        inc = [m["sweep"]["nll_increase"] for m in per_map[name]]
        out.append(
            Finding(
                f"k_sensitivity_{name}",
                f"softmax loses more than {LABELS[name]} when run with K = 8 after training "
                "with K = 2",
                f"ΔNLL(K = 2 → 8) of softmax − of {LABELS[name]} (nats)",
                paired_difference(inc_ref, inc),
                source=Source("budget_nll", "delta", REFERENCE, name),
                expect="positive",
                spec=".4f",
                extra={REFERENCE: inc_ref, name: inc},
            )
        )
    pairs = [("sparsemax", m) for m in ("softmax", "entmax15", "normmax2")]
    pairs.append(("entmax15", "softmax"))
    for a, b in pairs:
        ra = [_retained(m) for m in per_map[a]]
        rb = [_retained(m) for m in per_map[b]]
        claim = (
            f"sparsemax retains more probability mass in its top-2 than {LABELS[b]}"
            if a == "sparsemax"
            else "1.5-entmax discards less probability mass than softmax"
        )
        out.append(
            Finding(
                f"retained_mass_{a}_vs_{b}",
                claim,
                f"retained mass 1 − δ̄ at K = 2, {LABELS[a]} − {LABELS[b]}",
                paired_difference(ra, rb),
                source=Source("budget_retention", "ret2", a, b),
                expect="positive",
                spec=".4f",
                extra={a: ra, b: rb},
            )
        )
    for name in SPARSE:
        rate = [m["mean"].get("singleton_rate") for m in per_map[name]]
        share = [m["mean"].get("frac_gap_ge_threshold") for m in per_map[name]]
        diff = [None if r is None or g is None else r - g for r, g in zip(rate, share, strict=True)]
        thr = per_map[name][0]["mean"].get("threshold")
        seen = any(r for r in rate if r)
        out.append(
            Finding(
                f"singleton_identity_{name}",
                f"{LABELS[name]} gives one expert all the weight exactly when the top-2 gap "
                f"reaches its threshold ({thr:g})",
                "singleton rate − share of gaps ≥ threshold",
                interval(diff),
                expect="zero",
                tolerance=SINGLETON_TOLERANCE,
                exact=True,
                spec=".1e",
                measure=True,
                note="" if seen else "no state had a single expert: nothing to test",
                extra={"singleton_rate": rate, "frac_gap_ge_threshold": share},
                testable=seen,
            )
        )
    return out


def checks(per_map: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Lines saying whether what the claims rest on happened: the K sweep applied its K
    (softmax's contributors follow K, as every weight of softmax is positive), and each
    sparse map produced singletons for its law to be tested on."""
    lines = []
    ks: dict[int, list[float]] = {}
    for m in per_map[REFERENCE]:
        for r in m["sweep"]["results"]:
            ks.setdefault(r["top_k"], []).append(r["contributors"])
    off = {k: v for k, v in ks.items() if any(abs(c - k) > 1e-6 for c in v)}
    if off:
        lines.append(
            "warning: the K sweep did not apply its K: softmax's contributors at "
            + ", ".join(f"K = {k}: {sum(v) / len(v):.3f}" for k, v in sorted(off.items()))
        )
    else:
        lines.append(
            "the K sweep applied its K: softmax gives exactly K contributors at K = "
            + ", ".join(str(k) for k in sorted(ks))
        )
    for name in SPARSE:
        rates = [m["mean"].get("singleton_rate") for m in per_map[name]]
        rates = [r for r in rates if r is not None]
        if rates and max(rates) > 0:
            lines.append(
                f"{LABELS[name]} gave a single expert all the weight on "
                f"{100 * sum(rates) / len(rates):.2f}% of token-layer states (mean over seeds)"
            )
        else:
            lines.append(
                f"warning: {LABELS[name]} never gave a single expert all the weight: its "
                "singleton law is not tested here"
            )
    return lines
