"""The ``softmoe`` study's section that sets the paper's numbers (:mod:`.paper`) beside
moelab's, with both scales stated (:mod:`moelab.studies.softmoe`)."""

from __future__ import annotations

from typing import Any

from moelab.studies.core import Context, Section, StudyTable
from moelab.studies.softmoe.grid import GROUPS
from moelab.studies.softmoe.paper import (
    PAPER_SCALE,
    TABLE5,
    TRAIN_AE_REDUCTION,
    paper_row,
)

__all__ = ["moelab_scale", "paper_section", "paper_table5"]


def moelab_scale(scale: str, common: dict[str, Any]) -> str:
    """The scale moelab's numbers were measured at, in words: the model (parameters,
    MoE layers, experts) and the training tokens."""
    from moelab.model.config import param_counts
    from moelab.train import TrainConfig

    cfg = TrainConfig(**common)
    mc = cfg.model_config()
    total = param_counts(mc)["total"]
    steps, batch, seq = cfg.steps, cfg.batch_size, cfg.seq_len
    return (
        f"moelab: scale `{scale}`, a {total / 1e6:.2f}M-parameter model, "
        f"{mc.n_layers} blocks, {len(mc.moe_indices)} MoE layers of {mc.n_experts} "
        f"experts; {steps} steps of {batch} x {seq} tokens ({steps * batch * seq:,} tokens)"
    )


def _mean(values: Any) -> float | None:
    vals = [float(v) for v in values or [] if v is not None]
    return sum(vals) / len(vals) if vals else None


def _model(info: dict[str, Any]) -> str:
    return {"sparse": "Sparse MoE", "star": "SoftMoE*", "learned": "SoftMoE"}[info["kind"]]


def _paper_cells(info: dict[str, Any], dataset: str) -> dict[str, str]:
    row = paper_row(dataset, _model(info), info["k"], info["alpha"])
    if row is None:
        return {f"{dataset}_{c}": "-" for c in ("train_ae", "infer_ae", "loss")}
    return {
        f"{dataset}_train_ae": f"{row.train_ae:.2f}",
        f"{dataset}_infer_ae": f"{row.infer_ae:.2f}",
        f"{dataset}_loss": f"{row.loss:.2f}" + ("" if row.group == info["group"] else "*"),
    }


def paper_section(
    ctx: Context, info: dict[str, dict[str, Any]], columns: dict[str, dict[str, list[Any]]]
) -> Section:
    """The paper's Table 1 (OWT and C4) beside moelab's means over the seeds, each
    main arm on one row, and the Train-AE reduction of the "<= 2" group."""
    rows = []
    for arm in ctx.arms:
        meta = info[arm.name]
        if not meta["main"]:
            continue
        cols = columns[arm.name]
        rows.append(
            {
                "arm": arm.name,
                "group": meta["group_text"],
                "train_ae": _mean(cols["train_ae"]),
                **_paper_cells(meta, "OWT"),
                **_paper_cells(meta, "C4"),
                "infer_ae": _mean(cols["infer_ae"]),
                "loss": _mean(cols["loss"]),
            }
        )
    # NOTE: moelab's cells are plain means (no per-seed lists): the seed-by-seed numbers
    # and their paired differences are Table 1's
    table = StudyTable(
        "softmoe_paper",
        "The paper's Table 1 beside moelab's (means over the seeds)",
        [
            ("Arm", "arm", "s"),
            ("#Expert", "group", "s"),
            ("Train-AE", "train_ae", ".2f"),
            ("OWT Train-AE", "OWT_train_ae", "s"),
            ("C4 Train-AE", "C4_train_ae", "s"),
            ("Infer-AE", "infer_ae", ".2f"),
            ("OWT Infer-AE", "OWT_infer_ae", "s"),
            ("C4 Infer-AE", "C4_infer_ae", "s"),
            ("Loss", "loss", ".3f"),
            ("OWT Loss", "OWT_loss", "s"),
            ("C4 Loss", "C4_loss", "s"),
        ],
        rows,
        note="Unprefixed columns: moelab, the mean over the seeds of Table 1's cells. "
        "OWT, C4: the paper's Table 1 for the same configuration ('-': not a row of the "
        "paper; '*': the paper puts that row in another budget group, the one of its "
        "Infer-AE). Losses are on different corpora, tokenizers and scales and compare "
        "only within a column.",
    )
    text = [
        "Scales: " + moelab_scale(ctx.scale, ctx.common) + "; " + PAPER_SCALE + ".",
    ]
    sparse = columns.get(GROUPS[2], {}).get("train_ae")
    for arm in ctx.arms:
        meta = info[arm.name]
        if meta["kind"] != "star" or meta["group"] != 2 or not meta["main"] or not sparse:
            continue
        soft = columns[arm.name]["train_ae"]
        ratios = [1 - a / b for a, b in zip(soft, sparse, strict=True) if a is not None and b]
        if ratios:
            paper = ", ".join(f"{v:.0%} {d}" for d, v in TRAIN_AE_REDUCTION.items())
            text.append(
                f"In the ≤ 2 group the Train-AE of `{arm.name}` is {_mean(ratios):.1%} below "
                f"that of `{GROUPS[2]}` (1 − their ratio, mean over the seeds; negative: "
                f"above it); the paper's SoftMoE* k = 1.5: {paper} below."
            )
    return Section("The paper's numbers beside moelab's", "\n\n".join(text), [table])


def paper_table5(info: dict[str, Any], dataset: str) -> str:
    """The paper's Table 5 value for an arm's configuration ("-" where it has none)."""
    key = (_model(info), float(info["k"]), info["alpha"])
    for (model, k, alpha), value in TABLE5[dataset].items():
        if (model, float(k), alpha) == key:
            return f"{value:.2f}"
    return "-"
