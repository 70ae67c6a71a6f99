"""What the ``softmoe`` study (:mod:`moelab.studies.softmoe`) measures on each trained
run: the routing statistics and the inference-time truncation sweep on validation
batches (saved in ``RUN/analysis``), and from the run's files Train-AE (every training
step counted), the validation loss and the learned k_l over training.

Shape suffixes: E, L (moelab.shapes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moelab.runs.layout import SUMMARY
from moelab.studies.core import Context
from moelab.studies.softmoe.grid import INFER_SCALES

__all__ = [
    "MAX_BATCHES",
    "finite_mean",
    "k_at",
    "k_at_end",
    "k_layer_series",
    "load_relative_variance",
    "measure",
    "measure_arms",
    "metrics_rows",
    "sweep",
    "train_ae",
    "train_ae_logged",
    "val_loss",
]

MAX_BATCHES = {"quick": 2, "cpu": 12, "paper": 64}
"""Validation batches of the analysis per scale (``--max-batches`` overrides)."""


def measure_arms(
    ctx: Context, info: dict[str, dict[str, Any]], max_batches: int
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """The routing statistics of every run and the truncation sweep of the calibrated
    SoftMoE* and SoftMoE arms at k = 2, alpha = 2 (``info[arm]["sweep"]``; cached per
    run)."""
    measured: dict[str, list[dict[str, Any]]] = {}
    for arm in ctx.arms:
        ctx.say(f"softmoe: routing statistics of {arm.name}")
        measured[arm.name] = [
            ctx.cached(
                run,
                f"softmoe_stats_b{max_batches}",
                lambda run=run: measure(run, max_batches),
            )
            for run in ctx.runs[arm.name]
        ]
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for arm in ctx.arms:
        if info[arm.name]["sweep"]:
            ctx.say(f"softmoe: inference-time truncation sweep of {arm.name}")
            sweeps[arm.name] = [
                ctx.cached(
                    run,
                    f"softmoe_truncation_b{max_batches}",
                    lambda run=run: sweep(run, max_batches),
                )
                for run in ctx.runs[arm.name]
            ]
    return measured, sweeps


def measure(run: Path, max_batches: int) -> dict[str, Any]:
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
        "load_rel_var": finite_mean(rel),
        "load_rel_var_layers": rel,
        "load_shares": [lay["load_shares"] for lay in layers],
        "active_layers": [lay["active_experts"] for lay in layers],
        "k_layers": [lay.get("lapsum_k") for lay in layers],
        "tau_layers": taus,
        "tau": finite_mean(taus),
    }


def sweep(run: Path, max_batches: int) -> dict[str, Any]:
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


def train_ae(run: Path) -> float | None:
    """Train-AE of a run as the paper defines it: the mean number of experts a token
    activates per MoE layer over training, every step counted.

    Each training row of metrics.jsonl holds ``active_window_layers`` (per layer, the
    computed slots per token over every step since the previous row) and
    ``window_steps``; Train-AE is their mean over the layers, weighted by the window's
    steps. A run logged before those fields existed falls back to the mean of
    ``active_experts`` over the logged steps only (one batch in ``log_every``)."""
    rows = [r for r in metrics_rows(run) if "loss" in r]
    windows = [(r.get("window_steps"), r.get("active_window_layers")) for r in rows]
    if rows and all(isinstance(w, int) and w > 0 and a for w, a in windows):
        total = sum(w for w, _ in windows)
        return sum(w * (sum(a) / len(a)) for w, a in windows) / total
    return train_ae_logged(run)


def train_ae_logged(run: Path) -> float | None:
    """The mean over the logged training steps of ``active_experts`` (each the logged
    step's own batch): Train-AE before every step was counted."""
    vals = [r["active_experts"] for r in metrics_rows(run) if "loss" in r and "active_experts" in r]
    return finite_mean(vals)


def val_loss(run: Path) -> float | None:
    import json

    summary = json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    return summary.get("val_loss")


def load_relative_variance(load_E: list[float]) -> float | None:
    """Var / mean^2 of an expert load (population variance); None without load."""
    n = len(load_E)
    mean = sum(load_E) / n if n else 0.0
    if not mean > 0:
        return None
    var = sum((x - mean) ** 2 for x in load_E) / n
    return var / mean**2


def k_layer_series(run: Path) -> tuple[list[int], list[list[float]]]:
    """The logged steps of a learned-allocation run and, per MoE layer, its k_l at each
    (``k_layers`` of metrics.jsonl); empty without learned allocation."""
    rows = [r for r in metrics_rows(run) if isinstance(r.get("k_layers"), list) and "step" in r]
    if not rows:
        return [], []
    n_layers = len(rows[0]["k_layers"])
    return [int(r["step"]) for r in rows], [
        [float(r["k_layers"][i]) for r in rows] for i in range(n_layers)
    ]


def k_at_end(run: Path) -> list[float] | None:
    """Every MoE layer's k_l at the run's last logged step (None without k_layers)."""
    _, k_L = k_layer_series(run)
    return [ks[-1] for ks in k_L] if k_L else None


def k_at(run: Path, i: int, row: int) -> float | None:
    """Layer ``i``'s k_l in the ``row``-th logged line that carries k_layers."""
    rows = [r for r in metrics_rows(run) if isinstance(r.get("k_layers"), list)]
    return float(rows[row]["k_layers"][i]) if rows else None


def metrics_rows(run: Path) -> list[dict[str, Any]]:
    from moelab.runs import read_metrics

    return read_metrics(run)


def finite_mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None
