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

SATURATION_TOLERANCE = 1e-4
"""How large a share of the router's score gradient may fall on tokens past the
threshold for "the map passes none" to hold: tokens whose gap lies within float32
rounding of the threshold may still have a pair support (as for the singleton law)."""

RETURN_WINDOW = 5
"""Logged training rows in the running mean whose lowest value is the contributors'
dip (:func:`contributor_return`)."""

END_SHARE = 0.1
"""The share of training (by tokens) whose logged rows give the contributors' end
value (:func:`contributor_return`)."""

CLAIMS: tuple[str, ...] = (
    *(f"k_sensitivity_{m}" for m in SPARSE),
    *(f"retained_mass_sparsemax_vs_{m}" for m in ("softmax", "entmax15", "normmax2")),
    "retained_mass_entmax15_vs_softmax",
    *(f"singleton_identity_{m}" for m in SPARSE),
    "score_spread_entmax15_vs_softmax",
    "contributors_return_entmax15",
    "singletons_normmax2_vs_sparsemax",
    *(f"saturation_{m}" for m in SPARSE),
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
    return out + new_findings(per_map)


def spread_ratios(entmax: Mapping[str, Any], softmax: Mapping[str, Any]) -> list[float] | None:
    """Per MoE layer (by block), the score RMS of the 1.5-entmax run over that of the
    softmax run (the paper's Table 8 spread, one seed); None where a layer lacks it."""
    by_block = {lay["block"]: lay.get("score_rms") for lay in softmax["layers"]}
    out = []
    for lay in entmax["layers"]:
        num, den = lay.get("score_rms"), by_block.get(lay["block"])
        if num is None or not den:
            return None
        out.append(float(num) / float(den))
    return out or None


def contributor_return(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any] | None:
    """How far the contributors per token logged in training (``ys`` at training tokens
    ``xs``, in order) came back up from their dip: ``end`` is the mean of the rows in
    the last :data:`END_SHARE` of training (tokens > (1 − END_SHARE) × the last row's),
    ``dip`` the lowest running mean of :data:`RETURN_WINDOW` consecutive rows before
    those, ``return`` = end − dip (negative where the curve still falls at the end).
    None with too few rows. NOTE: the lowest of noisy running means lies a little below
    the curve, so a flat noisy curve gives a small positive return."""
    if not xs:
        return None
    cut = (1.0 - END_SHARE) * xs[-1]
    end = [y for x, y in zip(xs, ys, strict=True) if x > cut]
    before = [y for x, y in zip(xs, ys, strict=True) if x <= cut]
    if not end or len(before) < RETURN_WINDOW:
        return None
    means = [
        sum(before[i : i + RETURN_WINDOW]) / RETURN_WINDOW
        for i in range(len(before) - RETURN_WINDOW + 1)
    ]
    i = min(range(len(means)), key=means.__getitem__)
    e = sum(end) / len(end)
    return {
        "end": e,
        "dip": means[i],
        "dip_tokens": xs[i + RETURN_WINDOW - 1],
        "return": e - means[i],
    }


def new_findings(per_map: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Finding]:
    """The claims of issue 44's measures (each stated as measured, whichever way it
    comes out), from the same ``per_map`` as :func:`findings` (each seed's measurement
    also holding ``trajectory``, :func:`contributor_return` of its logged contributors,
    and ``saturation``, :func:`moelab.studies.sparse_maps.saturation.measure`):

    - score spread (Tables 7 and 8): in every MoE layer 1.5-entmax learns a smaller
      score RMS than softmax (the paper: about half); per seed the largest ratio over
      the layers, minus 1;
    - contributor trajectory (Figures 2 and 4): 1.5-entmax returns toward two
      contributors after its early dip (:func:`contributor_return`);
    - singletons (Table 2): 2-normmax gives more tokens a single expert than sparsemax;
    - gradient saturation (Figures 3 and 5): a sparse map passes no gradient to its
      router's scores for tokens whose top-2 gap is past its threshold; exact, seed by
      seed, on the share of the score gradient that falls on those tokens."""
    out = []
    ratios = [
        spread_ratios(e, s) for e, s in zip(per_map["entmax15"], per_map[REFERENCE], strict=True)
    ]
    out.append(
        Finding(
            "score_spread_entmax15_vs_softmax",
            "1.5-entmax learns a smaller score spread than softmax in every MoE layer "
            "(about half, Tables 7 and 8)",
            "largest over MoE layers of RMS(1.5-entmax) / RMS(softmax), minus 1",
            interval([None if r is None else max(r) - 1.0 for r in ratios]),
            expect="negative",
            measure=True,
            spec=".3f",
            extra={
                "ratios_per_layer": ratios,
                "mean_ratio": [None if r is None else sum(r) / len(r) for r in ratios],
            },
        )
    )
    traj = [m.get("trajectory") for m in per_map["entmax15"]]
    out.append(
        Finding(
            "contributors_return_entmax15",
            "1.5-entmax returns toward two contributors after sparsifying early in "
            "training (Figures 2 and 4)",
            f"contributors K+ of 1.5-entmax on the training batches: mean over the last "
            f"{END_SHARE:.0%} of training − lowest running mean of {RETURN_WINDOW} logged rows "
            "before it",
            interval([None if t is None else t["return"] for t in traj]),
            expect="positive",
            measure=True,
            spec=".4f",
            note="" if all(traj) else "too few logged training rows",
            extra={"trajectory": traj}
            | {
                m: [
                    None if x.get("trajectory") is None else x["trajectory"]["return"]
                    for x in per_map[m]
                ]
                for m in ("sparsemax", "normmax2")
            },
        )
    )
    rate = {
        m: [x["mean"].get("singleton_rate") for x in per_map[m]] for m in ("normmax2", "sparsemax")
    }
    out.append(
        Finding(
            "singletons_normmax2_vs_sparsemax",
            "2-normmax gives more tokens a single expert than sparsemax (Table 2: 23.1% "
            "against 9.6% at 300M)",
            "singleton rate, 2-normmax − sparsemax",
            paired_difference(rate["normmax2"], rate["sparsemax"]),
            source=Source(None, "singleton_rate", "normmax2", "sparsemax"),
            expect="positive",
            spec=".4f",
            extra=rate,
        )
    )
    for name in SPARSE:
        sat = [m.get("saturation") for m in per_map[name]]
        passed = [None if s is None else s["mean"]["passed_share_past"] for s in sat]
        past = [None if s is None else s["mean"]["token_share_past"] for s in sat]
        seen = any(p for p in past if p)
        out.append(
            Finding(
                f"saturation_{name}",
                f"{LABELS[name]} passes no gradient to its router's scores for tokens whose "
                "top-2 gap is past its threshold (Figures 3 and 5)",
                "share of the router's score gradient (LM loss) on tokens past the threshold",
                interval(passed),
                expect="zero",
                tolerance=SATURATION_TOLERANCE,
                exact=True,
                measure=True,
                spec=".1e",
                note="" if seen else "no token past the threshold: nothing to test",
                extra={
                    "lost_share": [None if s is None else s["mean"]["lost_share"] for s in sat],
                    "token_share_past": past,
                },
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
    for name in SPARSE:
        sat = [m.get("saturation") for m in per_map[name]]
        lost = [s["mean"]["lost_share"] for s in sat if s and s["mean"]["lost_share"] is not None]
        if lost:
            lines.append(
                f"{LABELS[name]} lost {100 * sum(lost) / len(lost):.2f}% of its top-1 gate "
                "gradient to tokens past its threshold (mean over seeds)"
            )
    if any(m.get("trajectory") is None for m in per_map["entmax15"]):
        lines.append(
            "warning: a 1.5-entmax run logged too few training rows for its contributors' "
            "dip and return"
        )
    return lines
