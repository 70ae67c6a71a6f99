"""``moelab export``: a run as a Hugging Face transformers folder
(:func:`moelab.integrations.hf.export.export_run`)."""

from __future__ import annotations

import argparse
from typing import Any

from moelab.cli.common import HelpFormatter, add_json, add_step, emit, hf_call


def loading_code(r: dict) -> str:
    """The Python that loads the exported folder ``r["path"]``."""
    trust = ", trust_remote_code=True" if r["format"] == "remote" else ""
    path = r["path"]
    return "\n".join(
        [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model = AutoModelForCausalLM.from_pretrained({path!r}{trust})",
            f"tokenizer = AutoTokenizer.from_pretrained({path!r}{trust})",
        ]
    )


def format_export(r: dict) -> str:
    """The text of moelab export: what was written, the check, and how to load it."""
    what = (
        f"native {r['architecture']} (model_type qwen2_moe, no custom code)"
        if r["format"] == "native"
        else f"remote code {r['architecture']} (model_type moelab; needs moelab installed "
        "and trust_remote_code=True)"
    )
    lines = [f"exported run {r['run']} checkpoint step {r['step']} to {r['path']}", f"  as {what}"]
    if r.get("reason"):
        lines.append(f"  not native because of {r['reason']}")
    lines.append(f"  files: {'  '.join(r['files'])}")
    lines.append(
        "  checked: reloaded with transformers, float32 logits on a fixed input within "
        f"{r['max_abs_diff']:.1e} of the run's model (limit {r['limit']:g})"
    )
    lines.append("load it with:")
    lines += [f"  {line}" for line in loading_code(r).splitlines()]
    return "\n".join(lines)


def _export(args: argparse.Namespace) -> int:
    from moelab.integrations.hf.export import CHECK_ATOL, export_run

    result = hf_call(
        lambda: export_run(args.run, args.out, step=args.step, format=args.format).to_dict()
    )
    result["limit"] = CHECK_ATOL
    result["loading_code"] = loading_code(result)
    return emit(args, result, format_export)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a run as a Hugging Face transformers folder (save_pretrained layout)",
        description="Write the newest checkpoint of RUN (or --step N's) as a folder that "
        "transformers' AutoModelForCausalLM.from_pretrained(OUT) loads: config.json, "
        "model.safetensors (float32), the run's tokenizer and generation_config.json. "
        "--format native: transformers' own qwen2_moe, no custom code, for runs whose "
        "routers are plain softmax top-k (with or without renorm); --format remote: "
        "moelab's own model behind transformers' interface (modeling_moelab.py in the "
        "folder; loads with trust_remote_code=True and needs moelab installed), for any "
        "router; auto: native where exact, else remote. The folder is built beside OUT, "
        "reloaded and its logits compared with the run's before it is renamed to OUT; "
        "see docs/huggingface.md.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("run", help="run folder")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the folder to write: new, empty, or an earlier moelab export (replaced)",
    )
    add_step(p)
    p.add_argument(
        "--format",
        choices=("auto", "native", "remote"),
        default="auto",
        help="native (qwen2_moe), remote (moelab's code in the folder) or auto",
    )
    add_json(p)
    p.set_defaults(func=_export)
