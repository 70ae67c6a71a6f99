"""``moelab stats``: routing statistics of a run or a Hugging Face model."""

from __future__ import annotations

import argparse
from typing import Any

from moelab._format import human
from moelab.cli.common import (
    HelpFormatter,
    add_hf,
    add_json,
    add_max_batches,
    add_step,
    coverage,
    emit,
    fmt_value,
    hf_call,
    hf_head,
    run_or_hf,
)

COLUMNS = (
    "discarded_mass",
    "contributors",
    "singleton_rate",
    "pair_rate",
    "score_rms",
    "gap_p50",
    "contrib_cv",
    "load_cv",
    "lipschitz",
    "radius_p50",
)
"""The per-layer columns of moelab stats RUN."""

HF_COLUMNS = ("discarded_mass", "contributors", "score_rms", "gap_p50", "contrib_cv", "load_cv")
"""The per-layer columns of moelab stats --hf DIR."""


def format_active_hist(r: dict) -> list[str]:
    """The lines of the per-layer distribution of active experts per token (the SoftMoE
    paper's Figure 1): each layer's share of tokens computing n experts, n from 0 to the
    largest count any layer reached; none when a layer has no histogram."""
    from moelab.diagnostics import active_histograms

    try:
        shares = active_histograms(r, shares=True)
    except ValueError:
        return []
    counts = active_histograms(r)
    width = max(max((n for n, c in enumerate(row) if c), default=0) for row in counts) + 1
    lines = [
        "active experts per token, per layer (share of tokens computing n experts):",
        f"{'layer':>5} " + " ".join(f"{f'n={n}':>7}" for n in range(width)),
    ]
    for lay, row in zip(r["layers"], shares, strict=True):
        lines.append(f"{lay['layer']:>5} " + " ".join(f"{v:>7.3f}" for v in row[:width]))
    return lines


def routers_per_layer(r: dict) -> list[str]:
    """The line naming each MoE layer's selection, K (and map where they differ) of a
    model whose layers route differently (``router_layers``); none otherwise."""
    if r.get("uniform_routers", True):
        return []
    return [
        "routers per layer (router_layers): "
        + ", ".join(
            f"{lay['layer']} {lay['selection']} K={lay['top_k']}"
            + (f" {lay['map']}" if "map" in lay else "")
            for lay in r["layers"]
        )
    ]


def format_stats(r: dict) -> str:
    """The text of moelab stats RUN: the means over MoE layers, then a row per layer."""
    from moelab import maps
    from moelab.diagnostics import CERT_FIELDS, FIELDS

    cols = COLUMNS
    alpha = "" if r["alpha"] is None else f" alpha={r['alpha']}"
    split = f"corpus {r['data']}" if "data" in r else "validation split"
    lines = [
        f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}{alpha}  "
        + ("truncating" if r["truncating"] else f"K={r['top_k']}"),
        f"{split}: nll {r['nll']:.4f} over "
        + coverage(r["tokens"], r["batches"], r["batches_total"]),
        "active params per token (measured: non-expert + active experts x expert): "
        + (
            "-"
            if r["active_params"] is None
            else f"{human(round(r['active_params']))} ({r['active_params']:,.0f})"
        ),
    ]
    lines += routers_per_layer(r)
    lines.append("mean over MoE layers:")
    lines += [f"  {f:<28} {fmt_value(r['mean'][f])}" for f in FIELDS]
    lines.append(f"temperature and certified top-1 radii (schedule {r['schedule']}):")
    lines += [f"  {f:<28} {fmt_value(r['mean'][f])}" for f in CERT_FIELDS]
    if maps.info(r["map"]).needs_k:
        learned = "learned" if r["learned_allocation"] else "fixed"
        lines.append(f"LapSum ({learned} k per layer):")
        for lay in r["layers"]:
            lines.append(
                f"  layer {lay['layer']}: k_l {fmt_value(lay['lapsum_k'])}  cut "
                f"{fmt_value(lay['truncation'])}  active experts {fmt_value(lay['active_experts'])}"
            )
    lines.append("per layer:")
    lines.append(f"{'layer':>5} {'block':>5} " + " ".join(f"{c[:10]:>10}" for c in cols))
    for lay in r["layers"]:
        lines.append(
            f"{lay['layer']:>5} {lay['block']:>5} "
            + " ".join(f"{fmt_value(lay[c]):>10}" for c in cols)
        )
    lines += format_active_hist(r)
    return "\n".join(lines)


def _stats(args: argparse.Namespace) -> int:
    from moelab.diagnostics import load_run, stats

    if run_or_hf(args):
        return _stats_hf(args)
    result = stats(load_run(args.run, args.step), data=args.data, max_batches=args.max_batches)

    return emit(args, result, format_stats)


def format_stats_hf(r: dict) -> str:
    """The text of moelab stats --hf DIR."""
    from moelab.diagnostics import FIELDS

    cols = HF_COLUMNS
    lines = [
        f"{hf_head(r)}  K={r['top_k']}  statistics map {r['map']} (over all E)",
        f"text {r['data']}: nll {r['nll']:.4f} over {r['tokens']:,} tokens",
    ]
    lines += routers_per_layer(r)
    lines.append("mean over MoE layers:")
    lines += [f"  {f:<28} {fmt_value(r['mean'][f])}" for f in FIELDS]
    lines.append("per layer:")
    lines.append(f"{'layer':>5} " + " ".join(f"{c[:10]:>10}" for c in cols) + "  router")
    for lay in r["layers"]:
        lines.append(
            f"{lay['layer']:>5} "
            + " ".join(f"{fmt_value(lay[c]):>10}" for c in cols)
            + f"  {lay['name']}"
            + ("  (routed by token id)" if lay.get("routed_by") == "token_id" else "")
        )
    lines += format_active_hist(r)
    return "\n".join(lines)


def _stats_hf(args: argparse.Namespace) -> int:
    from moelab.integrations.hf.stats import hf_stats

    result = hf_call(
        hf_stats,
        args.hf,
        args.data,
        max_tokens=args.max_tokens,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    )

    return emit(args, result, format_stats_hf)


def register(sub: Any) -> None:
    st = sub.add_parser(
        "stats",
        help="routing statistics of a run, overall and per MoE layer",
        description="Routing statistics (discarded mass, contributors, support sizes, load "
        "balance, score gaps, the distribution of active experts per token; see "
        "moelab.diagnostics.stats) of the newest checkpoint of RUN "
        "(or --step N's) with its trained K, on its validation split or the corpus --data. "
        "With --hf DIR instead of RUN: the same statistics of a local Hugging Face MoE "
        "model on the text --data (a file or a folder of .txt files); see docs/huggingface.md.",
        formatter_class=HelpFormatter,
    )
    st.add_argument("run", nargs="?", default=None, help="run folder (or --hf DIR)")
    st.add_argument(
        "--data",
        default=None,
        help="a corpus instead of the validation split: a folder of text files (one "
        "document each) or one file (for RUN: one document per paragraph)",
    )
    add_step(st)
    add_max_batches(st)
    add_hf(st, swap=False)
    add_json(st)
    st.set_defaults(func=_stats)
