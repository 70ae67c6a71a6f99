"""``moelab bench``: time the maps, the MoE layer, the selection rules, the one-GPU
check and the downstream batching."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from moelab.bench import MOE_SHAPES, TORCHTITAN_SHAPES
from moelab.cli.common import HelpFormatter, add_debug, add_json, emit

BENCH_TIMED = ("maps", "moe", "selection", "downstream", "train", "hf", "torchtitan")
"""The bench targets that time with --threads, --repeats and --warmup (gpu has its own)."""

SECTIONS = ("train", "maps", "moe", "compile")
"""The sections of ``moelab bench gpu``."""


def _parse_shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        t, d, f, e, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is T,d,f,E,K (five integers), got {text!r}"
        ) from None
    if min(t, d, f, e, k) < 1 or k > e:
        raise argparse.ArgumentTypeError(
            f"a shape T,d,f,E,K needs every number >= 1 and K <= E, got {text!r}"
        )
    return t, d, f, e, k


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


OPTIONS: tuple[tuple[str, tuple[str, ...], Any, str, dict[str, Any]], ...] = (
    ("--run", ("downstream",), None, "the trained run whose batched loglikelihood is timed "
     "against a bare forward pass over the same tokens (needs the eval extra)", {}),
    ("--hf", ("hf",), None, "a local save_pretrained folder of an MoE model (default: a "
     "tiny random Mixtral built in memory: 2 layers, E=8, top-2, width 64)", {}),
    ("--block", ("hf",), 16, "forwards per timed round (one collect block per hooked round)",
     {"type": int}),
    ("--batch-size", ("downstream", "train", "hf"), {"downstream": 16, "train": 8, "hf": 4},
     "requests per forward pass (downstream); sequences per training step (train) or "
     "forward pass (hf)", {"type": int}),
    ("--preset", ("train",), "tiny", "the MoE model preset (moelab presets)", {}),
    ("--seq-len", ("train", "hf"), {"train": 128, "hf": 512}, "tokens per sequence",
     {"type": int}),
    ("--run-steps", ("train",), 300,
     "steps of the whole eager and compiled runs (compilation included)", {"type": int}),
    ("--no-compile", ("train",), False, "leave out the compiled runs",
     {"action": "store_true"}),
    ("--backend", ("train",), "inductor", "torch.compile backend of the compiled runs", {}),
    ("--profile-steps", ("train",), 3, "steps under torch.profiler", {"type": int}),
    ("--device", ("gpu",), None, "cuda (cuda:N) or cpu (default: cuda when present)", {}),
    ("--quick", ("gpu",), False, "every section tiny (a CPU smoke test)",
     {"action": "store_true"}),
    ("--steps", ("gpu",), 300, "timed training steps", {"type": int}),
    ("--train-seconds", ("gpu",), 90.0,
     "stop training after this many seconds (at least 3 timed steps)", {"type": float}),
    ("--peak-tflops", ("gpu",), None,
     "the device's dense bf16 peak for MFU (default: known GPUs by name)", {"type": float}),
    ("--sections", ("gpu",), list(SECTIONS), "the sections to run",
     {"nargs": "+", "choices": list(SECTIONS)}),
    ("--rows", ("maps", "selection"), 65536, "score rows (tokens)", {"type": int}),
    ("--experts", ("maps", "selection"), {"maps": [8, 16, 32, 64, 128], "selection": [64]},
     "values of E", {"type": int, "nargs": "+"}),
    ("--march", ("maps",), None, "build the fused kernels for this -march target (native, "
     "x86-64-v3: AVX2 without AVX-512, x86-64-v4: AVX-512, ...; default: "
     "$MOELAB_KERNEL_MARCH, else native)", {}),
    ("--compile", ("maps",), False, "time every map's PyTorch path (the path a CUDA tensor "
     "takes) compiled with torch.compile (inductor, fullgraph) against eager, with the "
     "compile time, instead of the kernels", {"action": "store_true"}),
    ("--top-k", ("selection",), 8, "K of the rules (at most the smallest E)", {"type": int}),
    ("--shapes", ("moe", "torchtitan"),
     {"moe": list(MOE_SHAPES), "torchtitan": list(TORCHTITAN_SHAPES)}, "shapes to time",
     {"type": _parse_shape, "nargs": "+", "metavar": "T,d,f,E,K"}),
    ("--threads", BENCH_TIMED, 1, "intra-op threads (1 gives the steadiest figures)",
     {"type": int}),
    ("--repeats", BENCH_TIMED, {**dict.fromkeys(BENCH_TIMED, 7), "train": 20, "hf": 10},
     "timed calls (train: steps; hf: rounds) per measurement", {"type": int}),
    ("--warmup", BENCH_TIMED, {**dict.fromkeys(BENCH_TIMED, 2), "hf": 1},
     "untimed calls (hf: rounds) first", {"type": int}),
)  # fmt: skip
"""The options of moelab bench: (flag, the targets whose sub-command takes it, default
(per target: a dict), help text, add_argument's other keywords), in --help order."""


def _bench_arguments(parser: argparse.ArgumentParser, target: str) -> None:
    """The options of ``moelab bench TARGET``: those of :data:`OPTIONS` for TARGET, each
    with its default (a copy: a list default is never shared between parsers)."""
    for flag, targets, default, text, kw in OPTIONS:
        if target not in targets:
            continue
        value = default.get(target) if isinstance(default, dict) else default
        shown = f" (default: {_shown(value)})"
        if value is None or isinstance(value, bool):  # None: the text says; a switch
            shown = ""
        parser.add_argument(flag, default=copy.deepcopy(value), help=f"{text}{shown}", **kw)


def _bench_options(args: argparse.Namespace) -> None:
    """Check the timing counts of the timed targets (another target's options are
    argparse's unrecognized arguments: each sub-command has only its own)."""
    if args.target in BENCH_TIMED:
        for flag, least in (("--threads", 1), ("--repeats", 1), ("--warmup", 0)):
            value = getattr(args, flag[2:])
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")


def _bench(args: argparse.Namespace) -> int:
    _bench_options(args)  # the timing counts checked
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
        return emit(args, result, gpu.format_report)
    common = dict(
        threads=args.threads, repeats=args.repeats, warmup=args.warmup, progress=not args.json
    )
    if args.target == "train":
        from moelab.bench import train as bench

        result = bench.run(
            preset=args.preset,
            batch=args.batch_size,
            seq_len=args.seq_len,
            run_steps=args.run_steps,
            compile=not args.no_compile,
            backend=args.backend,
            profile_steps=args.profile_steps,
            **{**common, "progress": True},  # minutes of work: progress on stderr, always
        )
        return emit(args, result, bench.format_report)
    if args.target == "hf":
        from moelab.bench import hf as bench

        result = bench.run(
            hf=args.hf, batch=args.batch_size, seq_len=args.seq_len, block=args.block, **common
        )
        return emit(args, result, bench.format_report)
    if args.target == "torchtitan":
        from moelab.bench import torchtitan as bench

        return emit(args, bench.run(shapes=args.shapes, **common), bench.format_table)
    if args.target == "moe":
        from moelab.bench import moe as bench

        return emit(args, bench.run(shapes=args.shapes, **common), bench.format_table)
    if args.target == "downstream":
        from moelab.bench import downstream as bench

        try:
            result = bench.run(args.run, batch_size=args.batch_size, **common)
        except ImportError as err:  # the eval extra is missing
            raise ValueError(str(err)) from err
        return emit(args, result, bench.format_table)
    if args.target == "selection":
        from moelab.bench import selection as bench

        result = bench.run(rows=args.rows, experts=args.experts, top_k=args.top_k, **common)
        return emit(args, result, bench.format_table)
    if args.compile:
        if args.march is not None:
            raise ValueError("--march builds the fused kernels, which --compile does not time")
        from moelab.bench import maps_compile

        result = maps_compile.run(rows=args.rows, experts=args.experts, **common)
        return emit(args, result, maps_compile.format_table)
    from moelab.bench import maps as bench

    result = bench.run(rows=args.rows, experts=args.experts, march=args.march, **common)
    return emit(args, result, bench.format_table)


TARGETS = {
    "maps": (
        "time every map against torch.softmax (and entmax)",
        "Time forward and forward+backward of every map on float32 scores of shape (rows, "
        "E) and report medians and ratios to torch.softmax.",
    ),
    "moe": (
        "time the MoE layer against Mixtral's block and the dense bound",
        "Time the MoE layer, the transformers Mixtral block with the same weights, the "
        "dense lower bound (same active FLOPs as plain matmuls) and the router alone, with "
        "ratios to the bound.",
    ),
    "selection": (
        "time every selection rule against softmax top-K",
        "Time every selection rule (map, selection, gate on (rows, E) scores) with ratios "
        "to softmax top-K.",
    ),
    "train": (
        "training speed: MoE vs dense, compiled vs eager, FLOP/s, where a step goes",
        "Train the preset's MoE model and the dense model of equal active parameters in "
        "turn (tokens/s, FLOP/s over a float32 matmul's rate in the same process), each "
        "block compiled against eager (steady state and a whole run, compilation "
        "included), and the share of a step in each part from torch.profiler; keys in "
        "docs/speed.md.",
    ),
    "gpu": (
        "the one-GPU check: training, maps, MoE layer, compile",
        "The one-GPU check (at most ~5 minutes, its own tokens): bf16 training of "
        "paper-300m (tokens/s, MFU, peak memory), every map on the device against CPU "
        "float64, the MoE layer (loop and grouped GEMM) against the dense bound, "
        "torch.compile against eager; JSON keys in docs/scale.md.",
    ),
    "downstream": (
        "time downstream's batched loglikelihood against a bare forward pass",
        "The batched loglikelihood of moelab downstream on a run's cloze requests against "
        "a bare forward pass over the same padded batches (docs/downstream.md).",
    ),
    "hf": (
        "what reading a Hugging Face model's routing costs (moelab stats --hf)",
        "Time a Hugging Face MoE model's forward with and without the hooks that collect "
        "its routing statistics (moelab stats --hf), alternating calls on one batch of "
        "random token ids; the default model is a tiny random Mixtral built in memory "
        "(docs/huggingface.md).",
    ),
    "torchtitan": (
        "time a moelab router inside torchtitan's MoE against the engine's own",
        "Time forward and forward+backward of torchtitan's MoE module with its own softmax "
        "router, with the moelab Router that reproduces it and with 1.5-entmax "
        "(moelab.integrations.torchtitan.swap_routers), taking turns, with ratios to the "
        "engine's router and the CPU they ran on (docs/engines.md).",
    ),
}
"""The sub-commands of moelab bench: target -> (its line in bench --help, its
description)."""


def register(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="time the maps (vs torch.softmax, entmax), the MoE layer (vs Mixtral, dense) or "
        "the selection rules (vs top-K)",
        description="maps: time forward and forward+backward of every map on float32 "
        "scores of shape "
        "(rows, E) and report medians and ratios to torch.softmax. moe: time the MoE "
        "layer, the transformers Mixtral block with the same weights, the dense lower "
        "bound (same active FLOPs as plain matmuls) and the router alone, with ratios to "
        "the bound. selection: time every selection rule (map, selection, gate on (rows, "
        "E) scores) with ratios to softmax top-K. train: the preset's MoE model against "
        "the dense model of equal active parameters, compiled against eager, FLOP/s over "
        "the matmul rate and the share of a step in each part (docs/speed.md). gpu: the "
        "one-GPU check (at most ~5 minutes, its own tokens): bf16 training of paper-300m "
        "(tokens/s, MFU, peak memory), every map on the device against CPU float64, the "
        "MoE layer (loop and grouped GEMM) against the dense bound, torch.compile against "
        "eager; JSON keys in docs/scale.md. downstream: the batched loglikelihood of "
        "moelab downstream on a run's cloze requests against a bare forward pass over the "
        "same padded batches (docs/downstream.md). hf: a Hugging Face MoE model's forward "
        "with and without the hooks of moelab stats --hf. torchtitan: torchtitan's MoE "
        "module with its own router against moelab's (softmax, 1.5-entmax). Each target is "
        "a sub-command with its own options (moelab bench TARGET --help).",
        formatter_class=HelpFormatter,
    )
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    for target, (line, description) in TARGETS.items():
        parser = targets.add_parser(
            target, help=line, description=description, formatter_class=HelpFormatter
        )
        _bench_arguments(parser, target)
        add_json(parser)
        add_debug(parser)
        parser.set_defaults(func=_bench)
