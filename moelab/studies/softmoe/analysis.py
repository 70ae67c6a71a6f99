"""The analysis of the ``softmoe`` study (:mod:`moelab.studies.softmoe`): the report's
sections from what :mod:`~moelab.studies.softmoe.run` measured on each run, its tables in
the paper's layouts, and the figures of :mod:`~moelab.studies.softmoe.figures`."""

from __future__ import annotations

import math
from typing import Any

from moelab.studies.core import Arm, Context, Section, StudyTable
from moelab.studies.paired import findings_section, paired_tables
from moelab.studies.softmoe.beside import paper_section, paper_table5
from moelab.studies.softmoe.figures import allocation_figure, k_figure
from moelab.studies.softmoe.findings import MAIN_TABLE, checks, findings
from moelab.studies.softmoe.grid import (
    ALPHA,
    FIXED_TAUS,
    GROUPS,
    INFER_SCALES,
    JITTER,
    JITTER_KEY,
    JITTER_KS,
    SOFT_K,
)
from moelab.studies.softmoe.paper import TABLE8_LOSS
from moelab.studies.softmoe.run import (
    MAX_BATCHES,
    finite_mean,
    k_at,
    k_at_end,
    measure_arms,
    train_ae,
    val_loss,
)

__all__ = ["analyse"]


# ------------------------------------------------------------------ analysis


def analyse(ctx: Context) -> list[Section]:
    """The study's sections: Tables 1, 5, 6, 7 and 8 in the paper's layouts, the
    paired differences within the budget groups, the paper's numbers beside moelab's
    and the learned allocation over training."""
    max_batches = ctx.max_batches or MAX_BATCHES[ctx.scale]
    info = {a.name: _arm_info(a) for a in ctx.arms}
    measured, sweeps = measure_arms(ctx, info, max_batches)
    train_aes = {a.name: ctx.per_seed(a.name, train_ae) for a in ctx.arms}
    losses = {a.name: ctx.per_seed(a.name, val_loss) for a in ctx.arms}
    table1, table5 = _main_tables(ctx, info, measured, train_aes, losses)
    table6 = _threshold_table(ctx, info, measured, train_aes, losses)
    table7 = _inference_table(info, sweeps)
    table8 = _jitter_table(measured, losses)
    columns = {
        a.name: {
            "loss": losses[a.name],
            "train_ae": train_aes[a.name],
            "infer_ae": _col(measured, a.name, "infer_ae"),
            "load_rel_var": _col(measured, a.name, "load_rel_var"),
        }
        for a in ctx.arms
    }
    k_end = {
        a.name: [k_at_end(run) for run in ctx.runs[a.name]]
        for a in ctx.arms
        if info[a.name]["kind"] == "learned"
    }
    lines = checks(columns, k_end, sweeps, ctx.seeds)
    for line in lines:
        if line.startswith("warning:") and " seed " in line and "bound" in line:
            ctx.say(f"softmoe: {line}")  # a k_l on a bound: said while the study runs too
    first = findings_section(findings(columns, k_end, sweeps, len(ctx.seeds)), checks=lines)
    groups = _group_section(ctx, info, table1)
    beside = paper_section(ctx, info, columns)
    sections = _sections(ctx, info, measured, table1, table5, table6, table7, table8)
    return [first, sections[0], groups, beside, *sections[1:]]


def _col(
    measured: dict[str, list[dict[str, Any]]], arm: str, key: str, scale: float = 1.0
) -> list[float | None]:
    return [_scaled(m[key], scale) for m in measured[arm]]


Measured = dict[str, list[dict[str, Any]]]


def _main_tables(
    ctx: Context,
    info: dict[str, dict[str, Any]],
    measured: Measured,
    train_aes: dict[str, list[Any]],
    losses: dict[str, list[Any]],
) -> tuple[StudyTable, StudyTable]:
    """Tables 1 and 5: the main arms' AE, active parameters, loss and load variance."""
    main_arms = [a for a in ctx.arms if info[a.name]["main"]]
    table1 = StudyTable(
        MAIN_TABLE,
        "Table 1 layout: sparse MoE vs SoftMoE* vs SoftMoE",
        [
            ("Arm", "arm", "s"),
            ("Model", "model", "s"),
            ("k", "k", "s"),
            ("α", "alpha", "s"),
            ("max experts", "cap", "s"),
            ("Train-AE", "train_ae", ".2f"),
            ("Infer-AE", "infer_ae", ".2f"),
            ("Active-Param (M)", "active_params", ".3f"),
            ("Loss", "loss", ".3f"),
            ("#Expert", "group", "s"),
        ],
        [
            {
                "arm": a.name,
                "model": info[a.name]["model"],
                "k": info[a.name]["k_text"],
                "alpha": info[a.name]["alpha_text"],
                "cap": info[a.name]["cap_text"],
                "group": info[a.name]["group_text"],
                "train_ae": train_aes[a.name],
                "infer_ae": _col(measured, a.name, "infer_ae"),
                "active_params": _col(measured, a.name, "active_params", 1e-6),
                "loss": losses[a.name],
            }
            for a in main_arms
        ],
        note="AE: the mean number of experts a token activates in one MoE layer, over "
        "tokens and layers. Train-AE: its mean over training, every training step "
        "counted (the computed slots of each logging window, metrics.jsonl's "
        "active_window_layers; exploration noise included). Infer-AE: on validation "
        "batches with the final weights (eval mode). #Expert: the budget group the arm "
        "is compared in (the paper's Table 1 groups; a soft arm against the sparse arm of "
        "its group, sparse-k2 for ≤ 2 and sparse-k4 for ≤ 4). Active-Param: the mean "
        "parameters one token uses at "
        "inference (every non-expert parameter plus Infer-AE experts per layer). Loss: "
        "the validation loss at the end of training. max experts: k for top-k, "
        "ceil(k α) for the truncating routers (learned allocation: at the start, "
        "k_l = K / L; the cap follows k_l).",
    )
    table5 = StudyTable(
        "softmoe_load_variance",
        "Table 5 layout: relative variance of the expert load",
        [
            ("Arm", "arm", "s"),
            ("Model", "model", "s"),
            ("k", "k", "s"),
            ("α", "alpha", "s"),
            ("Load variance (relative)", "load_rel_var", ".3f"),
            ("OWT (paper)", "paper_owt", "s"),
            ("C4 (paper)", "paper_c4", "s"),
        ],
        [
            {
                "arm": a.name,
                "model": info[a.name]["model"],
                "k": info[a.name]["k_text"],
                "alpha": info[a.name]["alpha_text"],
                "load_rel_var": _col(measured, a.name, "load_rel_var"),
                "paper_owt": paper_table5(info[a.name], "OWT"),
                "paper_c4": paper_table5(info[a.name], "C4"),
            }
            for a in main_arms
        ],
        note="Load: the tokens each expert computes on the validation batches. Relative "
        "variance: Var(load) / mean(load)^2 over the E experts of a layer (the squared "
        "coefficient of variation, population variance), then the mean over the MoE "
        "layers. Lower is more balanced. OWT, C4: the paper's Table 5 for the same "
        "configuration (at its scale; '-': not a row of the paper).",
    )
    return table1, table5


def _threshold_table(
    ctx: Context,
    info: dict[str, dict[str, Any]],
    measured: Measured,
    train_aes: dict[str, list[Any]],
    losses: dict[str, list[Any]],
) -> StudyTable:
    """Table 6: the train-time threshold ablation of SoftMoE*."""
    tau_arms = [a for a in ctx.arms if info[a.name]["kind"] == "star" and info[a.name]["main_k"]]
    table6 = StudyTable(
        "softmoe_threshold_ablation",
        "Table 6 layout: train-time truncation threshold of SoftMoE*",
        [
            ("Configuration", "config", "s"),
            ("τ", "tau_text", "s"),
            ("τ (trained)", "tau", ".3f"),
            ("Train-AE", "train_ae", ".2f"),
            ("AE", "infer_ae", ".2f"),
            ("Loss", "loss", ".3f"),
        ],
        [
            {
                "arm": a.name,
                "config": f"k={SOFT_K:g}, α={ALPHA:g}",
                "tau_text": "calibrated"
                if info[a.name]["tau"] is None
                else f"{info[a.name]['tau']:g} (fixed)",
                "tau": _col(measured, a.name, "tau"),
                "train_ae": train_aes[a.name],
                "infer_ae": _col(measured, a.name, "infer_ae"),
                "loss": losses[a.name],
            }
            for a in tau_arms
        ],
        note="Each row is a model trained with its own threshold; the cut on the LapSum "
        "weights is τ k / E. 'calibrated': τ set before the first step on "
        "the first training batches so that about k experts per token pass (per "
        "layer; τ (trained) is its mean over layers); 'fixed': τ as given, never "
        "calibrated. AE: Infer-AE as in Table 1. The paper's downstream columns are "
        "not reproduced.",
    )
    return table6


def _inference_table(info: dict[str, dict[str, Any]], sweeps: Measured) -> StudyTable:
    """Table 7: the inference-time truncation sweep."""
    rows7 = []
    for name, docs in sweeps.items():
        for j, scale in enumerate(INFER_SCALES):
            rows7.append(
                {
                    "arm": name,
                    "model": info[name]["model"],
                    "scale": f"{scale:g} ×",
                    "tau": [_scaled(finite_mean(d["tau_trained"]), scale) for d in docs],
                    "infer_ae": [d["results"][j]["active_experts"] for d in docs],
                    "nll": [d["results"][j]["nll"] for d in docs],
                    "retained": [d["results"][j]["retained_mass"] for d in docs],
                }
            )
    table7 = StudyTable(
        "softmoe_inference_truncation",
        "Table 7 layout: inference-time truncation",
        [
            ("Model", "model", "s"),
            ("threshold", "scale", "s"),
            ("τ", "tau", ".3f"),
            ("AE", "infer_ae", ".2f"),
            ("NLL", "nll", ".3f"),
            ("retained mass", "retained", ".3f"),
        ],
        rows7,
        note="The same trained weights evaluated with every layer's cut multiplied by "
        "the factor (1 × is the trained cut); τ is the resulting threshold in units of "
        "k / E (mean over layers). NLL and AE on the validation batches; retained mass: "
        "the share of the LapSum weight kept (its mean over tokens and layers, "
        "normalised by k).",
    )
    return table7


def _jitter_table(measured: Measured, losses: dict[str, list[Any]]) -> StudyTable:
    """Table 8: router jitter in the sparse baselines."""
    jitter_rows = []
    for k in JITTER_KS:
        for jit in (False, True):
            name = f"sparse-k{k}" + ("-jitter" if jit else "")
            if name not in losses:
                continue
            jitter_rows.append(
                {
                    "arm": name,
                    "jitter": f"{JITTER:g}" if jit else "No",
                    "model": f"Top-{k}",
                    "loss": losses[name],
                    "load_rel_var": _col(measured, name, "load_rel_var"),
                    "paper": f"{TABLE8_LOSS[(k, jit)]:.2f}",
                }
            )
    table8 = StudyTable(
        "softmoe_jitter",
        "Table 8 layout: router jitter in the sparse baselines",
        [
            ("Arm", "arm", "s"),
            ("Jitter", "jitter", "s"),
            ("Model", "model", "s"),
            ("Loss", "loss", ".3f"),
            ("Load variance (relative)", "load_rel_var", ".3f"),
            ("Loss (paper)", "paper", "s"),
        ],
        jitter_rows,
        note=(
            f"Jitter: the router input multiplied by uniform noise in [1 − {JITTER:g}, "
            f"1 + {JITTER:g}] in training (router.{JITTER_KEY}). "
        )
        + "Loss: validation loss. Paper: the loss column of the paper's Table 8 (its "
        "setup, whose losses differ from its Table 1, is not stated).",
    )
    return table8


def _sections(
    ctx: Context,
    info: dict[str, dict[str, Any]],
    measured: Measured,
    *tables: StudyTable,
) -> list[Section]:
    table1, table5, table6, table7, table8 = tables
    figures = [f for f in (k_figure(ctx, info), allocation_figure(ctx, info)) if f]
    k_table = _k_table(ctx, info, measured)
    sections = [
        Section(
            "SoftMoE vs sparse MoE (Table 1)",
            "Sparse MoE routes each token to its top-k experts of a softmax; SoftMoE* "
            "replaces top-k by LapSum soft top-k weights truncated at a calibrated "
            "threshold and capped at ceil(k α) experts; SoftMoE also learns each "
            "layer's k_l under the global budget K = k L. Rows in the paper's order, "
            "by budget group (#Expert); k = 2, α = 4 is moelab's configuration, compared "
            "in the ≤ 4 group.",
            [table1],
        ),
        Section("Load balance (Table 5)", "", [table5]),
        Section(
            "Truncation threshold in training (Table 6)",
            "The paper trains SoftMoE* with several thresholds τ; this study trains "
            f"SoftMoE* k={SOFT_K:g}, α={ALPHA:g} with the calibrated τ and with the "
            f"fixed τ = {', '.join(f'{t:g}' for t in FIXED_TAUS)} of the paper's grid. "
            "A fixed τ above the spread of the LapSum weights at initialisation can "
            "leave tokens with no expert until the router's logits spread.",
            [table6],
        ),
        Section("Truncation at inference (Table 7)", "", [table7]),
        Section("Router jitter in the sparse baselines (Table 8)", "", [table8]),
        Section(
            "Learned allocation over training (Figure 6)",
            "softmoe_k_layers.png: every layer's k_l over training (the paper's "
            "Figures 6-8), one panel per learned arm and seed, the bounds 1 and "
            "K − L + 1 dashed; softmoe_allocation.png: k_l (solid) beside the measured "
            "active experts per layer (dashed) over training tokens, for seed 0 of "
            f"SoftMoE* and SoftMoE k = {SOFT_K:g}, α = {ALPHA:g}.",
            [k_table],
            figures,
        ),
    ]
    return sections


def _k_table(
    ctx: Context, info: dict[str, dict[str, Any]], measured: dict[str, list[dict[str, Any]]]
) -> StudyTable:
    """Per layer of each calibrated truncating arm: k_l at the first and the last logged
    step (learned allocation; a fixed k otherwise) and the layer's Infer-AE."""
    rows = []
    for arm in ctx.arms:
        meta = info[arm.name]
        if meta["kind"] not in ("learned", "star") or meta["tau"] is not None:
            continue
        runs, measures = ctx.runs[arm.name], measured[arm.name]
        n_layers = len(measures[0]["active_layers"])
        for i in range(n_layers):
            if meta["kind"] == "learned":
                start = [k_at(run, i, 0) for run in runs]
                end = [k_at(run, i, -1) for run in runs]
            else:
                start = end = [meta["budget_k"]] * len(runs)
            rows.append(
                {
                    "arm": arm.name,
                    "model": meta["model"],
                    "layer": str(i),
                    "k_start": start,
                    "k_end": end,
                    "ae": [m["active_layers"][i] for m in measures],
                }
            )
    return StudyTable(
        "softmoe_allocation",
        "Per-layer budget k_l (first and last logged step) and Infer-AE per layer",
        [
            ("Model", "model", "s"),
            ("layer", "layer", "s"),
            ("k_l at start", "k_start", ".2f"),
            ("k_l at end", "k_end", ".2f"),
            ("AE", "ae", ".2f"),
        ],
        rows,
        note="k_l: k_layers of metrics.jsonl at the first and the last logged step (SoftMoE* "
        "keeps k fixed). AE: the layer's Infer-AE on the validation batches.",
    )


def _arm_info(arm: Arm) -> dict[str, Any]:
    """What the tables say about an arm, from its tags (:func:`.grid.arms`)."""
    tags = arm.tags
    jitter = float(tags.get("jitter") or 0.0)
    group = int(tags["group"])
    group_text = "= 1" if group == 1 else f"≤ {group}"
    if tags["kind"] in ("star", "learned"):
        k = float(tags["k"])
        alpha = float(tags["alpha"])
        learned = tags["kind"] == "learned"
        tau = tags["tau"]
        kind = tags["kind"]
        name = ("SoftMoE" if learned else "SoftMoE*") + (f" τ={tau:g}" if tau is not None else "")
        main_k = (k, alpha) == (SOFT_K, ALPHA)
        return {
            "kind": kind,
            "main": tau is None,
            "main_k": main_k,
            "sweep": tau is None and main_k,
            "tau": tau,
            "model": name,
            "k": k,
            "alpha": alpha,
            "k_text": f"{k:g}",
            "alpha_text": f"{alpha:g}",
            "cap_text": f"≤ {math.ceil(k * alpha)}",
            "budget_k": k,
            "jitter": jitter,
            "group": group,
            "group_text": group_text,
        }
    k = int(tags["k"])
    return {
        "kind": "sparse",
        "main": jitter == 0,
        "main_k": False,
        "sweep": False,
        "tau": None,
        "model": "Sparse MoE" + (f" jitter {jitter:g}" if jitter else ""),
        "k": float(k),
        "alpha": None,
        "k_text": f"{k}",
        "alpha_text": "-",
        "cap_text": f"= {k}" if k == 1 else f"≤ {k}",
        "budget_k": float(k),
        "jitter": jitter,
        "group": group,
        "group_text": group_text,
    }


def _group_section(ctx: Context, info: dict[str, dict[str, Any]], table1: StudyTable) -> Section:
    """The paired differences of Table 1's columns within each budget group: every arm
    of the group minus the group's sparse arm, seed by seed (the generic paired tables
    at the end of the report take every arm against sparse-k2)."""
    tables = []
    for group, sparse in GROUPS.items():
        rows = [r for r in table1.rows if info[r["arm"]]["group"] == group]
        if not any(r["arm"] == sparse for r in rows) or len(rows) < 2:
            continue
        sub = StudyTable(MAIN_TABLE, table1.title, table1.columns, rows, table1.note)
        for paired in paired_tables([sub], sparse, len(ctx.seeds)):
            paired.key = f"paired_{MAIN_TABLE}_group{group}"
            paired.caption = f"Budget group ≤ {group}: paired differences from {sparse}"
            keys = {h: key for h, key, _ in table1.columns}
            for row in paired.rows:
                row.update(
                    {
                        "arm": row["row"],
                        "versus": sparse,
                        "table": MAIN_TABLE,
                        "column_key": keys[row["column"]],
                    }
                )
            tables.append(paired)
    return Section(
        "Budget groups (Table 1's #Expert)",
        "The paper compares each soft configuration with the sparse arm of its budget group "
        "(its Table 1: SoftMoE* and SoftMoE k = 1.5 against sparse top-2 in ≤ 2, k = 2 "
        "against sparse top-4 in ≤ 4). Each row: the arm minus the group's sparse arm, "
        "seed by seed, for every column of Table 1 with per-seed values.",
        tables,
    )


def _scaled(value: Any, scale: float) -> float | None:
    if value is None:
        return None
    return float(value) * scale
