"""The claims of the SoftMoE paper that the ``softmoe`` study tests, as findings, and the
checks that its mechanisms acted (:mod:`moelab.studies.softmoe`).

Every soft arm is compared with the sparse arm of its budget group (the paper's Table 1:
SoftMoE* and SoftMoE k = 1.5 against sparse top-2 in "<= 2", k = 2 against sparse top-4 in
"<= 4"). Each finding that is a paired difference names in ``extra`` its two arms
(``arms``), its ``table`` (the results.json table whose cells hold the per-seed values)
and its ``column`` (the cell key), and holds each arm's per-seed values under the arm's
name: the effect is, seed by seed, the first arm's value minus the second's.

Shape suffixes: L (moelab.shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moelab.studies.paired import Finding, Source, interval, paired_difference
from moelab.studies.softmoe.grid import (
    FIXED_TAUS,
    GROUPS,
    INFER_SCALES,
    JITTER_KS,
    SOFT_CONFIGS,
    SoftConfig,
)
from moelab.studies.softmoe.paper import TRAIN_AE_REDUCTION, group_of

REFERENCE = "sparse-k2"
"""The reference arm of the generic paired tables: sparse MoE, softmax top-2 without
renormalisation, jitter off (the sparse arm of the "<= 2" group)."""
STAR = "softmoe-star"
LEARNED = "softmoe"
K_SPREAD_MIN = 0.25
"""The check's threshold on the learned k_l's spread at the end (max − min over the
layers, mean over seeds): below it the allocation did not separate the layers."""
BOUND_SHARE = 0.01
"""A k_l sits on a bound when its share of the movable budget, (k_l − 1) / (K − L) (the
allocator's softmax(eta)_l), is at most this or at least 1 − this: there the gradient
through the softmax, which scales with share (1 − share), has all but vanished."""
LOAD_TOLERANCE = 0.02
"""'No discernible impact on load balancing': |Δ relative load variance| within 0.02, the
spread of the paper's own Table 5 at k = 2 on OWT (0.05 sparse, 0.06-0.07 SoftMoE)."""
AE_MATCH = 0.05
"""The check that the sweep's 1 × row reproduces the arm's Infer-AE (same weights, same
batches): they agree within this many experts."""

MAIN_TABLE = "softmoe_main"
"""The results.json table (Table 1 layout) whose cells hold loss, Train-AE and Infer-AE."""
LOAD_TABLE = "softmoe_load_variance"
TAU_TABLE = "softmoe_threshold_ablation"
JITTER_TABLE = "softmoe_jitter"
SWEEP_TABLE = "softmoe_inference_truncation"
ALLOCATION_TABLE = "softmoe_allocation"


@dataclass(frozen=True)
class Claim:
    """A claim measured as the paired difference of ``column`` between two arms,
    ``arm − versus``, seed by seed, with the sign ``expect`` predicts; the per-seed
    values are the cells of ``table``."""

    key: str
    claim: str
    arm: str
    versus: str
    column: str
    expect: str
    table: str = MAIN_TABLE
    tolerance: float = 0.0
    note: str = ""


_COLUMN_TEXT = {
    "loss": ("validation loss", ".3f"),
    "train_ae": ("Train-AE", ".3f"),
    "infer_ae": ("Infer-AE", ".3f"),
    "load_rel_var": ("relative load variance", ".4f"),
}

INFER_CUT_AE = "inference-cut-fewer-experts"
INFER_CUT_NLL = "inference-cut-costs-loss"


def tag(c: SoftConfig) -> str:
    """The configuration's name in claim keys: k1.5, k2, k2-a4."""
    return c.suffix.lstrip("-") or f"k{c.k:g}"


def later_key(c: SoftConfig) -> str:
    return f"later-layers-larger-k-{tag(c)}"


def _configs() -> list[SoftConfig]:
    """The configurations the findings test (those trained at every scale)."""
    return [c for c in SOFT_CONFIGS if not c.paper_only]


def _group_text(c: SoftConfig) -> str:
    return f"budget group ≤ {c.group}: {GROUPS[c.group]}"


def _soft_claims(c: SoftConfig) -> list[Claim]:
    t, sparse, conf = tag(c), GROUPS[c.group], f"k={c.k:g}, α={c.alpha:g}"
    within = f"({_group_text(c)}; Table 1{'' if c.in_paper else ', a configuration of moelab'})"
    out = [
        Claim(
            f"star-{t}-lower-loss",
            f"SoftMoE* {conf} reaches a lower loss than the sparse arm of its budget "
            f"group {within}",
            c.star,
            sparse,
            "loss",
            "negative",
        ),
        Claim(
            f"star-{t}-fewer-experts-train",
            f"SoftMoE* {conf} activates fewer experts in training than the sparse arm of "
            f"its group{' (17-24% fewer)' if c.group == 2 else ''} {within}",
            c.star,
            sparse,
            "train_ae",
            "negative",
        ),
        Claim(
            f"star-{t}-fewer-experts-inference",
            f"SoftMoE* {conf} activates fewer experts at inference than the sparse arm "
            f"of its group {within}",
            c.star,
            sparse,
            "infer_ae",
            "negative",
        ),
    ]
    if c.learned:
        out += [
            Claim(
                f"softmoe-{t}-matches-sparse",
                f"SoftMoE {conf} (learned allocation, K = k L) matches or beats the "
                f"sparse arm of its group in loss (abstract) {within}",
                c.soft,
                sparse,
                "loss",
                "negative",
            ),
            Claim(
                f"learned-{t}-lower-loss",
                f"Learned allocation improves the loss over SoftMoE* at {conf} "
                "(Section 5, Table 1)",
                c.soft,
                c.star,
                "loss",
                "negative",
            ),
            Claim(
                f"learned-{t}-more-experts",
                f"... with more active experts at inference than SoftMoE* at {conf} "
                "(Section 5, Tables 1 and 4)",
                c.soft,
                c.star,
                "infer_ae",
                "positive",
            ),
        ]
    return out


_LOAD = next(c for c in SOFT_CONFIGS if c.group == 2)

CLAIMS: list[Claim] = [
    *(claim for c in _configs() for claim in _soft_claims(c)),
    Claim(
        "load-balance-unchanged",
        "SoftMoE routing has no discernible effect on load balance (Table 5; "
        f"{_group_text(_LOAD)})",
        _LOAD.star,
        GROUPS[_LOAD.group],
        "load_rel_var",
        "zero",
        LOAD_TABLE,
        LOAD_TOLERANCE,
        note=f"tolerance {LOAD_TOLERANCE:g}: the spread of the paper's Table 5 at k = 2",
    ),
    Claim(
        "lower-train-tau-more-experts",
        "A lower train-time threshold τ activates more experts (Table 6)",
        f"softmoe-star-tau{min(FIXED_TAUS):g}",
        f"softmoe-star-tau{max(FIXED_TAUS):g}",
        "infer_ae",
        "positive",
        TAU_TABLE,
    ),
    *(
        Claim(
            f"jitter-hurts-k{k}",
            f"Router jitter degrades the sparse top-{k} baseline (Table 8, Appendix B)",
            f"sparse-k{k}-jitter",
            f"sparse-k{k}",
            "loss",
            "positive",
            JITTER_TABLE,
            note="the paper's own loss column moves by ±0.01 (its downstream columns "
            "carry the claim)",
        )
        for k in JITTER_KS
    ),
]
"""The paper's claims that compare two arms' columns."""

CLAIM_KEYS: tuple[str, ...] = (
    *(later_key(c) for c in _configs() if c.learned),
    *(c.key for c in CLAIMS),
    INFER_CUT_AE,
    INFER_CUT_NLL,
)
"""Every claim the study tests (``SoftMoEStudy.claims``)."""


def _scale_index(scale: float) -> int:
    return list(INFER_SCALES).index(scale)


def late_minus_early(k_L: list[float] | None) -> float | None:
    """The mean k_l of the later half of the layers minus that of the earlier half (the
    middle layer left out when L is odd); None without k_l."""
    if not k_L or len(k_L) < 2:
        return None
    h = len(k_L) // 2
    early, late = k_L[:h], k_L[len(k_L) - h :]
    return sum(late) / h - sum(early) / h


def late_share(k_L: list[float] | None) -> float | None:
    """The share of the budget K = Σ k_l held by the last ceil(0.3 L) layers (the paper:
    its top 3 of 10 layers absorb about 50%)."""
    if not k_L:
        return None
    n = math.ceil(0.3 * len(k_L))
    return sum(k_L[-n:]) / sum(k_L)


def findings(
    columns: dict[str, dict[str, list[Any]]],
    k_end: dict[str, list[list[float] | None]],
    sweeps: dict[str, list[dict[str, Any]]],
    n_seeds: int | None = None,
) -> list[Finding]:
    """One Finding per claim of :data:`CLAIM_KEYS`.

    ``columns``: per arm, per column of :data:`_COLUMN_TEXT`, one value per seed;
    ``k_end``: per learned arm, per seed, its k_l of every MoE layer at the last logged
    step; ``sweeps``: per arm, per seed, its inference-time truncation sweep
    (:func:`.run.sweep`). An arm missing from them gives "not measured"."""
    n = n_seeds or max(
        [len(v) for cols in columns.values() for v in cols.values()]
        + [len(v) for v in k_end.values()]
        + [1]
    )
    out = []
    for c in _configs():
        if not c.learned:
            continue
        ends = list(k_end.get(c.soft) or [None] * n)
        out.append(
            Finding(
                later_key(c),
                "Later layers learn a larger share of the budget: k_l grows with depth "
                f"(Figure 6, Section 5; SoftMoE k={c.k:g}, α={c.alpha:g})",
                f"mean k_l of the later half of the MoE layers − of the earlier half at the "
                f"end of training ({c.soft})",
                interval([late_minus_early(ks) for ks in ends]),
                expect="positive",
                measure=True,
                note="slope: the least-squares slope of the final k_l over the layer "
                "index; late_share: the share of K in the last 30% of the layers (the "
                "paper: about 50% in its top 3 of 10)",
                extra={
                    "arm": c.soft,
                    "table": ALLOCATION_TABLE,
                    "column": "k_end",
                    "k_end": [list(ks) if ks is not None else None for ks in ends],
                    "slope": [_slope(ks) for ks in ends],
                    "late_share": [late_share(ks) for ks in ends],
                },
            )
        )
    for c in CLAIMS:
        text, spec = _COLUMN_TEXT[c.column]
        a = columns.get(c.arm, {}).get(c.column)
        b = columns.get(c.versus, {}).get(c.column)
        a = list(a) if a is not None else [None] * n
        b = list(b) if b is not None else [None] * n
        extra: dict[str, Any] = {
            "arms": [c.arm, c.versus],
            "table": c.table,
            "column": c.column,
            c.arm: a,
            c.versus: b,
        }
        if c.column == "train_ae" and c.versus == GROUPS[2]:
            extra["reduction"] = [
                None if x is None or not y else 1 - x / y for x, y in zip(a, b, strict=True)
            ]
            extra["paper_reduction"] = TRAIN_AE_REDUCTION
        out.append(
            Finding(
                c.key,
                c.claim,
                f"Δ {text}, {c.arm} − {c.versus}",
                paired_difference(a, b),
                source=Source(c.table, c.column, c.arm, c.versus),
                expect=c.expect,
                tolerance=c.tolerance,
                spec=spec,
                note=c.note
                + (
                    "; reduction: 1 − Train-AE ratio per seed (the paper: 24% OWT, 17% C4)"
                    if "reduction" in extra
                    else ""
                ),
                extra=extra,
            )
        )
    docs = sweeps.get(LEARNED, [])
    hi, one = _scale_index(max(INFER_SCALES)), _scale_index(1.0)

    def at(j: int, key: str) -> list[float | None]:
        return [d["results"][j][key] for d in docs] if docs else [None] * n

    factor = f"{max(INFER_SCALES):g} ×"
    rows = [f"{LEARNED} @ {factor}", f"{LEARNED} @ 1 ×"]
    for key, claim, what, col, expect in (
        (
            INFER_CUT_AE,
            "A higher truncation threshold at inference activates fewer experts (Table 7)",
            "Infer-AE",
            "active_experts",
            "negative",
        ),
        (
            INFER_CUT_NLL,
            "... at some cost in quality (Table 7: lower downstream accuracy at τ 2.4 "
            "than at the trained 1.2)",
            "validation NLL",
            "nll",
            "positive",
        ),
    ):
        a, b = at(hi, col), at(one, col)
        out.append(
            Finding(
                key,
                claim,
                f"{what} with every layer's cut at {factor} − at 1 × ({LEARNED})",
                paired_difference(a, b),
                source=Source(
                    SWEEP_TABLE,
                    "infer_ae" if col == "active_experts" else "nll",
                    LEARNED,
                    LEARNED,
                    match_a={"scale": factor},
                    match_b={"scale": "1 ×"},
                ),
                expect=expect,
                extra={
                    "arms": [LEARNED, LEARNED],
                    "rows": rows,
                    "table": SWEEP_TABLE,
                    "column": "infer_ae" if col == "active_experts" else "nll",
                    rows[0]: a,
                    rows[1]: b,
                },
            )
        )
    return out


def _slope(ks: list[float] | None) -> float | None:
    """The least-squares slope of ``ks`` over the index 0 … n−1."""
    if ks is None or len(ks) < 2:
        return None
    n = len(ks)
    mx, my = (n - 1) / 2, sum(ks) / n
    return sum((i - mx) * (k - my) for i, k in enumerate(ks)) / sum((i - mx) ** 2 for i in range(n))


def bound_lines(
    arm: str, ends: list[list[float] | None], seeds: list[int] | None = None
) -> list[str]:
    """Lines on whether any k_l of a learned arm ended on a bound (1 below, K − L + 1
    above; :data:`BOUND_SHARE`): a warning per seed where one did, else one line with
    the range of the shares."""
    seeds = seeds if seeds is not None else list(range(len(ends)))
    lines, shares_all = [], []
    for seed, ks in zip(seeds, ends, strict=True):
        if not ks:
            continue
        n, total = len(ks), sum(ks)
        room = total - n
        if room <= 0:
            continue
        shares = [(k - 1) / room for k in ks]
        shares_all += shares
        low = [i for i, p in enumerate(shares) if p <= BOUND_SHARE]
        high = [i for i, p in enumerate(shares) if p >= 1 - BOUND_SHARE]
        if not (low or high):
            continue
        parts = []
        if low:
            parts.append(f"layer(s) {', '.join(map(str, low))} on the lower bound 1")
        if high:
            parts.append(
                f"layer(s) {', '.join(map(str, high))} on the upper bound K − L + 1 = "
                f"{total - n + 1:g}"
            )
        lines.append(
            f"warning: {arm} seed {seed}: the learned k_l ended with {' and '.join(parts)} "
            f"(k_l {', '.join(f'{k:.2f}' for k in ks)}; a share (k_l − 1) / (K − L) within "
            f"{BOUND_SHARE:g} of 0 or 1): the allocation saturated, its gradient through "
            "softmax(η) all but vanished; a lower model.k_lr_scale keeps it off the bounds"
        )
    if shares_all and not lines:
        lines.append(
            f"{arm}: no k_l on a bound at the end (shares (k_l − 1) / (K − L) from "
            f"{min(shares_all):.2f} to {max(shares_all):.2f}; bound within {BOUND_SHARE:g})"
        )
    return lines


def checks(
    columns: dict[str, dict[str, list[Any]]],
    k_end: dict[str, list[list[float] | None]],
    sweeps: dict[str, list[dict[str, Any]]],
    seeds: list[int] | None = None,
) -> list[str]:
    """Lines saying whether the mechanisms the claims rest on acted: the learned k_l
    separated and stayed off their bounds, each soft arm's Infer-AE falls in its budget
    group, the fixed thresholds gave different AE, the sweep's 1 × row reproduces the
    arm's own Infer-AE."""
    lines = []
    for c in SOFT_CONFIGS:
        if not c.learned or c.soft not in k_end:
            continue
        ends = k_end[c.soft]
        spreads = [max(ks) - min(ks) for ks in ends if ks]
        if not spreads:
            lines.append(f"warning: no k_l logged for the learned arm {c.soft}")
            continue
        mean = sum(spreads) / len(spreads)
        text = "; ".join(", ".join(f"{k:.2f}" for k in ks) for ks in ends if ks)
        if mean < K_SPREAD_MIN:
            lines.append(
                f"warning: {c.soft}: the learned k_l ended only {mean:.3f} apart (max − min "
                f"over the layers, mean over seeds; threshold {K_SPREAD_MIN:g}): the "
                f"allocation did not separate the layers, so the allocation claims are not "
                f"tested (k_l at the end, per seed: {text})"
            )
        else:
            lines.append(
                f"{c.soft}: the learned k_l ended {mean:.2f} apart (max − min over the "
                f"layers, mean over seeds; threshold {K_SPREAD_MIN:g}): the allocation "
                f"acted (k_l at the end, per seed: {text})"
            )
        lines += bound_lines(c.soft, ends, seeds)
    for c in SOFT_CONFIGS:
        for name in (c.star, *([c.soft] if c.learned else [])):
            ae = [v for v in columns.get(name, {}).get("infer_ae") or [] if v is not None]
            if not ae:
                continue
            mean = sum(ae) / len(ae)
            g = group_of(mean)
            line = (
                f"{name} activates {mean:.2f} experts per token and layer at inference "
                f"(k = {c.k:g}, at most ceil(k α) = {math.ceil(c.k * c.alpha)})"
            )
            if g > c.group:
                lines.append(
                    f"warning: {line}: beyond its budget group ≤ {c.group} (the paper "
                    f"puts a row in the group of its Infer-AE: here ≤ {g}), so its "
                    f"comparisons with {GROUPS[c.group]} are at more compute"
                )
            elif g < c.group:
                lines.append(
                    f"{line}: within its budget group ≤ {c.group}; the paper's rule "
                    f"(the group of its Infer-AE) would put it in ≤ {g}"
                )
            else:
                lines.append(f"{line}: in its budget group ≤ {c.group}")
    lo, hi = f"softmoe-star-tau{min(FIXED_TAUS):g}", f"softmoe-star-tau{max(FIXED_TAUS):g}"
    a, b = columns.get(lo, {}).get("infer_ae"), columns.get(hi, {}).get("infer_ae")
    if a and b and None not in a and None not in b:
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        line = f"the fixed thresholds activate {ma:.2f} ({lo}) and {mb:.2f} ({hi}) experts"
        if ma == mb:
            lines.append(f"warning: {line}: the threshold did not act")
        elif min(ma, mb) < 1:
            lines.append(
                f"warning: {line}: below 1, some tokens pass the MoE layers with no expert"
            )
        else:
            lines.append(line)
    for name, docs in sweeps.items():
        one = _scale_index(1.0)
        sweep_ae = [d["results"][one]["active_experts"] for d in docs]
        own = columns.get(name, {}).get("infer_ae") or []
        gaps = [abs(x - y) for x, y in zip(sweep_ae, own, strict=False) if None not in (x, y)]
        if gaps and max(gaps) <= AE_MATCH:
            lines.append(
                f"{name}: the truncation sweep at 1 × reproduces the arm's Infer-AE "
                f"(within {max(gaps):.3f})"
            )
        elif gaps:
            lines.append(
                f"warning: {name}: the truncation sweep at 1 × differs from the arm's "
                f"Infer-AE by up to {max(gaps):.3f} experts"
            )
    return lines
