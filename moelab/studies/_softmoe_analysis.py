"""The analysis of the ``softmoe`` study (:mod:`moelab.studies.softmoe`): what it
measures on each trained run, its tables in the paper's layouts and its figures.

Shape suffixes: E, L (moelab.shapes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moelab.studies._core import Arm, Context, Section, StudyTable
from moelab.studies._softmoe_findings import LEARNED, checks, findings
from moelab.studies._softmoe_grid import (
    ALPHA,
    FIXED_TAUS,
    INFER_SCALES,
    JITTER,
    JITTER_KS,
    SOFT_K,
    SPARSE_KS,
)
from moelab.studies.paired import findings_section

__all__ = [
    "ALPHA",
    "FIXED_TAUS",
    "INFER_SCALES",
    "JITTER",
    "JITTER_KS",
    "MAX_BATCHES",
    "SOFT_K",
    "SPARSE_KS",
    "analyse",
    "k_layer_series",
    "load_relative_variance",
    "train_ae",
]

MAX_BATCHES = {"quick": 2, "cpu": 12, "paper": 64}
"""Validation batches of the analysis per scale (``--max-batches`` overrides)."""


# ------------------------------------------------------------------ analysis


def analyse(ctx: Context) -> list[Section]:
    """The study's sections: Tables 1, 5, 6, 7 and 8 in the paper's layouts and the
    learned allocation over training."""
    max_batches = ctx.max_batches or MAX_BATCHES[ctx.scale]
    info = {a.name: _arm_info(a) for a in ctx.arms}
    measured, sweeps = _measure_arms(ctx, info, max_batches)
    train_aes = {a.name: ctx.per_seed(a.name, train_ae) for a in ctx.arms}
    losses = {a.name: ctx.per_seed(a.name, _val_loss) for a in ctx.arms}
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
    k_end = [_k_end(run) for run in ctx.runs.get(LEARNED, [])]
    first = findings_section(
        findings(columns, k_end, sweeps), checks=checks(columns, k_end, sweeps)
    )
    return [first, *_sections(ctx, info, measured, table1, table5, table6, table7, table8)]


def _k_end(run: Path) -> list[float] | None:
    """Every MoE layer's k_l at the run's last logged step (None without k_layers)."""
    _, k_L = k_layer_series(run)
    return [ks[-1] for ks in k_L] if k_L else None


def _measure_arms(
    ctx: Context, info: dict[str, dict[str, Any]], max_batches: int
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """The routing statistics of every run and the truncation sweep of the calibrated
    SoftMoE arms (cached per run)."""
    measured: dict[str, list[dict[str, Any]]] = {}
    for arm in ctx.arms:
        ctx.say(f"softmoe: routing statistics of {arm.name}")
        measured[arm.name] = [
            ctx.cached(
                run,
                f"softmoe_stats_b{max_batches}",
                lambda run=run: _measure(run, max_batches),
            )
            for run in ctx.runs[arm.name]
        ]
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for arm in ctx.arms:
        if info[arm.name]["kind"] in ("star", "learned") and info[arm.name]["tau"] is None:
            ctx.say(f"softmoe: inference-time truncation sweep of {arm.name}")
            sweeps[arm.name] = [
                ctx.cached(
                    run,
                    f"softmoe_truncation_b{max_batches}",
                    lambda run=run: _sweep(run, max_batches),
                )
                for run in ctx.runs[arm.name]
            ]
    return measured, sweeps


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
        "softmoe_main",
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
        ],
        [
            {
                "arm": a.name,
                "model": info[a.name]["model"],
                "k": info[a.name]["k_text"],
                "alpha": info[a.name]["alpha_text"],
                "cap": info[a.name]["cap_text"],
                "train_ae": train_aes[a.name],
                "infer_ae": _col(measured, a.name, "infer_ae"),
                "active_params": _col(measured, a.name, "active_params", 1e-6),
                "loss": losses[a.name],
            }
            for a in main_arms
        ],
        note="AE: the mean number of experts a token activates in one MoE layer, over "
        "tokens and layers. Train-AE: its mean over training (the logged training "
        "batches, exploration noise included). Infer-AE: on validation batches with the "
        "final weights (eval mode). Active-Param: the mean parameters one token uses at "
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
        ],
        [
            {
                "arm": a.name,
                "model": info[a.name]["model"],
                "k": info[a.name]["k_text"],
                "alpha": info[a.name]["alpha_text"],
                "load_rel_var": _col(measured, a.name, "load_rel_var"),
            }
            for a in main_arms
        ],
        note="Load: the tokens each expert computes on the validation batches. Relative "
        "variance: Var(load) / mean(load)^2 over the E experts of a layer (the squared "
        "coefficient of variation, population variance), then the mean over the MoE "
        "layers. Lower is more balanced.",
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
    tau_arms = [a for a in ctx.arms if info[a.name]["kind"] == "star"]
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
                    "tau": [_scaled(_mean(d["tau_trained"]), scale) for d in docs],
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
        ],
        jitter_rows,
        note=f"Jitter: Gaussian noise of std {JITTER:g} on the router logits in training "
        "(router.noise_std; the Switch Transformer's jitter multiplies the router input "
        "by uniform noise in [1 - ε, 1 + ε] instead). Loss: validation loss.",
    )
    return table8


def _sections(
    ctx: Context,
    info: dict[str, dict[str, Any]],
    measured: Measured,
    *tables: StudyTable,
) -> list[Section]:
    table1, table5, table6, table7, table8 = tables
    figures = [f for f in (_k_figure(ctx, info), _allocation_figure(ctx, info)) if f]
    k_table = _k_table(ctx, info, measured)
    sections = [
        Section(
            "SoftMoE vs sparse MoE (Table 1)",
            "Sparse MoE routes each token to its top-k experts of a softmax; SoftMoE* "
            "replaces top-k by LapSum soft top-k weights truncated at a calibrated "
            f"threshold and capped at ceil(k α) experts; SoftMoE also learns each "
            f"layer's k_l under the global budget K = {SOFT_K:g} L.",
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
            "Figure 6), one panel per seed; softmoe_allocation.png: k_l (solid) beside "
            "the measured active experts per layer (dashed) over training tokens, for "
            "seed 0 of SoftMoE* and SoftMoE.",
            [k_table],
            figures,
        ),
    ]
    return sections


# ---------------------------------------------------------------------- helpers


def _arm_info(arm: Arm) -> dict[str, Any]:
    """What the tables say about an arm, from its tags (:meth:`SoftMoEStudy.arms`)."""
    tags = arm.tags
    jitter = float(tags.get("jitter") or 0.0)
    if tags["kind"] in ("star", "learned"):
        k = float(tags["k"])
        alpha = float(tags["alpha"])
        learned = tags["kind"] == "learned"
        tau = tags["tau"]
        kind = tags["kind"]
        name = ("SoftMoE" if learned else "SoftMoE*") + (f" τ={tau:g}" if tau is not None else "")
        return {
            "kind": kind,
            "main": tau is None,
            "tau": tau,
            "model": name,
            "k_text": f"{k:g}",
            "alpha_text": f"{alpha:g}",
            "cap_text": f"≤ {math.ceil(k * alpha)}",
            "budget_k": k,
            "jitter": jitter,
        }
    k = int(tags["k"])
    return {
        "kind": "sparse",
        "main": jitter == 0,
        "tau": None,
        "model": "Sparse MoE" + (f" jitter {jitter:g}" if jitter else ""),
        "k_text": f"{k}",
        "alpha_text": "-",
        "cap_text": f"= {k}" if k == 1 else f"≤ {k}",
        "budget_k": float(k),
        "jitter": jitter,
    }


def _scaled(value: Any, scale: float) -> float | None:
    if value is None:
        return None
    return float(value) * scale


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def _metrics(run: Path) -> list[dict[str, Any]]:
    from moelab.runs import read_metrics

    return read_metrics(run)


def train_ae(run: Path) -> float | None:
    """Train-AE of a run: the mean over its logged training steps of ``active_experts``
    (experts a token computes per MoE layer, averaged over the layers) in metrics.jsonl."""
    vals = [r["active_experts"] for r in _metrics(run) if "loss" in r and "active_experts" in r]
    return _mean(vals)


def _val_loss(run: Path) -> float | None:
    import json

    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    return summary.get("val_loss")


def load_relative_variance(load_E: list[float]) -> float | None:
    """Var / mean^2 of an expert load (population variance); None without load."""
    n = len(load_E)
    mean = sum(load_E) / n if n else 0.0
    if not mean > 0:
        return None
    var = sum((x - mean) ** 2 for x in load_E) / n
    return var / mean**2


def _measure(run: Path, max_batches: int) -> dict[str, Any]:
    """Inference numbers of one run on ``max_batches`` validation batches (moelab.diagnostics
    .stats): Infer-AE, active parameters, NLL, the relative load variance (mean over
    layers), each layer's load shares, k_l and threshold tau (in units of k / E)."""
    from moelab.diagnostics import load_run, stats

    loaded = load_run(run)
    s = stats(loaded, max_batches=max_batches)
    layers = s["layers"]
    n_experts = loaded.model.config.n_experts
    taus = []
    for lay in layers:
        cut, k = lay.get("truncation"), lay.get("lapsum_k")
        taus.append(cut * n_experts / k if cut is not None and k else None)
    rel = [
        load_relative_variance(lay["load_shares"]) if lay["load_shares"] else None for lay in layers
    ]
    return {
        "infer_ae": s["mean"]["active_experts"],
        "active_params": s["active_params"],
        "nll": s["nll"],
        "tokens": s["tokens"],
        "load_rel_var": _mean(rel),
        "load_rel_var_layers": rel,
        "load_shares": [lay["load_shares"] for lay in layers],
        "active_layers": [lay["active_experts"] for lay in layers],
        "k_layers": [lay.get("lapsum_k") for lay in layers],
        "tau_layers": taus,
        "tau": _mean(taus),
    }


def _sweep(run: Path, max_batches: int) -> dict[str, Any]:
    """The inference-time truncation sweep (``evaluate_truncation``) of a truncating run,
    with each layer's trained threshold in units of k / E."""
    from moelab.diagnostics import evaluate_truncation, load_run

    loaded = load_run(run)
    doc = evaluate_truncation(loaded, INFER_SCALES, max_batches=max_batches)
    n_experts = loaded.model.config.n_experts
    k_L = loaded.model.layer_budgets()
    taus = []
    for i, layer in enumerate(loaded.model.moe_layers):
        router = layer.router
        k = float(k_L[i].detach()) if k_L is not None else float(router.config.lapsum_k)
        cut = router.effective_truncation(k)
        taus.append(None if cut is None else float(cut) * n_experts / k)
    return {
        "thresholds": doc["thresholds"],
        "tau_trained": taus,
        "results": doc["results"],
        "batches": doc["results"][0]["batches"] if doc["results"] else 0,
    }


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
                start = [_k_at(run, i, 0) for run in runs]
                end = [_k_at(run, i, -1) for run in runs]
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


def _k_at(run: Path, i: int, row: int) -> float | None:
    """Layer ``i``'s k_l in the ``row``-th logged line that carries k_layers."""
    rows = [r for r in _metrics(run) if isinstance(r.get("k_layers"), list)]
    return float(rows[row]["k_layers"][i]) if rows else None


def _allocation_figure(ctx: Context, info: dict[str, dict[str, Any]]) -> Path | None:
    """k_l of every layer over training (the learned arm) beside the measured active
    experts per layer of SoftMoE* (seed 0 of each)."""
    from moelab.report.plots import plot_allocation

    runs = []
    for arm in ctx.arms:
        meta = info[arm.name]
        if meta["kind"] not in ("learned", "star") or meta["tau"] is not None:
            continue
        run = ctx.runs[arm.name][0]
        metrics = _metrics(run)
        cfg = _read_config(run)
        tokens_per_step = cfg.get("batch_size", 1) * cfg.get("seq_len", 1)
        for m in metrics:
            m.setdefault("tokens", m["step"] * tokens_per_step)
        runs.append(
            {
                "label": f"{meta['model']}, seed {ctx.seeds[0]}",
                "metrics": metrics,
                "truncating": True,
                "budget_k": meta["budget_k"],
            }
        )
    if not runs:
        return None
    return plot_allocation(runs, ctx.figure("softmoe_allocation"))


def k_layer_series(run: Path) -> tuple[list[int], list[list[float]]]:
    """The logged steps of a learned-allocation run and, per MoE layer, its k_l at each
    (``k_layers`` of metrics.jsonl); empty without learned allocation."""
    rows = [r for r in _metrics(run) if isinstance(r.get("k_layers"), list) and "step" in r]
    if not rows:
        return [], []
    n_layers = len(rows[0]["k_layers"])
    return [int(r["step"]) for r in rows], [
        [float(r["k_layers"][i]) for r in rows] for i in range(n_layers)
    ]


def _k_figure(ctx: Context, info: dict[str, dict[str, Any]]) -> Path | None:
    """The paper's Figure 6: every layer's k_l over training steps, one panel per seed of
    the learned-allocation arm(s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for arm in ctx.arms:
        if info[arm.name]["kind"] != "learned":
            continue
        for seed, run in zip(ctx.seeds, ctx.runs[arm.name], strict=True):
            steps, k_L = k_layer_series(run)
            if steps:
                panels.append((f"{info[arm.name]['model']}, seed {seed}", steps, k_L))
    if not panels:
        return None
    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for j, ax in enumerate(axes.flat):
        if j >= n:
            ax.axis("off")
            continue
        title, steps, k_L = panels[j]
        for i, ks in enumerate(k_L):
            ax.plot(steps, ks, color=f"C{i % 10}", label=f"layer {i}")
        start = sum(k[0] for k in k_L) / len(k_L)
        ax.axhline(start, color="k", ls=":", lw=1, label="K / L")
        ax.set_xlabel("training step")
        ax.set_ylabel("k_l (mean active experts)")
        ax.set_title(f"Learned allocation: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", ncol=2 if len(k_L) > 4 else 1)
    fig.tight_layout()
    path = ctx.figure("softmoe_k_layers")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _read_config(run: Path) -> dict[str, Any]:
    import json

    path = run / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
