"""``moelab routing convert``: a routing record from one form to another (moelab's
safetensors record, an engine's ``routed_experts`` array, Megatron-Core's router_replay
tensors; :mod:`moelab.diagnostics.replay_formats`).

Shape suffixes: T, K (moelab.shapes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from moelab.cli.common import HelpFormatter, add_debug, add_json, emit

FORMATS = ("moelab", "array", "megatron")
"""The forms --to writes (moelab.diagnostics.replay_formats.FORMATS; named here so that
--help imports no torch)."""

_SOURCES = {
    "moelab": "a moelab routing record (safetensors)",
    "array": "a routed_experts array (.npz with its layer map)",
    "npy": "a bare routed_experts array (.npy)",
    "megatron": "a Megatron-Core router_replay file (torch.save list of per-layer tensors)",
}


def _layer_list(text: str) -> list[int]:
    """``--moe-layers 1,3,5``: the model layer of each MoE layer."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer numbers such as 1,3,5, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("give at least one layer number")
    return ids


def format_convert(r: dict) -> str:
    """The text of moelab routing convert: what was read, what was written."""
    extras = []
    if r["token_ids"]:
        extras.append("token ids")
    if r["unfilled"]:
        extras.append(f"{r['unfilled']:,} unfilled slots")
    if r["n_null"]:
        extras.append(f"{r['n_null']} null experts")
    more = f", with {', '.join(extras)}" if extras else ""
    if r["token_ids_dropped"]:
        more += " (token ids not written: Megatron's form holds the indices only)"
    layers = f" {r['layer_ids']}" if r["to"] == "array" else ""  # the form that keeps them
    k = r["top_k"] if r["top_k"] is not None else "/".join(map(str, r["slots"]))
    return "\n".join(
        [
            f"read {r['input']}: {_SOURCES[r['from']]}",
            f"wrote {r['output']} as {r['to']}: {r['tokens']:,} tokens x {r['moe_layers']} MoE "
            f"layers{layers} x K={k}, E={r['n_experts']}{more}",
        ]
    )


def _convert(args: argparse.Namespace) -> int:
    from moelab.diagnostics.replay_formats import load_any, save_as

    src, out = Path(args.input), Path(args.output)
    if args.n_experts is not None and args.n_experts < 1:
        raise ValueError(f"--n-experts must be >= 1, got {args.n_experts}")
    if out.exists():
        if src.exists() and os.path.samefile(src, out):
            raise ValueError(f"{out} is the input file; write the converted record elsewhere")
        if not args.overwrite:
            raise ValueError(f"{out} exists; give another OUT, or --overwrite to replace it")
        if out.is_dir():
            raise ValueError(f"{out} is a folder; OUT is the file to write")
    got = load_any(src, args.n_experts, layer_ids=args.moe_layers)
    rec = got.record
    save_as(rec, out, args.to, got.layer_ids)
    result = {
        "input": str(src),
        "from": got.source,
        "output": str(out),
        "to": args.to,
        "tokens": rec.tokens,
        "moe_layers": rec.n_layers,
        "layer_ids": got.layer_ids,
        "top_k": rec.top_k,
        "slots": rec.slots,
        "n_experts": rec.n_experts,
        "n_null": rec.n_null,
        "token_ids": rec.token_ids is not None and args.to != "megatron",
        # NOTE: Megatron's form holds the expert indices only
        "token_ids_dropped": rec.token_ids is not None and args.to == "megatron",
        "unfilled": sum(int((~c).sum()) for c in rec.chosen_TK),
    }
    return emit(args, result, format_convert)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "routing",
        help="convert routing-replay records between moelab's file and the engines' forms",
        description="Routing-replay records in the forms inference and training engines "
        "exchange them (docs/replay.md, 'Formats'). 'convert IN OUT --to FORM' reads IN, "
        "whose form it detects from the file (a moelab .safetensors record, a "
        "routed_experts .npz or bare .npy array as vLLM and SGLang return it, or a "
        "Megatron-Core router_replay torch.save file), checks it and writes OUT as FORM.",
        formatter_class=HelpFormatter,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = actions.add_parser(
        "convert",
        help="read a routing record in any form, write it in another",
        description="Read the routing record IN (its form detected from the file and "
        "named in the first line printed), check it (shape, dtype, expert ids within "
        "[0, E), the layer map) and write it to OUT as --to: 'moelab' (the safetensors "
        "record of moelab eval --record and moelab.diagnostics.record), 'array' (an .npz: "
        "routed_experts int32 (tokens, MoE layers, K), unfilled slots -1, with its token "
        "ids, the model layer of each MoE layer and E) or 'megatron' (a torch.save list "
        "of int64 (tokens, K) tensors, one per MoE layer, as Megatron-Core's "
        "RouterReplay.set_replay_data takes it). OUT must not exist (--overwrite "
        "replaces it; never the input).",
        formatter_class=HelpFormatter,
    )
    c.add_argument("input", metavar="IN", help="the record to read")
    c.add_argument("output", metavar="OUT", help="the file to write")
    c.add_argument("--to", required=True, choices=FORMATS, help="the form to write")
    c.add_argument(
        "--n-experts",
        type=int,
        default=None,
        metavar="E",
        help="the model's experts per layer: needed for a bare .npy array and a Megatron "
        "file (which do not say), checked against the others",
    )
    c.add_argument(
        "--moe-layers",
        type=_layer_list,
        default=None,
        metavar="IDS",
        help="the model layer of each MoE layer, comma-separated (e.g. 1,3): an engine's "
        "array with one entry per decoder layer keeps these; default: the file's map, "
        "else 0..L-1",
    )
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (never IN)")
    add_json(c)
    add_debug(c)
    c.set_defaults(func=_convert)
