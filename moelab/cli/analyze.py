"""``moelab analyze``: routing analyses of a run (saturation, co-activation,
specialisation, fragility, invariance) and of two routing records (agreement);
docs/analysis.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from moelab.cli.common import (
    HelpFormatter,
    add_json,
    add_max_batches,
    add_step,
    emit,
)


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(f"moelab analyze: {text}", file=sys.stderr, flush=True)


def _agreement(args: argparse.Namespace) -> int:
    """``moelab analyze agreement A B``: two routing record files, no model."""
    from moelab.diagnostics import RoutingRecord
    from moelab.diagnostics.analysis import agreement
    from moelab.report.analysis import write_analysis

    if args.run is None or args.record_b is None:
        raise ValueError("agreement compares two routing records: moelab analyze agreement A B")
    flags = {"--hf": args.hf, "--data": args.data, "--step": args.step}
    flags["--max-tokens"] = args.max_tokens
    given = [flag for flag, v in flags.items() if v is not None]
    if given:
        raise ValueError(f"agreement reads two routing record files; drop {', '.join(given)}")
    paths = Path(args.run), Path(args.record_b)
    for path in paths:
        if not path.is_file():
            what = "a folder" if path.is_dir() else "no such file"
            raise ValueError(
                f"{path} is not a routing record file ({what}); moelab eval RUN --record "
                "FILE or moelab.diagnostics.record writes one"
            )
    a, b = (RoutingRecord.load(path) for path in paths)
    doc = agreement(a, b, args.seq_len, labels=(str(paths[0]), str(paths[1])))
    out = (
        Path(args.out)
        if args.out
        else paths[0].parent / f"agreement_{paths[0].stem}_vs_{paths[1].stem}"
    )
    files = write_analysis(doc, out)
    doc["written"] = [str(f) for f in files]
    return emit(args, doc, lambda d: _text(d, files))


def _analyze(args: argparse.Namespace) -> int:
    if args.name == "agreement":
        return _agreement(args)
    if args.record_b is not None:
        raise ValueError(
            f"{args.name} reads one run folder, got a second ({args.record_b}); two routing "
            "records: moelab analyze agreement A B"
        )
    if args.seq_len is not None:
        raise ValueError("--seq-len applies to agreement; drop it")
    from moelab.diagnostics import load_run
    from moelab.diagnostics.analysis import (
        RunSource,
        coactivation,
        fragility,
        invariance,
        saturation,
        specialization,
    )
    from moelab.report.analysis import write_analysis
    from moelab.runs.checkpoints import checkpoint_step, list_checkpoints

    hf = args.hf or []
    if (args.run is None) == (not hf):
        raise ValueError("give a run folder RUN, or --hf DIR for a Hugging Face model (not both)")
    if hf and not args.out:
        raise ValueError("--hf: give --out DIR for the results (there is no run folder)")
    if len(hf) > 1 and args.name != "saturation":
        raise ValueError(f"{args.name} reads one model; give --hf once (several: saturation)")
    if hf and args.step is not None:
        raise ValueError("--step applies to a run; drop it with --hf")
    if not hf and args.max_tokens is not None:
        raise ValueError("--max-tokens applies to --hf models; use --max-batches for RUN")
    run = None if hf else Path(args.run)
    out = Path(args.out) if args.out else Path(args.run) / "analyze"
    data = args.data or [None]
    if len(data) > 1 and args.name != "specialization":
        raise ValueError(f"{args.name} reads one text; give --data once (several: specialization)")
    kw: dict[str, Any] = {"max_batches": args.max_batches}

    def hf_source(path: str) -> Any:
        from moelab.cli.common import hf_call
        from moelab.integrations.hf.analysis import HFSource, folder_step

        return hf_call(
            HFSource, path, args.max_tokens, step=folder_step(path) if len(hf) > 1 else None,
            trust_remote_code=args.trust_remote_code,
        )  # fmt: skip

    if args.name == "saturation":
        if args.step is not None:
            raise ValueError("saturation reads every kept checkpoint; drop --step")
        if hf:
            from moelab.integrations.hf.analysis import folder_step

            loaders = [lambda p=p: hf_source(p) for p in hf]
            steps: list[Any] = [folder_step(p) for p in hf]
        else:
            load_run(run)  # the run and its newest checkpoint are intact
            steps = [checkpoint_step(p) for p in list_checkpoints(run)]
            loaders = [lambda s=s: RunSource(loaded=load_run(run, s), **kw) for s in steps]
        doc = saturation(loaders, steps, data[0], progress=lambda t: _say(args, t))
    else:
        src = hf_source(hf[0]) if hf else RunSource(loaded=load_run(run, args.step), **kw)
        if args.name == "coactivation":
            doc = coactivation(src, data[0], min_count=args.min_count)
        elif args.name == "specialization":
            doc = specialization(src, data, min_count=args.min_count)
        elif args.name == "invariance":
            doc = invariance(
                src, data[0], n_texts=args.texts, length=args.length, pad=args.pad,
                chunk=args.chunk,
            )  # fmt: skip
        else:
            doc = fragility(
                src, args.setting, data[0], eps=args.eps, direction=args.direction, seed=args.seed
            )
    files = write_analysis(doc, out)
    doc["written"] = [str(f) for f in files]
    return emit(args, doc, lambda d: _text(d, files))


def _text(doc: dict[str, Any], files: list[Path]) -> str:
    md = Path(files[-2]).read_text(encoding="utf-8")
    return md + "\nwritten: " + ", ".join(str(f) for f in files)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "analyze",
        help="routing analyses: saturation, co-activation, specialisation, fragility, "
        "invariance, agreement of two routing records",
        description="Analyses of a run's routing, written as NAME.json, NAME.md and PNG "
        "figures into RUN/analyze/ (or --out), which moelab report includes. saturation: "
        "each kept checkpoint against the last (train with --set keep_every=N to keep "
        "them); coactivation: P(j used | i used) per MoE layer against independent "
        "choice; specialization: per token id and per corpus (--data A --data B); "
        "fragility: the routing under bf16, the map kernels' alternative, or a "
        "perturbed router input, by top-2 gap, threshold and certified radius; "
        "agreement A B: two routing records of one text (e.g. an engine's and moelab's, "
        "or fp32 and bf16), per layer the tokens whose expert set differs, where they "
        "sit, and their margins, written beside A (agreement_A_vs_B/) or into --out; "
        "invariance: a few texts routed alone against in a batch, at other batch rows, "
        "padded, one token at a time or in chunks (KV cache), and recomputed under "
        "activation checkpointing, with the mechanisms that read the batch.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "name",
        choices=(
            "saturation",
            "coactivation",
            "specialization",
            "fragility",
            "invariance",
            "agreement",
        ),
    )
    p.add_argument(
        "run", nargs="?", default=None,
        help="run folder (or --hf DIR); agreement: the routing record file A",
    )  # fmt: skip
    p.add_argument("record_b", nargs="?", default=None, metavar="B",
                   help="agreement: the routing record file B (of the same text)")  # fmt: skip
    p.add_argument(
        "--hf", action="append", default=None, metavar="DIR",
        help="a local Hugging Face MoE model instead of RUN, with --data TEXT and --out DIR; "
        "saturation: one --hf per checkpoint folder, in training order, the last the final",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="--hf: at most N tokens of --data")  # fmt: skip
    p.add_argument(
        "--trust-remote-code", action="store_true",
        help="--hf: let the folder run the Python it names (docs/huggingface.md)",
    )  # fmt: skip
    p.add_argument(
        "--data", action="append", default=None, metavar="TEXT",
        help="corpus instead of the validation split (repeat for specialization's domains)",
    )  # fmt: skip
    p.add_argument(
        "--out", default=None,
        help="output folder (default RUN/analyze; agreement: agreement_A_vs_B/ beside A)",
    )  # fmt: skip
    add_step(p)
    add_max_batches(p)
    p.set_defaults(max_batches=16)
    p.add_argument(
        "--min-count", type=int, default=10, metavar="N",
        help="coactivation: pairs with N tokens; specialization: ids seen N times",
    )  # fmt: skip
    p.add_argument("--setting", choices=("bf16", "kernels", "perturb"), default="perturb",
                   help="fragility: what changes between the two routings")  # fmt: skip
    p.add_argument("--eps", type=float, nargs="+", default=[0.01],
                   help="fragility perturb: ||delta|| / ||x|| (several: one row each)")  # fmt: skip
    p.add_argument(
        "--direction", choices=("random", "adversarial"), default="random",
        help="fragility perturb: a Gaussian direction, or against the top-2 gap",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="fragility perturb random: the seed")
    p.add_argument(
        "--seq-len", type=int, default=None, metavar="S",
        help="agreement: the length S of the recorded sequences (positions t mod S); "
        "default: the records' own, else rows of the record",
    )  # fmt: skip
    p.add_argument("--texts", type=int, default=4, metavar="N",
                   help="invariance: how many texts (pieces of the text) to route")  # fmt: skip
    p.add_argument("--length", type=int, default=32, metavar="L",
                   help="invariance: tokens per text")  # fmt: skip
    p.add_argument("--pad", type=int, default=8, metavar="P",
                   help="invariance: pad tokens before / after a text")  # fmt: skip
    p.add_argument("--chunk", type=int, default=8, metavar="C",
                   help="invariance: tokens per forward of the chunked setting")  # fmt: skip
    add_json(p)
    p.set_defaults(func=_analyze)
