"""The analysis of the ``temperature`` study (:mod:`moelab.studies.temperature`): the
report's sections from what :mod:`~moelab.studies.temperature.run` measured on each run
(the paper's Table 1 layout and the check of Theorem 1), the findings, and the figures of
:mod:`~moelab.studies.temperature.figures`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moelab._format import human
from moelab.runs.layout import SUMMARY
from moelab.studies.core import Arm, Context, Section, StudyTable
from moelab.studies.paired import findings_section
from moelab.studies.temperature.figures import figures_section, metrics_rows
from moelab.studies.temperature.findings import checks, findings, schedule_trace
from moelab.studies.temperature.grid import CAPACITY_FACTOR, SCHEDULE
from moelab.studies.temperature.run import (
    ANALYSIS_KEY,
    MAX_BATCHES,
    MAX_TOKENS,
    NEIGHBOUR_TOKENS,
    RANDOM_PAIRS,
    measure,
)

__all__ = ["analyse"]


def analyse(ctx: Context) -> list[Section]:
    max_batches = ctx.max_batches or MAX_BATCHES.get(ctx.scale, 16)
    results: dict[str, list[dict[str, Any]]] = {}
    for arm in ctx.arms:
        ctx.say(f"temperature: measuring {arm.name}")
        results[arm.name] = ctx.per_seed(
            arm.name,
            lambda run: ctx.cached(
                run, f"{ANALYSIS_KEY}-{max_batches}", lambda: measure(run, max_batches)
            ),
        )
    moe = [a for a in ctx.arms if a.tags.get("kind") == "moe"]
    l_star, tau_min = SCHEDULE[ctx.scale]
    traces = [schedule_trace(metrics_rows(run), tau_min) for run in ctx.runs["lipschitz"]]
    main = main_section(ctx, results, max_batches)
    theorem = theorem_section(ctx, results, moe)
    rows: dict[str, dict[str, list[Any]]] = {}
    for arm in ctx.arms:
        per = results[arm.name]
        rows[arm.name] = {
            "ppl": [r["ppl"] for r in per],
            "dropped": [r.get("dropped") for r in per],
            "dropped_tokens": [r.get("dropped_tokens") for r in per],
            "load_cv": [r.get("load_cv") for r in per],
            "radius": [r.get("radius_rel_p50") for r in per],
            "lipschitz": [r.get("lipschitz") for r in per],
            "max_ratio": [r.get("max_ratio") for r in per],
        }
    found = findings(rows, [r["theorem"] for r in results["lipschitz"]], l_star, tau_min)
    return [
        findings_section(found, checks=checks(traces, tau_min, l_star)),
        main,
        theorem,
        figures_section(ctx, results, moe, traces),
    ]


def params(run: Path) -> str:
    summary = json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    p = summary["params"]
    return f"{human(p['active'])} / {human(p['total'])}"


def main_section(
    ctx: Context, results: dict[str, list[dict[str, Any]]], max_batches: int
) -> Section:
    rows = []
    for arm in ctx.arms:
        per = results[arm.name]

        def col(key: str, per: list[dict[str, Any]] = per) -> list[Any]:
            return [r.get(key) for r in per]

        rows.append(
            {
                "arm": arm.label,
                "params": params(ctx.runs[arm.name][0]),
                "ppl": col("ppl"),
                "load_cv": col("load_cv"),
                "dropped_tokens": col("dropped_tokens"),
                "dropped": col("dropped"),
                "tau": col("tau"),
                "weight_norm": col("weight_norm"),
                "max_ratio": col("max_ratio"),
            }
        )
    table = StudyTable(
        "temperature-main",
        "Validation perplexity, load imbalance, dropped tokens and slots (the paper's "
        "Table 1), "
        "with the largest ratio of the theorem check",
        [
            ("model", "arm", "s"),
            ("params (active / total)", "params", "s"),
            ("PPL", "ppl", ".2f"),
            ("load CV", "load_cv", ".3f"),
            ("drop (tokens)", "dropped_tokens", ".2%"),
            ("drop (slots)", "dropped", ".2%"),
            ("τ", "tau", ".3f"),
            ("‖W‖₂", "weight_norm", ".3f"),
            ("max ‖Δg‖ / (‖W‖₂/(2τ)‖Δx‖)", "max_ratio", ".4f"),
        ],
        rows,
        note=(
            "PPL: exp of the mean next-token NLL on the first "
            f"{max_batches} validation batches. Load CV: std / mean over the experts of "
            "the slots routed to each (before the capacity limit), mean over the MoE "
            "layers. Drop (tokens), the paper's Drop: the share of tokens whose every "
            f"routed slot the capacity limit (factor {CAPACITY_FACTOR}) refused, so that "
            "they pass the layer on the residual alone; drop (slots): refused slots / "
            "slots routed. For Switch (top-1) the two agree; a top-2 token with one slot "
            "refused counts in the slots only. Both on the same batches (training's "
            "batch shape), mean over the MoE layers. τ and ‖W‖₂ (exact spectral norm): "
            "the routers' final values, mean over layers. Last column: the theorem check "
            "(next section); at most 1 where the bound holds."
        ),
    )
    text = (
        "Every MoE arm: softmax gate, capacity factor 1.25, balance weight 0.01 with f_i "
        "the share of tokens whose top-1 expert is i (the paper's eq. 6, "
        "`router.aux_count=top1`); the "
        "top-2 arms' experts are half as wide as Switch's, so every arm uses the same "
        "parameters per token (the paper's Table 1 compares models of equal active "
        "parameters)."
    )
    return Section("Perplexity, load and dropped tokens", text, [table])


def theorem_section(
    ctx: Context, results: dict[str, list[dict[str, Any]]], moe: list[Arm]
) -> Section:
    rows = []
    for arm in moe:
        per = results[arm.name]
        rows.append(
            {
                "arm": arm.label,
                "pairs": sum(r["pairs"] for r in per),
                "lipschitz": [r["lipschitz"] for r in per],
                "median_ratio": [
                    float(np.median([c["median_ratio"] for c in r["theorem"]])) for r in per
                ],
                "max_ratio": [r["max_ratio"] for r in per],
                "violations": sum(r["violations"] for r in per),
                "radius": [r["radius_rel_p50"] for r in per],
            }
        )
    table = StudyTable(
        "temperature-theorem",
        "Theorem 1 on the trained routers: ‖g(x) − g(y)‖₂ ≤ ‖W‖₂/(2τ) ‖x − y‖₂",
        [
            ("model", "arm", "s"),
            ("pairs (all seeds)", "pairs", "d"),
            ("‖W‖₂/(2τ)", "lipschitz", ".3f"),
            ("median ratio", "median_ratio", ".4f"),
            ("max ratio", "max_ratio", ".4f"),
            ("pairs above the bound", "violations", "d"),
            ("median radius / ‖x‖", "radius", ".4f"),
        ],
        rows,
    )
    text = (
        "The inputs each router sees on validation text are collected with a forward "
        f"hook (up to {MAX_TOKENS} per MoE layer). Per layer, {RANDOM_PAIRS} random "
        f"pairs and, for {NEIGHBOUR_TOKENS} tokens, the pair with the nearest other "
        "token are checked with the gate exactly as the theorem defines it, "
        "g(x) = softmax(Wx/τ) over all experts (eq. 1), in float64, with the exact "
        "spectral norm and the router's final τ. The ratio "
        "‖g(x) − g(y)‖₂ / (‖W‖₂/(2τ) ‖x − y‖₂) is at most 1 wherever the theorem "
        "holds; the table gives its median and largest value per arm (over layers; "
        "mean ± sd over seeds) and the pairs above 1 (all seeds). Last column: the "
        "certified top-1 radius √2 τ m(x)/‖W‖₂ (Corollary 1) relative to the token's "
        "norm, median over the validation tokens and MoE layers."
    )
    return Section("A numerical check of the theorem", text, [table])
