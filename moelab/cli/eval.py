"""``moelab eval``: the inference-time budget sweep (K, or the truncation scale)."""

from __future__ import annotations

import argparse
from typing import Any

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


def _hf_router_keys(args: argparse.Namespace) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for item in args.router or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--router {item!r}: expected key=value (e.g. selection=top_p)")
        keys[key] = _router_value(value)
    if args.map is not None:
        keys["map"] = args.map
    if args.alpha is not None:
        keys["alpha"] = args.alpha
    return keys


def _router_value(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word: a string


def _truncation_table(rows: list[dict], title: str) -> list[str]:
    base = {r["threshold_scale"]: r["nll"] for r in rows}.get(1.0)
    lines = [
        title,
        f"{'scale':>5}  {'NLL':>8}  {'retained':>8}  {'active':>7}  {'dNLL':>9}",
    ]
    for r in rows:
        d = None if base is None else r["nll"] - base
        mark = " *" if r["threshold_scale"] == 1.0 else ""
        lines.append(
            f"{r['threshold_scale']:>5g}  {r['nll']:>8.4f}  {fmt_value(r['retained_mass']):>8}  "
            f"{fmt_value(r['active_experts'], '.3f'):>7}  {fmt_value(d, '+.5f'):>9}{mark}"
        )
    return lines


def format_truncation(r: dict) -> str:
    thresholds = ", ".join(f"{t:.4g}" for t in r["thresholds"])
    lines = [
        f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}  "
        f"E={r['n_experts']}  trained thresholds {thresholds} (scale 1, *)"
    ]
    first = r["results"][0]
    cover = coverage(first["tokens"], first["batches"], r["batches_total"])
    lines += _truncation_table(r["results"], f"validation split, {cover}:")
    if "results_data" in r:
        first = r["results_data"][0]
        cover = coverage(first["tokens"], first["batches"], r["batches_total_data"])
        lines += _truncation_table(r["results_data"], f"corpus {r['data']}, {cover}:")
    return "\n".join(lines)


def _eval_truncation(args: argparse.Namespace) -> int:
    from moelab.diagnostics import evaluate_truncation, load_run

    result = evaluate_truncation(
        load_run(args.run, args.step),
        args.threshold_scale,
        data=args.data,
        max_batches=args.max_batches,
    )

    return emit(args, result, format_truncation)


def _budget_table(rows: list[dict], trained: int, title: str) -> list[str]:
    base = {r["top_k"]: r["nll"] for r in rows}.get(trained)
    lines = [title, f"{'K':>3}  {'NLL':>8}  {'retained':>8}  {'contrib':>7}  {'dNLL':>9}"]
    for r in rows:
        d = None if base is None else r["nll"] - base
        mark = " *" if r["top_k"] == trained else ""
        lines.append(
            f"{r['top_k']:>3}  {r['nll']:>8.4f}  {fmt_value(r['retained_mass']):>8}  "
            f"{fmt_value(r['contributors'], '.3f'):>7}  {fmt_value(d, '+.5f'):>9}{mark}"
        )
    return lines


def format_eval(r: dict) -> str:
    k = r["trained_top_k"]
    lines = [
        f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}  "
        f"E={r['n_experts']}  trained K={k} (*)"
    ]
    first = r["results"][0]
    cover = coverage(first["tokens"], first["batches"], r["batches_total"])
    lines += _budget_table(r["results"], k, f"validation split, {cover}:")
    lines.append(
        f"NLL increase from K={k} to K={max(x['top_k'] for x in r['results'])}: "
        f"{fmt_value(r['nll_increase'], '+.5f')}"
    )
    if "results_data" in r:
        first = r["results_data"][0]
        cover = coverage(first["tokens"], first["batches"], r["batches_total_data"])
        lines += _budget_table(r["results_data"], k, f"corpus {r['data']}, {cover}:")
    if "record" in r:
        x = r["record"]
        lines.append(
            f"recorded the routing at K={x['top_k']} of {x['batches']} batches "
            f"({x['routed_tokens']:,} tokens per layer, NLL {x['nll']:.4f}) into {x['file']}"
        )
    if "replay" in r:
        x = r["replay"]
        lines.append(
            f"replayed {x['file']} at K={x['top_k']} on {x['batches']} batches "
            f"({x['consumed']:,} of {x['routed_tokens']:,} recorded tokens per layer): "
            f"NLL {x['nll']:.4f}, own routing {x['nll_own']:.4f} "
            f"({fmt_value(x['nll'] - x['nll_own'], '+.5f')}), chosen sets changed "
            f"{x['changed_fraction']:.2%}"
        )
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    from moelab.diagnostics import evaluate, load_run

    if run_or_hf(args):
        return _eval_hf(args)
    if args.threshold_scale is not None:
        if args.record or args.replay:
            raise ValueError(
                "--record and --replay work with the K sweep (--top-k), not with --threshold-scale"
            )
        return _eval_truncation(args)
    loaded = load_run(args.run, args.step)
    result = evaluate(
        loaded,
        args.top_k,
        data=args.data,
        max_batches=args.max_batches,
        record_to=args.record,
        replay_from=args.replay,
    )

    return emit(args, result, format_eval)


def format_eval_hf(r: dict) -> str:
    k = r["trained_top_k"]
    base = {x["top_k"]: x["nll"] for x in r["results"]}.get(k)
    keys = " ".join(f"{a}={b}" for a, b in r["router_keys"].items())
    lines = [
        f"{hf_head(r)}  own K={k} (*)" + (f"  swapped routers: {keys}" if keys else ""),
        f"text {r['data']}, {r['results'][0]['tokens']:,} target tokens:",
        f"{'K':>3}  {'NLL':>8}  {'retained':>8}  {'contrib':>7}  {'dNLL':>9}",
    ]
    for x in r["results"]:
        d = None if base is None else x["nll"] - base
        mark = " *" if x["top_k"] == k else ""
        lines.append(
            f"{x['top_k']:>3}  {x['nll']:>8.4f}  {fmt_value(x['retained_mass']):>8}  "
            f"{fmt_value(x['contributors'], '.3f'):>7}  {fmt_value(d, '+.5f'):>9}{mark}"
        )
    return "\n".join(lines)


def _eval_hf(args: argparse.Namespace) -> int:
    from moelab.integrations.hf.sweep import hf_eval

    if args.record or args.replay:
        raise ValueError(
            "--record and --replay apply to a moelab RUN; for a Hugging Face model use "
            "moelab.diagnostics.record and replay after swap_routers (docs/replay.md)"
        )

    result = hf_call(
        hf_eval,
        args.hf,
        args.data,
        args.top_k,
        router_keys=_hf_router_keys(args),
        max_tokens=args.max_tokens,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    )

    return emit(args, result, format_eval_hf)


def register(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="inference-time budget sweep: NLL, retained mass, contributors for each K",
        description="Run the newest checkpoint of RUN (or --step N's) with each K experts per "
        "token (the same weights) over its validation split in file order, and report the "
        "mean NLL per token, the retained map mass (1 - discarded mass) and the mean "
        "number of contributing experts, with the NLL change from the trained K. "
        "Truncating routers (router.selection=threshold) sweep their threshold instead: "
        "--threshold-scale. "
        "With --hf DIR instead of RUN: the same sweep of a local Hugging Face MoE model on "
        "the text --data, optionally after swapping its routers for moelab ones (--map, "
        "--alpha, --router); see docs/huggingface.md.",
        formatter_class=HelpFormatter,
    )
    ev.add_argument("run", nargs="?", default=None, help="run folder (or --hf DIR)")
    budget = ev.add_mutually_exclusive_group(required=True)
    budget.add_argument("--top-k", type=int, nargs="+", help="values of K")
    budget.add_argument(
        "--threshold-scale",
        type=float,
        nargs="+",
        help="truncating routers: multiply every layer's cut on p (router.truncation) by "
        "each value (1: as trained, 0: every expert up to the cap)",
    )
    ev.add_argument(
        "--data",
        default=None,
        help="also evaluate this corpus: a folder of text files (one document each) "
        "or one file (for RUN: one document per paragraph)",
    )
    routing = ev.add_mutually_exclusive_group()
    routing.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="also record the experts every MoE layer chooses at the trained K on the same "
        "batches into FILE (safetensors; docs/replay.md)",
    )
    routing.add_argument(
        "--replay",
        default=None,
        metavar="FILE",
        help="also evaluate the same batches with the experts recorded in FILE replayed "
        "(--top-k must be the recorded K) and report the NLL against the model's own routing",
    )
    add_step(ev)
    add_max_batches(ev)
    add_hf(ev, swap=True)
    add_json(ev)
    ev.set_defaults(func=_eval)
