"""The analysis of the ``gate-norm`` study (:mod:`moelab.studies.gate_norm`): the
report's sections from what :mod:`~moelab.studies.gate_norm.run` measured on each run
(loss and routing per gate, exploration, the K = 1 refusal), the findings, the settings
table and the figure of :mod:`~moelab.studies.gate_norm.figures`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moelab.studies.core import Context, Section, StudyTable, arm_config
from moelab.studies.gate_norm.figures import training_figure
from moelab.studies.gate_norm.findings import REFERENCE, checks, findings
from moelab.studies.gate_norm.grid import AUX_WEIGHT, SETTINGS
from moelab.studies.gate_norm.run import (
    MAX_BATCHES,
    ORACLE_TOKENS,
    exploration,
    gate_gradient,
    k1_checkpoint_gradient,
    k1_refusal,
    measure,
    oracle,
)
from moelab.studies.paired import findings_section

__all__ = ["analyse"]


def analyse(ctx: Context) -> list[Section]:
    max_batches = ctx.max_batches or MAX_BATCHES.get(ctx.scale)
    main = main_section(ctx, max_batches)
    explore = exploration_section(ctx, max_batches)
    k1 = ctx.per_seed(
        "softmax-renorm",
        lambda run: ctx.cached(run, "gate-norm-k1grad-v1", lambda: k1_checkpoint_gradient(run)),
    )
    agree = oracle_section(ctx)
    rows = {r["name"]: r for r in main.tables[0].rows}
    explored = {r["name"]: r["explored"] for r in explore.tables[0].rows}
    rho = {r["name"]: r["spearman"] for r in agree.tables[0].rows}
    sections = [
        findings_section(findings(rows, k1, oracle=rho), checks=checks(rows, explored, k1)),
        main,
        agree,
        explore,
        refusal_section(ctx, k1),
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


def main_section(ctx: Context, max_batches: int | None) -> Section:
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


def oracle_section(ctx: Context) -> Section:
    """The loss oracle: does each trained router rank the experts by their loss?"""
    key = f"gate-norm-oracle-v1-n{ORACLE_TOKENS}"
    rows = []
    for arm in ctx.arms:
        got = ctx.per_seed(arm.name, lambda run: ctx.cached(run, key, lambda: oracle(run)))
        rows.append(
            {
                "arm": arm.label,
                "name": arm.name,
                "top1": [g["top1"] for g in got],
                "spearman": [g["spearman"] for g in got],
                "regret": [g["regret"] for g in got],
                "chance": got[0]["chance"],
            }
        )
    table = StudyTable(
        "oracle",
        "Does the router rank the experts by their loss? (the essay's argmax ρ = argmin ℓ)",
        [
            ("arm", "arm", "s"),
            ("top-1 agreement", "top1", ".3f"),
            ("Spearman ρ", "spearman", ".3f"),
            ("regret (nats)", "regret", ".4f"),
            ("chance", "chance", ".3f"),
        ],
        rows,
        note=(
            f"{ORACLE_TOKENS} tokens of the first validation batch (an even stride) at the "
            "last MoE layer of each trained run. For each token and expert i, ℓ(e_i) is "
            "the token's next-token loss with the layer's output at that token replaced "
            "by expert i's output alone, with weight 1 (the rest of the model as "
            "trained). top-1 agreement: the share of tokens whose highest-valued expert "
            "(the router's map values, before any selection bias) has the least loss; "
            "chance: 1 / E. Spearman ρ: rank correlation of the values with −ℓ over the "
            "experts, mean over the tokens. regret: ℓ of the router's top-1 minus the "
            "least ℓ, mean over the tokens."
        ),
    )
    return Section(
        "The loss oracle",
        "The essay derives the gate from one principle: the router should rank the "
        "experts as their losses do, its top-1 the expert of least loss (q ∝ exp(−ℓ/τ)). "
        "This measures it on the trained routers.",
        [table],
    )


def exploration_section(ctx: Context, max_batches: int | None) -> Section:
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


def refusal_section(ctx: Context, k1: Sequence[Mapping[str, float]]) -> Section:
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
