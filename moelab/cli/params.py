"""``moelab params``: parameter counts (and memory) of a model preset."""

from __future__ import annotations

import argparse
from typing import Any

from moelab._format import human
from moelab.cli.common import HelpFormatter, add_json, emit, preset_names


def format_params(r: dict) -> str:
    keys = ("total", "active", "active_at_cap", "router")
    lines = [f"preset  {r['preset']}"] + [
        f"{k.replace('active_at_cap', 'at cap'):<7} {human(r[k]):>8}  ({r[k]:,})"
        for k in keys
        if k in r
    ]
    if "cap" in r:
        lines.append(
            f"experts per token vary (a truncating router, or null experts): active "
            f"counts its nominal k = {r['k']:g} experts per MoE "
            f"layer, at cap the most a token reaches ({r['cap']}); `moelab stats RUN` "
            "measures the mean"
        )
    if "memory" in r:
        from moelab.model.memory import format_table

        lines += ["", format_table(r["memory"], r["preset"])]
    return "\n".join(lines)


def _params(args: argparse.Namespace) -> int:
    from moelab.model import load_preset, param_counts

    config = load_preset(args.preset)
    if args.set:
        from moelab.train import apply_overrides

        config = apply_overrides({"preset": args.preset}, args.set).model_config()
    counts = param_counts(config)
    result: dict = {"preset": args.preset, **{k: int(v) for k, v in counts.items()}}
    if "active_at_cap" in counts:  # a truncating router: experts per token vary
        rc = config.router_config()
        result["k"] = rc.expected_experts
        result["cap"] = rc.slots

    if args.memory:
        from moelab.model.memory import estimate

        result["memory"] = estimate(
            config,
            gpus=args.gpus,
            ep=args.ep,
            batch_tokens=args.batch_tokens,
            checkpoint_activations=args.checkpoint_activations,
            param_dtype=args.param_dtype,
        )
    return emit(args, result, format_params)


def register(sub: Any) -> None:
    params = sub.add_parser(
        "params",
        help="total / active / router parameter counts of a model preset",
        description="Count the parameters of a preset from its config (the model is not "
        "built): total, active per token (embeddings included, K experts per MoE layer) and "
        "the router weights. A truncating router (router.selection=threshold) computes a "
        "token-dependent number of experts: active counts its nominal k per MoE layer "
        "(router.lapsum_k, else top_k), at cap (JSON: active_at_cap) the most a token can "
        "reach, min(E, ceil(k * token_cap_factor)), or every expert without a cap; "
        "`moelab stats` reports the mean measured on data (active_params).",
        formatter_class=HelpFormatter,
    )
    params.add_argument("--preset", required=True, choices=preset_names(), help="the model preset")
    params.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model or router field of the preset, as for train "
        "(model.n_shared_experts=1, router.n_null_experts=2); repeatable",
    )
    params.add_argument(
        "--memory",
        action="store_true",
        help="also estimate the training memory per GPU (parameters, gradients, AdamW "
        "state, buffers, activations) on one GPU, DDP, FSDP and EP x FSDP (formulas: "
        "moelab.model.memory, docs/scale.md)",
    )
    params.add_argument("--gpus", type=int, default=8, help="--memory: GPUs N")
    params.add_argument(
        "--ep",
        type=int,
        default=None,
        help="--memory: expert-parallel group size (default: the largest that divides "
        "both N and the experts; 1: no EP row)",
    )
    params.add_argument(
        "--batch-tokens",
        type=int,
        default=8192,
        help="--memory: tokens per GPU per micro-batch (sequences x sequence length)",
    )
    params.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="--memory: activations with every block recomputed in the backward",
    )
    params.add_argument(
        "--param-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="--memory: parameter dtype (fp32: what moelab trains; bf16: with an fp32 "
        "master copy in the optimizer)",
    )
    add_json(params)
    params.set_defaults(func=_params)
