"""The gate-normalisation study (``moelab study gate-norm``): seven ways of turning router
scores into gate weights, trained side by side with the same model, data and seeds.

The essay (Su, 2026; ``router-gate-normalisation.txt`` among the papers) asks whether
the gate that multiplies the experts should be normalised, and whether top-k should come
after the normalisation or be followed by a re-normalisation. It derives, from a
REINFORCE view of top-1 routing, that the gate should be a normalised distribution p and
an expert's output should be weighted by p_i itself (no re-normalisation), and it lists
the alternatives this study trains:

``softmax-topk``
    p = softmax(s), keep the top-2, weights p_i (top-k after normalisation).
``softmax-renorm``
    the same top-2, weights p_i / (p_i + p_j) (Re-Norm; Mixtral's router). With K = 1
    every weight is 1 and the router gets no gradient, so moelab refuses that config
    (the report shows the refusal).
``sigmoid-bias``
    weights sigmoid(s_i), not normalised, with auxiliary-loss-free bias balancing
    (DeepSeek's Loss-Free balancing: a selection-only bias moved by the load).
``relu``
    ReLU gates, every positive one kept (ReMoE), their number steered to k = 2 on
    average by the adaptive L1 penalty.
``straight-through``
    weight 1 forward, the gradient of log p backward (the essay's straight-through
    estimator).
``sample``
    K = 2 experts drawn from the top K + c = 3 in proportion to p (training only).
``noisy``
    Gaussian noise on the scores before top-2 (training only; the weights are p of the
    clean scores).

Every arm routes top-2 (ReLU: 2 on average) with the same seed and data. The softmax
arms balance with the Switch loss (weight 0.01); the sigmoid arm with the loss-free
bias alone and the ReLU arm with its L1 term alone, as their recipes do. The essay has
no experiment of its own, so the ``paper`` scale is refused.

Measured on each trained run (:func:`measure`, one pass over the first validation
batches with :func:`moelab.diagnostics.stats`): the validation loss and perplexity, the
active experts and contributors per token, the discarded mass (for maps on the simplex,
where it is a share of probability), the mean sum of a token's gate weights, and the CV
of the experts' load; and how often training-time routing (noise, sampling) leaves the
evaluation-time choice (:func:`exploration`). The K = 1 renormalised router is built and
refused (:func:`k1_refusal`), beside the gradient that explains why: on random scores
(:func:`gate_gradient`) and through the trained renorm routers forced to K = 1
(:func:`k1_checkpoint_gradient`).

The report opens with the essay's claims (:data:`CLAIMS`, :func:`findings`): the K = 1
identity, checked seed by seed, and each arm against the reference ``softmax-topk`` as a
paired difference over seeds (every seed of every arm reads one corpus, so seed ``s`` of
two arms differs by the gate alone) with its 95% interval; :func:`checks` says whether
the mechanisms the claims rest on acted (exploration, the ReLU arm's expert count).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moelab.studies._core import (
    Arm,
    Context,
    Section,
    Study,
    StudyTable,
    arm_config,
)
from moelab.studies._gate_norm_figures import training_figure
from moelab.studies._gate_norm_measures import (
    exploration,
    gate_gradient,
    k1_checkpoint_gradient,
    k1_refusal,
    measure,
    selected_TE,
)
from moelab.studies.paired import Finding, findings_section, interval, paired_difference
from moelab.studies.settings import DEFAULT, settings

__all__ = [
    "ARMS",
    "CLAIMS",
    "GateNormStudy",
    "exploration",
    "findings",
    "gate_gradient",
    "k1_checkpoint_gradient",
    "k1_refusal",
    "measure",
    "selected_TE",
]

REFERENCE = "softmax-topk"
"""The arm the paired loss differences are taken against (the essay's recommended gate)."""
TOP_K = 2
"""K of every arm (the ReLU arm's mean number of active experts)."""
AUX_WEIGHT = 0.01
"""Switch balance-loss weight of the softmax arms (Switch Transformer's alpha)."""
BIAS_RATE = 0.01
"""Loss-free balancing's bias update rate of the sigmoid arm."""
SAMPLE_EXTRA = 1
"""c of the sampling arm: K experts drawn from the top K + c."""
NOISE_STD = 0.1
"""Standard deviation of the noise on the scores of the noisy arm."""
L1_INIT = 1e-8
"""lambda_0 of the ReLU arm's adaptive L1 (ReMoE's)."""
CPU_STEPS = 180
"""Training steps of every run at the cpu scale (the base's 250 cut to fit the budget)."""
CPU_EVAL_EVERY = 60
"""Validation interval at the cpu scale (three evaluations, the last at the end)."""
CPU_CHECKPOINT_EVERY = 90
"""Checkpoint interval at the cpu scale (the run's end is always saved)."""

_SOFTMAX_BALANCE = {"aux_weight": AUX_WEIGHT}

ARMS: list[tuple[str, str, dict[str, Any]]] = [
    ("softmax-topk", "softmax, top-2, no renorm", {"map": "softmax", "gate": "map"}),
    ("softmax-renorm", "softmax, top-2, renorm", {"map": "softmax", "gate": "renorm"}),
    (
        "sigmoid-bias",
        "sigmoid, top-2, loss-free bias",
        {"map": "sigmoid", "gate": "map", "bias_rate": BIAS_RATE},
    ),
    (
        "relu",
        f"ReLU, L1 to k = {TOP_K}",
        {
            "map": "relu",
            "gate": "map",
            "selection": "threshold",
            "truncation": 0.0,
            "l1_target": float(TOP_K),
            "l1_init": L1_INIT,
        },
    ),
    (
        "straight-through",
        "softmax, top-2, straight-through",
        {"map": "softmax", "gate": "straight_through"},
    ),
    (
        "sample",
        f"softmax, sample 2 of top {TOP_K + SAMPLE_EXTRA}",
        {"map": "softmax", "gate": "map", "sample_extra": SAMPLE_EXTRA},
    ),
    (
        "noisy",
        f"softmax, noisy scores (sd {NOISE_STD:g}), top-2",
        {"map": "softmax", "gate": "map", "noise_std": NOISE_STD},
    ),
]
"""(arm name, label, router fields) of every arm; the softmax arms also get the Switch
balance loss (``aux_weight``)."""

MAX_BATCHES = {"quick": 2, "cpu": 32}
"""Validation batches of the analysis at each scale (``--max-batches`` overrides)."""

SETTINGS: list[tuple[str, str, str]] = [
    ("top-k", f"K = {TOP_K} in every arm", "the essay's setting for its variants (top-k, K > 1)"),
    (
        "softmax arms' balance",
        f"Switch loss, weight {AUX_WEIGHT:g}",
        "moelab's choice: the essay relies on some load balancing for top-k",
    ),
    (
        "sigmoid arm",
        f"no renorm, loss-free bias, rate {BIAS_RATE:g}",
        "moelab's choice: the essay's unnormalised case; a rate 10x DeepSeek's 0.001 "
        "because the runs are short",
    ),
    (
        "ReLU arm",
        f"keep every positive gate, adaptive L1 to k = {TOP_K}, lambda_0 = {L1_INIT:g}",
        "ReMoE's router and lambda_0",
    ),
    (
        "sampling",
        f"c = {SAMPLE_EXTRA}: 2 of the top 3, in proportion to p",
        "moelab's choice of c (the essay: 'slightly expand beyond the top-k')",
    ),
    (
        "noise",
        f"Gaussian, sd {NOISE_STD:g} on the scores",
        "moelab's choice of sd (the essay: 'slight noise')",
    ),
]
"""(setting, value, where it comes from) of the choices the report lists."""

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

_COLUMN_TEXT = {"val_loss": ("val loss", ".4f"), "load_cv": ("load CV", ".3f")}


def findings(
    main: Mapping[str, Mapping[str, Any]],
    k1: Sequence[Mapping[str, float]],
    reference: str = REFERENCE,
) -> list[Finding]:
    """One Finding per claim: the K = 1 identity from ``k1`` (per seed,
    :func:`k1_checkpoint_gradient` of the renormalised arm: the renorm gradient over the
    plain gate's, each seed checked on its own) and each of :data:`CLAIMS` as the paired
    difference of its arm's column from the ``reference`` arm's in ``main`` (the main
    table's rows by arm name, per-seed lists)."""
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
            note="L: the cross-entropy of the first validation batch, no auxiliary loss",
            extra={
                "renorm_grad_norm": [g["renorm"] for g in k1],
                "map_grad_norm": [g["map"] for g in k1],
            },
        )
    ]
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
                expect=c.expect,
                tolerance=c.tolerance,
                spec=spec,
                note=c.note,
                extra={c.arm: list(arm[c.column]), reference: list(ref[c.column])},
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
        if abs(mean - TOP_K) > 0.25 * TOP_K:
            lines.append(
                f"warning: the ReLU arm computes {mean:.2f} experts per token, not its "
                f"target {TOP_K}: its comparison is at another compute"
            )
        else:
            lines.append(f"the ReLU arm computes {mean:.2f} experts per token (target {TOP_K})")
    return lines


# ----------------------------------------------------------------------------- study


class GateNormStudy(Study):
    """Gate normalisation: seven gates, top-2, same seeds and data (see the module
    docstring)."""

    name = "gate-norm"
    reference = REFERENCE
    claims = (K1_CLAIM, *(c.key for c in CLAIMS))
    title = (
        "Gate normalisation: softmax with and without renorm, sigmoid, ReLU, "
        "straight-through, sampling, noise"
    )
    paper = "a blog essay on whether MoE gates should be normalised (Su, 2026)"
    paper_refusal = (
        "gate-norm has no paper scale: the gate-normalisation essay reports no experiment "
        "of its own (no model, data or budget to reproduce); use --scale cpu or --scale quick"
    )

    def common(self, scale: str) -> dict[str, Any]:
        if scale == "quick":
            # NOTE: the preset's learning rates, not the quick base's
            return settings(
                "quick",
                {"top_k": TOP_K, "lr": DEFAULT, "min_lr": DEFAULT, "log_every": 4},
            )
        if scale == "cpu":
            # NOTE: 180 steps of 8 x 128 tokens (184k tokens) per arm, validation every 60
            # (the cpu budget: 3 seeds within ~45 minutes on two cores). Measured
            # on one quiet thread: 35-36 s a run (0.16 s a step with the evaluations, ~7 s
            # to start), ~4 minutes a seed of the seven arms; a seed of 250 steps took
            # 20.5 minutes on the shared machine, which scales to ~15 at 180
            return settings(
                "cpu",
                {
                    "top_k": TOP_K,
                    "steps": CPU_STEPS,
                    "eval_every": CPU_EVAL_EVERY,
                    "checkpoint_every": CPU_CHECKPOINT_EVERY,
                    "device": "cpu",
                },
            )
        raise ValueError(self.paper_refusal or f"unknown scale {scale!r}")

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        out = []
        for name, label, router in ARMS:
            # NOTE: every arm states its balance-loss weight (the library default is
            # not the essay's choice for the sigmoid and ReLU arms, which balance otherwise)
            router = {"aux_weight": 0.0, **router}
            if router["map"] == "softmax":
                router.update(_SOFTMAX_BALANCE)
            out.append(Arm(name, label, {"model": {"router": router}}))
        return out

    def analyse(self, ctx: Context) -> list[Section]:
        max_batches = ctx.max_batches or MAX_BATCHES.get(ctx.scale)
        main = self._main_section(ctx, max_batches)
        explore = self._exploration_section(ctx, max_batches)
        k1 = ctx.per_seed(
            "softmax-renorm",
            lambda run: ctx.cached(run, "gate-norm-k1grad-v1", lambda: k1_checkpoint_gradient(run)),
        )
        rows = {r["name"]: r for r in main.tables[0].rows}
        explored = {r["name"]: r["explored"] for r in explore.tables[0].rows}
        sections = [
            findings_section(findings(rows, k1), checks=checks(rows, explored, k1)),
            main,
            explore,
            self._refusal_section(ctx, k1),
        ]
        settings = StudyTable(
            "settings",
            "The arms' settings and where they come from",
            [("setting", "setting", "s"), ("value", "value", "s"), ("source", "source", "s")],
            [{"setting": s, "value": v, "source": src} for s, v, src in SETTINGS],
        )
        sections.append(Section("Settings", "", [settings]))
        fig = training_figure(ctx)
        if fig is not None:
            sections.append(
                Section(
                    "Training curves",
                    "Mean over the seeds of each arm: the validation loss, the active "
                    "experts per token and the load CV of the logged training batches.",
                    figures=[fig],
                )
            )
        return sections

    def _main_section(self, ctx: Context, max_batches: int | None) -> Section:
        """Loss and routing of each gate, with the paired loss differences."""
        key = f"gate-norm-v1-b{max_batches}"

        def numbers(run: Path) -> dict[str, Any]:
            return ctx.cached(run, key, lambda: measure(run, max_batches))

        rows = []
        tokens = None
        for arm in ctx.arms:
            ctx.say(f"gate-norm: measuring {arm.name}")
            got = ctx.per_seed(arm.name, numbers)
            tokens = got[0]["tokens"]
            row: dict[str, Any] = {"arm": arm.label, "name": arm.name}
            for col in ("val_loss", "ppl", "active_experts", "contributors", "gate_sum"):
                row[col] = [g[col] for g in got]
            row["load_cv"] = [g["load_cv"] for g in got]
            dm = [g["discarded_mass"] for g in got]
            row["discarded_mass"] = None if all(v is None for v in dm) else dm
            rows.append(row)
        main = StudyTable(
            "main",
            "Loss and routing of each gate",
            [
                ("arm", "arm", "s"),
                ("val loss", "val_loss", ".4f"),
                ("ppl", "ppl", ".2f"),
                ("active experts", "active_experts", ".3f"),
                ("contributors", "contributors", ".3f"),
                ("discarded mass", "discarded_mass", ".3f"),
                ("gate sum", "gate_sum", ".3f"),
                ("load CV", "load_cv", ".3f"),
            ],
            rows,
            note=(
                f"On the first {max_batches} validation batches ({tokens} tokens) of each run, "
                "with the trained K and no exploration (noise and sampling act in training "
                "only). val loss: mean NLL per token (nats); ppl = exp(val loss), per seed. "
                "Every seed reads one corpus (tokenizer and split), so the spread over "
                "seeds is the initialisation's and the data order's; each arm's difference "
                f"from {REFERENCE}, seed by seed, is in the paired differences at the end. "
                "active experts, contributors: experts per token computed / with a positive "
                "gate weight. discarded mass: the map's probability left outside the kept "
                "experts, for the maps on the simplex ('-': sigmoid and ReLU values are no "
                "distribution; ReLU keeps every positive gate). gate sum: a token's gate "
                "weights summed (1 under renorm, K under straight-through). load CV: std / "
                "mean of the experts' load. Means over the MoE layers."
            ),
        )
        return Section(
            "Loss and routing",
            "Every arm is the `tiny` model routed top-2 (ReLU: 2 experts on average), "
            "the same seeds and data; only the gate differs. The softmax arms add the "
            f"Switch balance loss (weight {AUX_WEIGHT:g}); the sigmoid arm balances "
            "with the loss-free bias only and the ReLU arm with its L1 term only.",
            [main],
        )

    def _exploration_section(self, ctx: Context, max_batches: int | None) -> Section:
        """How often training-time routing leaves the top-k."""
        explore_key = f"gate-norm-explore-v1-b{max_batches}"

        def explored(run: Path) -> float | None:
            return ctx.cached(run, explore_key, lambda: exploration(run, max_batches))

        explore = StudyTable(
            "exploration",
            "How often training-time routing leaves the top-k",
            [("arm", "arm", "s"), ("explored share", "explored", ".3f")],
            [
                {"arm": a.label, "name": a.name, "explored": ctx.per_seed(a.name, explored)}
                for a in ctx.arms
            ],
            note=(
                "The trained routers on the same validation tokens: the share of the "
                "experts chosen in evaluation mode that training mode (noise on the scores, "
                "sampling from the top K + c) does not choose. 0: no exploration."
            ),
        )
        return Section(
            "Exploration",
            "The essay's two ways of exploring near the top-k, measured on the trained routers.",
            [explore],
        )

    def _refusal_section(self, ctx: Context, k1: Sequence[Mapping[str, float]]) -> Section:
        renorm = next(a for a in ctx.arms if a.name == "softmax-renorm")
        run = ctx.runs[renorm.name][0]
        router = arm_config(ctx.common, renorm, ctx.seeds[0], run).model_config().router_config()
        message = k1_refusal(router)
        if message is None:
            said = "moelab accepted it (it should not: the router would get no gradient)."
        else:
            said = f"moelab refuses it with:\n\n> ValueError: {message}"
        grads = StudyTable(
            "k1-gradient",
            "The router's gradient through the gate (largest |dL/ds|)",
            [("gate", "gate", "s"), ("K", "k", "d"), ("max |dL/ds|", "grad", ".3g")],
            [
                {"gate": gate, "k": k, "grad": gate_gradient(gate, k, router.n_experts)}
                for gate, k in (("renorm", 1), ("renorm", 2), ("map", 1), ("straight_through", 1))
            ],
            note=(
                "Softmax scores s of 64 random tokens, L = sum of the gate weights times "
                "random expert outputs: with K = 1 the renormalised weight is p / p = 1 for "
                "every token, so no gradient reaches s (what is left, of order 1e-16, is "
                "float64 rounding)."
            ),
        )
        trained = StudyTable(
            "k1-checkpoint",
            "The trained routers' gradient at K = 1 (‖∂L/∂W‖)",
            [("gate", "gate", "s"), ("‖∂L/∂W‖", "grad", ".3g")],
            [
                {"gate": "renorm", "grad": [g["renorm"] for g in k1]},
                {"gate": "map (p itself: the control)", "grad": [g["map"] for g in k1]},
            ],
            note=(
                "The trained `softmax-renorm` checkpoint of each seed with every router "
                "forced to top-1 (the config moelab refuses is never built): L is the "
                "cross-entropy of the first validation batch, W the routers' weights "
                "together. With the renormalised gate the weight is p / p = 1 and what is "
                "left is float32 rounding; the plain gate (w = p) on the same checkpoint "
                "and batch shows the size of a gradient that does reach the router."
            ),
        )
        return Section(
            "The K = 1 renormalised router",
            "The essay notes that Re-Norm needs K > 1. The `softmax-renorm` arm's router "
            f"(d_model {router.d_model}, {router.n_experts} experts) with top_k = 1: {said}",
            [grads, trained],
        )
