"""What the ``sparse-maps`` study (:mod:`moelab.studies.sparse_maps`) measures on each
trained run, saved in ``RUN/analysis``: the validation NLL, the routing statistics, the
frozen-weight K sweep, on a second corpus the routing statistics, the parameter counts
and the downstream scores ``moelab downstream`` saved."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from moelab.runs.layout import SUMMARY
from moelab.studies.core import Arm, Context

TOP_KS = (1, 2, 4, 8)
"""The inference-time budgets of the frozen-weight sweep (the paper's Tables 3 and 9)."""

MAX_BATCHES = {"quick": 2, "cpu": 16, "paper": 64}
"""Validation batches of the analysis at each scale (``--max-batches`` overrides)."""

DOWNSTREAM_FILE = "downstream.json"
"""What ``moelab downstream`` saves in a run folder; the main table reads it."""


def is_dense(arm: Arm) -> bool:
    return arm.tags.get("kind") == "dense"


def measure(
    ctx: Context, arm: Arm, run: Path, n_batches: int, full: dict[str, dict[str, Any]] | None
) -> dict[str, Any]:
    """What the tables need of one run, saved in RUN/analysis: the validation NLL; for an
    MoE run also its routing statistics (``mean``, ``layers``) and the K sweep. ``full``
    (the first seed) receives :func:`moelab.report.report.collect_run`'s whole result,
    gaps included, for the figures."""
    from moelab.report.report import collect_run

    def compute() -> dict[str, Any]:
        if is_dense(arm):
            d = collect_run(run, (), n_batches)
            value = {"nll": _dense_nll(run, n_batches), "dense": True}
        else:
            d = collect_run(run, TOP_KS, n_batches, threshold_scales=())
            stats = d["stats"]
            value = {
                "dense": False,
                "mean": stats["mean"],
                "layers": [
                    {k: v for k, v in lay.items() if k != "load_shares"} for lay in stats["layers"]
                ],
                "sweep": d["sweep"],
                "nll": _sweep_nll(d["sweep"]),
            }
        if full is not None:
            full[arm.name] = {**d, "label": arm.label}
        return value

    value = ctx.cached(run, f"sparse_maps_val_b{n_batches}", compute)
    if full is not None and arm.name not in full:  # read back from RUN/analysis
        full[arm.name] = {
            **collect_run(run, () if is_dense(arm) else TOP_KS, n_batches, threshold_scales=()),
            "label": arm.label,
        }
    if not is_dense(arm):
        from moelab.studies.sparse_maps import saturation

        n_sat = min(n_batches, saturation.BATCHES.get(ctx.scale, 4))
        value["saturation"] = ctx.cached(
            run, f"sparse_maps_saturation_b{n_sat}", lambda: saturation.measure(run, n_sat)
        )
        value["trajectory"] = trajectory(run)
    value["active_params"] = _active_params(run)
    value["downstream_record"] = downstream_record(run)
    value["downstream"] = value["downstream_record"]["scores"]
    return value


def trajectory(run: Path) -> dict[str, Any] | None:
    """:func:`~moelab.studies.sparse_maps.findings.contributor_return` of the
    contributors per token the run logged on its training batches (metrics.jsonl)."""
    from moelab.runs import read_metrics
    from moelab.studies.core import metric_curve
    from moelab.studies.sparse_maps.findings import contributor_return

    xs, ys = metric_curve(read_metrics(run), "contributors")
    return contributor_return(xs, ys)


def _sweep_nll(sweep: dict[str, Any]) -> float | None:
    """The NLL at the trained K of a K sweep."""
    own = [r["nll"] for r in sweep["results"] if r["top_k"] == sweep["trained_top_k"]]
    return own[0] if own else None


def _dense_nll(run: Path, n_batches: int) -> float:
    """Mean NLL per target token of the run's newest checkpoint on the first
    ``n_batches`` validation batches (the batches the K sweep of an MoE run uses)."""
    from moelab.diagnostics import load_run
    from moelab.diagnostics.evaluate import validation_pass

    loaded = load_run(run)
    nll, _, _, _ = validation_pass(loaded, loaded.val_shard(), n_batches, None, None)
    return nll


def measure_ood(ctx: Context, run: Path, data: str, n_batches: int) -> dict[str, Any]:
    """Routing statistics of the run on the corpus ``data`` (saved in RUN/analysis)."""
    from moelab.diagnostics import stats

    digest = hashlib.sha1(str(Path(data).resolve()).encode()).hexdigest()[:10]

    def compute() -> dict[str, Any]:
        st = stats(run, data=data, max_batches=n_batches)
        return {
            "mean": st["mean"],
            "layers": [
                {k: v for k, v in lay.items() if k != "load_shares"} for lay in st["layers"]
            ],
            "nll": st["nll"],
            "tokens": st["tokens"],
        }

    return ctx.cached(run, f"sparse_maps_ood_{digest}_b{n_batches}", compute)


def _active_params(run: Path) -> dict[str, int]:
    """Total and active parameters of the run's model, as training's summary.json
    recorded them (the trained vocabulary), else counted from its config."""
    summary = run / SUMMARY
    try:
        params = json.loads(summary.read_text(encoding="utf-8"))["params"]
        return {k: int(v) for k, v in params.items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        from moelab.diagnostics.evaluate import check_run
        from moelab.model.config import param_counts

        return {k: int(v) for k, v in param_counts(check_run(run).model_config()).items()}


def downstream_scores(run: str | Path) -> dict[str, dict[str, float | None]]:
    """The downstream results ``moelab downstream`` saved in ``RUN/downstream.json``,
    as ``{task: {"acc": accuracy (acc, else acc_norm), "perplexity": ... or None}}``
    from the rows at the run's trained K (a dense run's rows have top_k None; rows of
    other budgets are left out) scored at the run's newest checkpoint (rows of another
    step are left out; rows that record no step are kept, and
    :func:`downstream_record` says so); {} without the file. These fill the downstream
    columns of the study's main table. Raises ValueError for a file that is not JSON."""
    return downstream_record(run)["scores"]


def downstream_record(run: str | Path) -> dict[str, Any]:
    """:func:`downstream_scores` with what the main table's note says about them
    (:func:`moelab.integrations.lm_eval.saved.trained_k_scores`)."""
    from moelab.integrations.lm_eval.saved import trained_k_scores

    return trained_k_scores(run)
