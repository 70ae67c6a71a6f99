"""``moelab bench``: time the maps, the MoE layer, the selection rules, the one-GPU
check and the downstream batching."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from moelab.bench.moe import SHAPES as MOE_SHAPES
from moelab.cli._common import _emit, _HelpFormatter, _parse_shape, add_json

BENCH_TIMED = ("maps", "moe", "selection", "downstream")
"""The bench targets that time with --threads, --repeats and --warmup (gpu has its own)."""


def _shown(value: Any) -> str:
    """A default as --help shows it: lists space-separated, tuples (shapes) with commas,
    a default per target as "maps 8 16, selection 64"."""
    if isinstance(value, dict):
        return ", ".join(f"{target} {_shown(v)}" for target, v in value.items())
    if isinstance(value, list):
        return " ".join(_shown(v) for v in value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    """The options of moelab bench. Each applies to some targets (its help starts with
    them); it is parsed with the default None, so that :func:`_bench_options` tells a
    given option from an absent one, refuses one given for another target and fills in
    the default (``bench_options`` on the namespace: dest -> (flag, targets, default))."""
    table: dict[str, tuple[str, tuple[str, ...], Any]] = {}

    def option(flag: str, targets: tuple[str, ...], default: Any, text: str, **kw: Any) -> None:
        shown = f" (default: {_shown(default)})"
        if default is None or isinstance(default, bool):  # None: the text says; a switch
            shown = ""
        action = bench.add_argument(
            flag, default=None, help=f"{', '.join(targets)}: {text}{shown}", **kw
        )
        table[action.dest] = (flag, targets, default)

    down, gpu, rows = ("downstream",), ("gpu",), ("maps", "selection")
    option(
        "--run", down, None, "the trained run whose batched loglikelihood is timed against a "
        "bare forward pass over the same tokens (needs the eval extra)",
    )  # fmt: skip
    option("--batch-size", down, 16, "requests per forward pass", type=int)
    option("--device", gpu, None, "cuda (cuda:N) or cpu (default: cuda when present)")
    option("--quick", gpu, False, "every section tiny (a CPU smoke test)", action="store_true")
    option("--steps", gpu, 300, "timed training steps", type=int)
    option(
        "--train-seconds", gpu, 90.0,
        "stop training after this many seconds (at least 3 timed steps)", type=float,
    )  # fmt: skip
    option(
        "--peak-tflops", gpu, None,
        "the device's dense bf16 peak for MFU (default: known GPUs by name)", type=float,
    )  # fmt: skip
    sections = ["train", "maps", "moe", "compile"]
    option("--sections", gpu, sections, "the sections to run", nargs="+", choices=sections)
    option("--rows", rows, 65536, "score rows (tokens)", type=int)
    experts = {"maps": [8, 16, 32, 64, 128], "selection": [64]}
    option("--experts", rows, experts, "values of E", type=int, nargs="+")
    option("--top-k", ("selection",), 8, "K of the rules (at most the smallest E)", type=int)
    option(
        "--shapes", ("moe",), list(MOE_SHAPES), "shapes to time",
        type=_parse_shape, nargs="+", metavar="T,d,f,E,K",
    )  # fmt: skip
    steadiest = "intra-op threads (1 gives the steadiest figures)"
    option("--threads", BENCH_TIMED, 1, steadiest, type=int)
    option("--repeats", BENCH_TIMED, 7, "timed calls per measurement", type=int)
    option("--warmup", BENCH_TIMED, 2, "untimed calls first", type=int)
    bench.set_defaults(bench_options=table)


def _bench_options(args: argparse.Namespace) -> None:
    """Refuse the bench options given for another target (naming each and the targets
    it applies to), fill in the defaults of the others and check the timing counts."""
    table = args.bench_options
    foreign = [
        f"{flag} applies to bench {', '.join(targets)}, not to bench {args.target}"
        for dest, (flag, targets, _) in table.items()
        if getattr(args, dest) is not None and args.target not in targets
    ]
    if foreign:
        out = "leave them out" if len(foreign) > 1 else "leave it out"
        raise ValueError("; ".join([*foreign, out]))
    for dest, (_, targets, default) in table.items():
        if getattr(args, dest) is None and args.target in targets:
            value = default.get(args.target) if isinstance(default, dict) else default
            setattr(args, dest, copy.deepcopy(value))
    if args.target in BENCH_TIMED:
        for flag, least in (("--threads", 1), ("--repeats", 1), ("--warmup", 0)):
            value = getattr(args, flag[2:])
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")


def _bench(args: argparse.Namespace) -> int:
    _bench_options(args)  # another target's options refused, the defaults filled in
    if args.target == "gpu":
        from moelab.bench import gpu

        result = gpu.run(
            device=args.device,
            quick=args.quick,
            steps=args.steps,
            train_seconds=args.train_seconds,
            peak=args.peak_tflops,
            sections=tuple(args.sections),
        )
        return _emit(args, result, gpu.format_report)
    common = dict(
        threads=args.threads, repeats=args.repeats, warmup=args.warmup, progress=not args.json
    )
    if args.target == "moe":
        from moelab.bench import moe as bench

        return _emit(args, bench.run(shapes=args.shapes, **common), bench.format_table)
    if args.target == "downstream":
        from moelab.bench import downstream as bench

        try:
            result = bench.run(args.run, batch_size=args.batch_size, **common)
        except ImportError as err:  # the eval extra is missing
            raise ValueError(str(err)) from err
        return _emit(args, result, bench.format_table)
    if args.target == "selection":
        from moelab.bench import selection as bench

        result = bench.run(rows=args.rows, experts=args.experts, top_k=args.top_k, **common)
        return _emit(args, result, bench.format_table)
    from moelab.bench import maps as bench

    result = bench.run(rows=args.rows, experts=args.experts, **common)
    return _emit(args, result, bench.format_table)


def register(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="time the maps (vs torch.softmax, entmax), the MoE layer (vs Mixtral, dense) or "
        "the selection rules (vs top-K)",
        description="maps: time forward and forward+backward of every map on float32 scores of "
        "shape (rows, E) and report medians and ratios to torch.softmax. moe: time the MoE "
        "layer, the transformers Mixtral block with the same weights, the dense lower bound "
        "(same active FLOPs as plain matmuls) and the router alone, with ratios to the bound. "
        "selection: time every selection rule (map, selection, gate on (rows, E) scores) "
        "with ratios to softmax top-K. gpu: the one-GPU check (at most ~5 minutes, its own "
        "tokens): bf16 training of paper-300m (tokens/s, MFU, peak memory), every map on "
        "the device against CPU float64, the MoE layer (loop and grouped GEMM) against the "
        "dense bound, torch.compile against eager; JSON keys in docs/scale.md. downstream: "
        "the batched loglikelihood of moelab downstream on a run's cloze requests against a "
        "bare forward pass over the same padded batches (docs/downstream.md). Each option "
        "names the targets it applies to; an option given for another target is refused.",
        formatter_class=_HelpFormatter,
    )
    bench.add_argument(
        "target",
        choices=["maps", "moe", "selection", "gpu", "downstream"],
        help="what to benchmark",
    )
    _bench_arguments(bench)
    add_json(bench)
    bench.set_defaults(func=_bench)
