"""The essay's claims that the ``gate-norm`` study tests, as findings, and the checks
that what they rest on happened (:mod:`moelab.studies.gate_norm`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from moelab.studies.gate_norm.grid import TOP_K
from moelab.studies.paired import Finding, Source, interval, paired_difference

REFERENCE = "softmax-topk"
"""The arm the paired loss differences are taken against (the essay's recommended gate)."""

SAME = 0.05
"""The tolerance (nats) within which two gates' validation losses count as "about the
same" (the essay: the variants "perform more or less the same"): moelab's choice, about
5% in perplexity."""
K1_TOLERANCE = 1e-5
"""How far from 0 the K = 1 renorm gradient, relative to the plain gate's on the same
checkpoint and batch, may lie: float32 rounding of p / p (of order 1e-7)."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of the essay that the arms test: ``arm``'s ``column`` of the main table
    minus the reference arm's, seed by seed, with the sign ``expect`` predicts."""

    key: str
    claim: str
    arm: str
    column: str
    expect: str
    tolerance: float = 0.0
    note: str = ""


CLAIMS: list[Claim] = [
    Claim(
        "renorm-k2-worse",
        "the gate should be normalised but not re-normalised: at K = 2 renorm does worse "
        "than the plain p",
        "softmax-renorm",
        "val_loss",
        "positive",
        note="the essay's derivation; it also says that in practice the variants do about the same",
    ),
    Claim(
        "straight-through-worse",
        "the straight-through estimator (1 forward, the gradient of log p backward) is "
        "suboptimal: its forward and backward disagree",
        "straight-through",
        "val_loss",
        "positive",
    ),
    Claim(
        "sigmoid-competitive",
        "sigmoid gates with loss-free balancing are competitive with softmax",
        "sigmoid-bias",
        "val_loss",
        "zero",
        SAME,
    ),
    Claim(
        "relu-competitive",
        "any non-negative gate works: ReLU gates (ReMoE) do about as well as softmax",
        "relu",
        "val_loss",
        "zero",
        SAME,
    ),
    Claim(
        "sample-stable",
        "drawing K of the top K + c explores without costing stability (or loss)",
        "sample",
        "val_loss",
        "zero",
        SAME,
    ),
    Claim(
        "noise-stable",
        "slight noise on the logits before top-k explores without costing stability (or loss)",
        "noisy",
        "val_loss",
        "zero",
        SAME,
    ),
    Claim(
        "loss-free-balances",
        "loss-free bias balancing (why DeepSeek moved to sigmoid) balances the load without "
        "an auxiliary loss, better than the Switch loss",
        "sigmoid-bias",
        "load_cv",
        "negative",
        note="the Loss-Free balancing paper's claim, which the essay builds on",
    ),
]
"""The essay's claims that compare an arm with the reference (besides the K = 1 identity,
``K1_CLAIM``), in the order of the findings table."""
K1_CLAIM = "renorm-k1-no-gradient"
"""The key of the K = 1 identity: with one expert the re-normalised weight is p / p = 1."""
ORACLE_CLAIM = "router-ranks-by-loss"
"""The key of the essay's design principle on the trained reference routers: the router
ranks the experts as their losses do (argmax rho = argmin l), measured by the loss
oracle (:func:`moelab.studies.gate_norm.run.oracle`)."""
RELU_TOLERANCE = 0.1
"""How far (a share of K) the ReLU arm's measured experts per token may lie from its
target K before the report warns that its comparison is at another compute."""

_COLUMN_TEXT = {"val_loss": ("val loss", ".4f"), "load_cv": ("load CV", ".3f")}


def findings(
    main: Mapping[str, Mapping[str, Any]],
    k1: Sequence[Mapping[str, float]],
    reference: str = REFERENCE,
    oracle: Mapping[str, Sequence[float | None]] | None = None,
) -> list[Finding]:
    """One Finding per claim: the K = 1 identity from ``k1`` (per seed,
    :func:`k1_checkpoint_gradient` of the renormalised arm: the renorm gradient over the
    plain gate's, each seed checked on its own), each of :data:`CLAIMS` as the paired
    difference of its arm's column from the ``reference`` arm's in ``main`` (the main
    table's rows by arm name, per-seed lists), and :data:`ORACLE_CLAIM` from ``oracle``
    (per arm name, the loss oracle's Spearman correlation per seed; None: not
    measured) on the ``reference`` arm."""
    ratios = [g["renorm"] / g["map"] if g["map"] > 0 else math.nan for g in k1]
    out = [
        Finding(
            K1_CLAIM,
            "Re-Norm with K = 1 gives the router no gradient (every weight is p / p = 1)",
            "‖∂L/∂W‖ of the trained softmax-renorm routers forced to K = 1, renorm ÷ plain "
            "gate (same checkpoint and batch)",
            interval(ratios),
            expect="zero",
            tolerance=K1_TOLERANCE,
            exact=True,
            spec=".1e",
            measure=True,
            note="L: the cross-entropy of the first validation batch, no auxiliary loss",
            extra={
                "renorm_grad_norm": [g["renorm"] for g in k1],
                "map_grad_norm": [g["map"] for g in k1],
            },
        )
    ]
    rho = list((oracle or {}).get(reference, [None] * len(k1)))
    ref = main[reference]
    for c in CLAIMS:
        text, spec = _COLUMN_TEXT[c.column]
        arm = main[c.arm]
        out.append(
            Finding(
                c.key,
                c.claim,
                f"Δ {text}, {c.arm} − {reference}",
                paired_difference(arm[c.column], ref[c.column]),
                source=Source("main", c.column, c.arm, reference),
                expect=c.expect,
                tolerance=c.tolerance,
                spec=spec,
                note=c.note,
                extra={c.arm: list(arm[c.column]), reference: list(ref[c.column])},
            )
        )
    out.append(
        Finding(
            ORACLE_CLAIM,
            "the router should rank the experts by their loss (argmax ρ = argmin ℓ, the "
            "essay's design principle): a trained router's ranking follows the experts' "
            "losses",
            f"Spearman ρ between the {reference} router's values and −ℓ(e_i) over the "
            "experts, mean over sampled validation tokens (ℓ(e_i): the token's next-token "
            "loss with the last MoE layer's output replaced by expert i's alone)",
            interval(rho),
            expect="positive",
            measure=True,
            spec=".3f",
            note="0: a ranking unrelated to the losses; the oracle table gives every arm",
            extra={"spearman": {name: list(v) for name, v in (oracle or {}).items()}},
        )
    )
    return out


def checks(
    main: Mapping[str, Mapping[str, Any]],
    explored: Mapping[str, Sequence[float | None]],
    k1: Sequence[Mapping[str, float]],
) -> list[str]:
    """Lines saying whether each mechanism the claims rest on acted: the control of the
    K = 1 measurement sees a gradient, the exploring arms explored, the ReLU arm's L1 held
    its experts near K."""
    lines = []
    control = [g["map"] for g in k1]
    if control and min(control) > 0:
        lines.append(
            "the plain gate at K = 1 on the same checkpoints gives ‖∂L/∂W‖ = "
            + ", ".join(f"{v:.3g}" for v in control)
            + " (renorm: "
            + ", ".join(f"{g['renorm']:.1e}" for g in k1)
            + "): the measurement sees a gradient where there is one"
        )
    else:
        lines.append("warning: the plain gate at K = 1 gave the router no gradient either")
    for name, what in (("sample", "sampling 2 of the top 3"), ("noisy", "noise on the scores")):
        values = [v for v in explored.get(name, []) if v is not None]
        if values and min(values) > 0:
            lines.append(
                f"{what} changed {100 * sum(values) / len(values):.0f}% of the experts "
                f"chosen at evaluation ({name}, mean over seeds): the arm explored"
            )
        else:
            lines.append(f"warning: {what} ({name}) never left the evaluation-time top-k")
    relu = [v for v in main.get("relu", {}).get("active_experts", []) if v is not None]
    if relu:
        mean = sum(relu) / len(relu)
        if abs(mean - TOP_K) > RELU_TOLERANCE * TOP_K:
            lines.append(
                f"warning: the ReLU arm computes {mean:.2f} experts per token, not its "
                f"target {TOP_K} (±{RELU_TOLERANCE:.0%}): its adaptive L1 did not reach "
                "the target in this run, so its comparison is at another compute"
            )
        else:
            lines.append(
                f"the ReLU arm computes {mean:.2f} experts per token: its target {TOP_K} "
                f"met (±{RELU_TOLERANCE:.0%})"
            )
    return lines
