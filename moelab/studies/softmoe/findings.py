"""The claims of the SoftMoE paper that the ``softmoe`` study tests, as findings, and the
checks that its mechanisms acted (:mod:`moelab.studies.softmoe`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moelab.studies.paired import Finding, Source, interval, paired_difference
from moelab.studies.softmoe.grid import FIXED_TAUS, INFER_SCALES, JITTER_KS, SOFT_K

REFERENCE = "sparse-k2"
"""The reference arm: sparse MoE, softmax top-2 without renormalisation, jitter off (the
sparse baseline at the SoftMoE arms' k)."""
STAR = "softmoe-star"
LEARNED = "softmoe"
K_SPREAD_MIN = 0.25
"""The check's threshold on the learned k_l's spread at the end (max − min over the
layers, mean over seeds): below it the allocation did not separate the layers."""
LOAD_TOLERANCE = 0.02
"""'No discernible impact on load balancing': |Δ relative load variance| within 0.02, the
spread of the paper's own Table 5 at k = 2 on OWT (0.05 sparse, 0.06-0.07 SoftMoE)."""
AE_BUDGET = 0.25
"""The check that a calibrated SoftMoE arm computes about its budget: its Infer-AE within
this fraction of k (else its comparisons with the reference are at another compute)."""
AE_MATCH = 0.05
"""The check that the sweep's 1 × row reproduces the arm's Infer-AE (same weights, same
batches): they agree within this many experts."""


@dataclass(frozen=True)
class Claim:
    """A claim measured as the paired difference of ``column`` between two arms,
    ``arm − versus``, seed by seed, with the sign ``expect`` predicts."""

    key: str
    claim: str
    arm: str
    versus: str
    column: str
    expect: str
    tolerance: float = 0.0
    note: str = ""


_COLUMN_TEXT = {
    "loss": ("validation loss", ".3f"),
    "train_ae": ("Train-AE", ".3f"),
    "infer_ae": ("Infer-AE", ".3f"),
    "load_rel_var": ("relative load variance", ".4f"),
}

LATER_LAYERS = "later-layers-larger-k"
INFER_CUT_AE = "inference-cut-fewer-experts"
INFER_CUT_NLL = "inference-cut-costs-loss"

CLAIMS: list[Claim] = [
    Claim(
        "star-lower-loss",
        "SoftMoE* reaches a lower language-modelling loss than sparse MoE at the same k (Table 1)",
        STAR,
        REFERENCE,
        "loss",
        "negative",
    ),
    Claim(
        "star-fewer-experts-train",
        "SoftMoE* activates fewer experts than sparse top-k in training (17-24% fewer at "
        "k ≤ 2; Table 1)",
        STAR,
        REFERENCE,
        "train_ae",
        "negative",
    ),
    Claim(
        "star-fewer-experts-inference",
        "SoftMoE* activates fewer experts than sparse top-k at inference (Table 1)",
        STAR,
        REFERENCE,
        "infer_ae",
        "negative",
    ),
    Claim(
        "softmoe-matches-sparse",
        "SoftMoE with learned allocation at the budget K = 2 L matches or beats sparse "
        "top-2 in loss (abstract, Table 1)",
        LEARNED,
        REFERENCE,
        "loss",
        "negative",
    ),
    Claim(
        "learned-lower-loss",
        "Learned allocation improves the loss over SoftMoE* (Section 5, Table 1)",
        LEARNED,
        STAR,
        "loss",
        "negative",
    ),
    Claim(
        "learned-more-experts",
        "... with more active experts on average than SoftMoE* (Section 5, Tables 1 and 4)",
        LEARNED,
        STAR,
        "infer_ae",
        "positive",
    ),
    Claim(
        "load-balance-unchanged",
        "SoftMoE routing has no discernible effect on load balance (Table 5)",
        STAR,
        REFERENCE,
        "load_rel_var",
        "zero",
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
    ),
    *(
        Claim(
            f"jitter-hurts-k{k}",
            f"Router jitter degrades the sparse top-{k} baseline (Table 8, Appendix B)",
            f"sparse-k{k}-jitter",
            f"sparse-k{k}",
            "loss",
            "positive",
            note="the paper's own loss column moves by ±0.01 (its downstream columns "
            "carry the claim)",
        )
        for k in JITTER_KS
    ),
]
"""The paper's claims that compare two arms' columns."""

CLAIM_KEYS: tuple[str, ...] = (
    LATER_LAYERS,
    *(c.key for c in CLAIMS),
    INFER_CUT_AE,
    INFER_CUT_NLL,
)
"""Every claim the study tests (``SoftMoEStudy.claims``)."""


def _cut_source(column: str, factor: str) -> Source:
    """The inference-truncation table's rows of the learned arm at ``factor`` and 1 ×."""
    return Source(
        "softmoe_inference_truncation",
        column,
        LEARNED,
        LEARNED,
        match_a={"scale": factor},
        match_b={"scale": "1 ×"},
    )


def _scale_index(scale: float) -> int:
    return list(INFER_SCALES).index(scale)


def findings(
    columns: dict[str, dict[str, list[Any]]],
    k_end: list[list[float] | None],
    sweeps: dict[str, list[dict[str, Any]]],
) -> list[Finding]:
    """One Finding per claim of :data:`CLAIM_KEYS`.

    ``columns``: per arm, per column of :data:`_COLUMN_TEXT`, one value per seed;
    ``k_end``: per seed, the learned arm's k_l of every MoE layer at the last logged
    step; ``sweeps``: per arm, per seed, its inference-time truncation sweep
    (:func:`_sweep`)."""
    last_first = [None if ks is None else ks[-1] - ks[0] for ks in k_end]
    out = [
        Finding(
            LATER_LAYERS,
            "Later layers learn a larger share of the budget: k_l grows with depth "
            "(Figure 6, Section 5)",
            f"k_l of the last MoE layer − of the first at the end of training ({LEARNED})",
            interval(last_first),
            expect="positive",
            measure=True,
            note="slope: the least-squares slope of the final k_l over the layer index",
            extra={
                "k_end": [list(ks) if ks is not None else None for ks in k_end],
                "slope": [_slope(ks) for ks in k_end],
            },
        )
    ]
    for c in CLAIMS:
        text, spec = _COLUMN_TEXT[c.column]
        a = columns.get(c.arm, {}).get(c.column)
        b = columns.get(c.versus, {}).get(c.column)
        n = len(k_end)
        a = list(a) if a is not None else [None] * n
        b = list(b) if b is not None else [None] * n
        out.append(
            Finding(
                c.key,
                c.claim,
                f"Δ {text}, {c.arm} − {c.versus}",
                paired_difference(a, b),
                source=Source(None, c.column, c.arm, c.versus),
                expect=c.expect,
                tolerance=c.tolerance,
                spec=spec,
                note=c.note,
                extra={c.arm: a, c.versus: b},
            )
        )
    docs = sweeps.get(LEARNED, [])
    hi, one = _scale_index(max(INFER_SCALES)), _scale_index(1.0)

    def at(j: int, key: str) -> list[float | None]:
        return [d["results"][j][key] for d in docs]

    factor = f"{max(INFER_SCALES):g} ×"
    out.append(
        Finding(
            INFER_CUT_AE,
            "A higher truncation threshold at inference activates fewer experts (Table 7)",
            f"Infer-AE with every layer's cut at {factor} − at 1 × ({LEARNED})",
            paired_difference(at(hi, "active_experts"), at(one, "active_experts")),
            source=_cut_source("infer_ae", factor),
            expect="negative",
        )
    )
    out.append(
        Finding(
            INFER_CUT_NLL,
            "... at some cost in quality (Table 7: lower downstream accuracy at τ 2.4 "
            "than at the trained 1.2)",
            f"validation NLL with every layer's cut at {factor} − at 1 × ({LEARNED})",
            paired_difference(at(hi, "nll"), at(one, "nll")),
            source=_cut_source("nll", factor),
            expect="positive",
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


def checks(
    columns: dict[str, dict[str, list[Any]]],
    k_end: list[list[float] | None],
    sweeps: dict[str, list[dict[str, Any]]],
) -> list[str]:
    """Lines saying whether the mechanisms the claims rest on acted: the learned k_l
    separated, the fixed thresholds gave different AE, the sweep's 1 × row reproduces
    the arm's own Infer-AE."""
    lines = []
    spreads = [max(ks) - min(ks) for ks in k_end if ks]
    if not spreads:
        lines.append(f"warning: no k_l logged for the learned arm {LEARNED}")
    else:
        mean = sum(spreads) / len(spreads)
        ends = "; ".join(", ".join(f"{k:.2f}" for k in ks) for ks in k_end if ks)
        if mean < K_SPREAD_MIN:
            lines.append(
                f"warning: the learned k_l ended only {mean:.3f} apart (max − min over the "
                f"layers, mean over seeds; threshold {K_SPREAD_MIN:g}): the allocation did "
                f"not separate the layers, so the allocation claims are not tested (k_l at "
                f"the end, per seed: {ends})"
            )
        else:
            lines.append(
                f"the learned k_l ended {mean:.2f} apart (max − min over the layers, mean "
                f"over seeds; threshold {K_SPREAD_MIN:g}): the allocation acted (k_l at the "
                f"end, per seed: {ends})"
            )
    for name in (STAR, LEARNED):
        ae = [v for v in columns.get(name, {}).get("infer_ae") or [] if v is not None]
        if not ae:
            continue
        mean = sum(ae) / len(ae)
        if abs(mean - SOFT_K) > AE_BUDGET * SOFT_K:
            lines.append(
                f"warning: {name} activates {mean:.2f} experts per token and layer at "
                f"inference, not its budget k = {SOFT_K:g} (calibrated before the first "
                f"step): its comparisons with {REFERENCE} are at another compute"
            )
        else:
            lines.append(f"{name} activates {mean:.2f} experts at inference (k = {SOFT_K:g})")
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
