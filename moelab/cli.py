"""The ``moelab`` command line. Parses arguments and calls the library; the
library itself never reads argv.

Errors: a mistake the user can fix (a bad value or ``--set``, a missing or incomplete
run folder, a corrupted checkpoint, an unknown preset: the exceptions in
:data:`USER_ERRORS`) prints one line ``moelab <command>: error: <message>`` on stderr
and exits with code 2; with ``--json``, stdout also holds ``{"error": "<message>"}``.
Any other exception is a bug and keeps its traceback; ``moelab --debug <command> ...``
(or ``--debug`` after the command) shows the traceback of user errors too.

JSON: every command prints one strict JSON document with ``--json`` (:func:`to_json`:
NaN and infinities become null).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from moelab import __version__
from moelab._strict_json import strict_dumps
from moelab.bench.moe import SHAPES as MOE_SHAPES
from moelab.model.presets import available_presets
from moelab.train.checkpoint import CheckpointError

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, CheckpointError)
"""Exceptions that mean a mistake the user can fix: ValueError (bad values, ``--set``
keys and types, unknown presets and maps, corrupt JSON), OSError (FileNotFoundError,
NotADirectoryError, FileExistsError, PermissionError: missing runs, corpora, files) and
the checkpoint module's CheckpointError (a truncated or altered checkpoint). The
library raises ValueError, not KeyError, for bad keys, so a KeyError stays a bug."""

THREADED = ("train", "eval", "stats", "report", "demo", "study", "downstream")
"""Commands with ``--threads``: train passes it to TrainConfig.threads, the others set
torch's thread count with moelab.train.threads.use_threads before they start."""

DEFAULT_MAX_BATCHES = 64
"""Validation batches that eval, stats and report evaluate unless --max-batches says
otherwise (``--max-batches all``: every batch)."""


def to_json(obj: Any) -> str:
    """One strict JSON document (RFC 8259): non-finite floats become null, so no
    ``NaN`` or ``-Infinity`` (which Python's json would print and strict parsers
    refuse) ever reaches stdout."""
    return strict_dumps(obj)


class _ArgumentError(SystemExit):
    """argparse's usage error (exit code 2), with its message kept for --json."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(2)
        self.prog, self.message = prog, message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise _ArgumentError(self.prog, message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every command's --help: an option's default appended as ``(default: ...)``
    unless its help already names it, or the default is None (whose meaning the help
    says in words: "(default: the Python docs)", "(None: the trained K)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _max_batches(text: str) -> int | None:
    """``--max-batches``: a positive int, or ``all`` (None: every batch)."""
    if text.strip().lower() == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"give a number of batches >= 1 or 'all', got {text!r}")
    return n


def _batches(text: str) -> int:
    """A number of batches >= 1."""
    n = _max_batches(text)
    if n is None:
        raise argparse.ArgumentTypeError("give a number of batches >= 1")
    return n


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


def _emit(args: argparse.Namespace, result: dict, as_text: Callable[[dict], str]) -> int:
    """Print one JSON document with --json, else the human-readable form."""
    print(to_json(result) if args.json else as_text(result))
    return 0


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


def _demo(args: argparse.Namespace) -> int:
    """``moelab demo``: the sparse-maps study at the cpu scale (``--quick``: the quick
    scale; ``--dense``: with the dense references), one seed; ``--maps``: the tour of the
    maps. JSON keys: ``report`` (OUT/report.md), ``files`` (its figures), ``runs`` (the
    run folders), ``rows`` (per arm: the main table and routing statistics, means over
    the seeds), ``tables`` (every table of the study), ``results`` (OUT/results.json) and
    ``seconds``."""
    if args.maps:
        from moelab.studies import tour

        return _emit(args, tour.run(rows=args.rows), tour.format_report)
    from pathlib import Path

    from moelab import studies
    from moelab.studies.sparse_maps import headline_rows
    from moelab.train import TrainingInterrupted

    try:
        doc = studies.run_study(
            "sparse-maps",
            args.out,
            scale="quick" if args.quick else "cpu",
            threads=args.threads,
            options={"dense": True} if args.dense else {},
            progress=not args.json,
            overwrite=args.overwrite,
        )
    except TrainingInterrupted as stop:  # the arm's checkpoint was written
        return _study_interrupted(args, stop)
    result = {
        "report": doc["report"],
        "files": [str(Path(args.out) / f) for f in doc["figures"]],
        "runs": [run for arm in doc["arms"] for run in arm["runs"]],
        "rows": headline_rows(doc),
        "tables": doc["tables"],
        "results": str(Path(args.out) / "results.json"),
        "seconds": doc["seconds"],
    }

    def as_text(r: dict) -> str:
        lines = []
        for table in r["tables"]:
            if table["key"] in ("main", "routing"):
                lines += [table["title"], studies.StudyTable.from_json(table).markdown(), ""]
        lines.append(f"report: {r['report']} ({r['seconds'] / 60:.1f} min)")
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _study_interrupted(args: argparse.Namespace, stop: Any) -> int:
    """A study (or the demo) stopped by SIGINT/SIGTERM: the arm's checkpoint is written
    (or, with the signal twice, the arm stopped at once at its newest checkpoint)."""
    from moelab.train import TrainingAborted

    if isinstance(stop, TrainingAborted):
        kept = (
            f"its newest checkpoint is step {int(stop.checkpoint.name[5:])}"
            if (stop.checkpoint is not None)
            else "it has no checkpoint yet"
        )
        what = f"{stop.signal} twice: arm stopped at once after step {stop.step} ({kept})"
    else:
        what = f"{stop.signal}: arm interrupted at step {stop.step} with a checkpoint"
    print(
        f"moelab {args.command}: {what}; run the same command again to resume (finished "
        "arms are reused)",
        file=sys.stderr,
    )
    if args.json:
        print(to_json({"interrupted": stop.signal, "step": stop.step}))
    return stop.exit_code


def _study(args: argparse.Namespace) -> int:
    from moelab.studies import run_study
    from moelab.train import TrainingInterrupted

    if args.run and args.scale != "paper":
        raise ValueError("--run applies to --scale paper only (the other scales always train)")
    try:
        result = run_study(
            args.name,
            args.out or f"studies/{args.name}-{args.scale}",
            scale=args.scale,
            seeds=args.seeds,
            data=args.data,
            eval_data=args.eval_data,
            threads=args.threads,
            run=args.run,
            max_batches=args.max_batches,
            options={"dense": args.dense} if args.dense else {},
            progress=not args.json,
            overwrite=args.overwrite,
        )
    except TrainingInterrupted as stop:  # the arm's checkpoint was written
        return _study_interrupted(args, stop)

    def as_text(r: dict) -> str:
        if r.get("scale") == "paper" and not r.get("trained", True):
            lines = [f"wrote the paper-scale configs and commands: {r['report']}"]
            return "\n".join([*lines, *r["commands"]])
        lines = []
        for table in r["tables"][:1]:
            from moelab.studies import StudyTable

            lines += [table["title"], StudyTable.from_json(table).markdown(), ""]
        lines.append(f"report: {r['report']} ({r['seconds'] / 60:.1f} min)")
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _check_runs(runs: Sequence[str]) -> dict[str, Any]:
    """Every run folder exists and holds config.json, tokenizer.json and a checkpoint;
    else one ValueError that names each bad one (before anything is computed). Files
    (saved stats/eval results) are left to build_report, which reads them first.
    Returns the TrainConfig of each run folder."""
    from moelab.diagnostics.evaluate import check_run

    problems, configs = [], {}
    for run in runs:
        if os.path.isfile(run):  # a saved stats/eval result: build_report reads it
            continue
        try:
            configs[run] = check_run(run)
        except (OSError, ValueError) as err:
            problems.append(str(err))
    if problems:
        raise ValueError(
            f"{len(problems)} of the {len(runs)} runs cannot be reported, nothing was "
            f"computed: {'; '.join(problems)}"
        )
    return configs


_STUDY_OVERWRITE = (
    "write into OUT even when another moelab command made it (another study's or a "
    "report's folder); never into a run folder, a corpus or a folder holding files "
    "moelab did not write"
)


REPORT_TOP_KS = [1, 2, 4, 8]
"""The K values report sweeps without --top-k (those within each run's experts)."""


def _report_top_ks(top_ks: list[int] | None, configs: dict[str, Any]) -> list[int]:
    """report's --top-k: None sweeps :data:`REPORT_TOP_KS`; given values are checked as
    eval checks them, each in [1, E] for the run folders whose routers sweep K (E: the
    largest count among them; a run with fewer experts leaves out the K above its own)."""
    if top_ks is None:
        return list(REPORT_TOP_KS)
    experts = {}
    for run, config in configs.items():
        mc = config.model_config()
        if mc.moe_indices and mc.router_config().selection_rule.sweep == "top_k":
            experts[run] = mc.n_experts
    most = max(experts.values(), default=None)
    bad = [k for k in top_ks if k < 1 or (most is not None and k > most)]
    if not bad:
        return top_ks
    if most is None:
        raise ValueError(f"--top-k values {bad} are below 1; give K >= 1")
    if len(experts) == 1:
        who = f"{next(iter(experts))} has {most}"
    elif len(set(experts.values())) == 1:
        who = f"the runs have {most}"
    else:
        who = f"the runs have at most {most}"
    raise ValueError(
        f"--top-k values {bad} are outside [1, {most}]: {who} experts per MoE layer; give "
        f"K from 1 to {most}"
    )


def _report(args: argparse.Namespace) -> int:
    from moelab.report import build_report

    top_ks = _report_top_ks(args.top_k, _check_runs(args.runs))
    result = build_report(
        args.runs,
        args.out,
        top_ks,
        max_batches=args.max_batches,
        step=args.step,
        overwrite=args.overwrite,
    )
    doc = {k: result[k] for k in ("report", "files", "latex", "tables")}
    cover = (
        "every validation batch of each run"
        if args.max_batches is None
        else f"at most {args.max_batches} validation batches per run "
        "(--max-batches all for every batch)"
    )
    print(to_json(doc) if args.json else f"{result['report']}\nevaluated on {cover}")
    return 0


def _data(args: argparse.Namespace) -> int:
    from moelab.data.prepare import prepare

    try:
        result = prepare(
            args.src,
            args.out,
            tokenizer=args.tokenizer,
            workers=args.workers,
            fmt=args.format,
            field=args.field,
            split=args.split,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            seed=args.seed,
            sample_chars=args.sample_chars,
            overwrite=args.overwrite,
            progress=not args.json,
        )
    except ImportError as e:  # an optional package (pyarrow) to install: the user's to fix
        raise ValueError(str(e)) from e
    except KeyboardInterrupt:  # the temporaries are gone; nothing half-written is left
        print(f"moelab data: interrupted; {args.out} holds no prepared data", file=sys.stderr)
        if args.json:
            print(to_json({"interrupted": "SIGINT", "out": str(args.out)}))
        return 130
    result["out"] = str(args.out)

    def as_text(r: dict) -> str:
        docs, toks = r["n_documents"], r["n_tokens"]
        return "\n".join(
            [
                f"prepared         {r['out']} (train with: moelab train --data {r['out']} ...)",
                f"source           {r['source']} ({r['source_format']})",
                f"tokenizer        {r['tokenizer']} ({r['vocab_size']} tokens)",
                f"train            {docs['train']:,} documents, {toks['train']:,} tokens",
                f"val              {docs['val']:,} documents, {toks['val']:,} tokens",
            ]
        )

    return _emit(args, result, as_text)


def _human(n: int) -> str:
    """297.0M, 1.01B, 33.3K: three significant figures or so."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


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

    def as_text(r: dict) -> str:
        keys = ("total", "active", "active_at_cap", "router")
        lines = [f"preset  {r['preset']}"] + [
            f"{k.replace('active_at_cap', 'at cap'):<7} {_human(r[k]):>8}  ({r[k]:,})"
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
    return _emit(args, result, as_text)


def _train(args: argparse.Namespace) -> int:
    from moelab.train import TrainingInterrupted, apply_overrides, train
    from moelab.train.progress import format_duration
    from moelab.train.records import refuse_prepared_overrides

    base = {
        "preset": args.preset,
        "map": args.map,
        "alpha": args.alpha,
        "top_k": args.top_k,
        "steps": args.steps,
        "out": args.out,
        "data": args.data,
        "progress": not args.json,
        "threads": args.threads,
        "parallel": args.parallel,
        "ep": args.ep,
        "compile": args.compile,
        "checkpoint_activations": args.checkpoint_activations,
    }
    # validated once the --set overrides are in (e.g. --map lapsum needs router.lapsum_k);
    # a bad key or value fails here, before the corpus is read or the run folder made
    config = apply_overrides(base, args.set)
    refuse_prepared_overrides(config, args.set)  # prepared data fix vocab_size, val_fraction
    resume = args.resume or args.resume_from is not None
    if not resume:
        from moelab.data import is_prepared, iter_documents

        if not is_prepared(config.data):  # a `moelab data prepare` folder is read as it is
            iter_documents(config.data)  # a missing corpus fails before the run folder exists
    try:
        result = train(
            config, resume=resume, overwrite=args.overwrite, resume_from=args.resume_from
        )
    except TrainingInterrupted as stop:  # a checkpoint was written (or, with the signal
        # twice, the newest one is kept: TrainingAborted); exit 130 / 143
        print(f"moelab train: {stop}", file=sys.stderr)
        if args.json:
            doc = {"interrupted": stop.signal, "step": stop.step, "resume": stop.command}
            ckpt = str(stop.checkpoint) if stop.checkpoint is not None else None
            print(to_json({**doc, "checkpoint": ckpt}))
        return stop.exit_code
    # what the val loss covers: train() says so (val_batches, val_tokens); a finished
    # run's summary.json written by an older moelab lacks them
    result.setdefault("val_batches", config.eval_batches)
    result.setdefault("val_tokens", config.eval_batches * config.batch_size * config.seq_len)

    def as_text(r: dict) -> str:
        return "\n".join(
            [
                f"run              {r['run']}",
                f"steps            {r['steps']} ({r['tokens']:,} tokens)",
                f"train loss       {_fmt(r['train_loss'])}",
                f"val loss         {_fmt(r['val_loss'])} (first {r['val_batches']} batches of "
                f"the validation split, {r['val_tokens']:,} tokens; --set eval_batches=N)",
                f"unigram entropy  {r['unigram_entropy']:.4f} nats",
                f"tokens/s         {r['tokens_per_s']:,.0f} (the last logging window)"
                + (
                    f", {avg:,.0f} on average (warm-up and compilation included)"
                    if isinstance(avg := r.get("tokens_per_s_avg"), float)
                    else ""
                ),
            ]
            + (
                [f"wall time        {format_duration(wall)} ({wall:,.1f} s)"]
                if isinstance(wall := r.get("wall_s"), float)
                else []
            )
            + [
                f"active experts   {r.get('active_experts', float('nan')):.3f}",
            ]
            + (
                [f"learned k_l      {', '.join(f'{k:.3f}' for k in r['k_layers'])}"]
                if "k_layers" in r
                else []
            )
            + (
                [
                    f"calibrated cut   {', '.join(f'{t:.4f}' for t in cal['truncation_layers'])}"
                    f" (per MoE layer; router.truncation = {cal['requested_truncation']:g} "
                    f"replaced, on {cal['batches']} batches)"
                ]
                if (cal := r.get("calibrated"))
                else []
            )
            + (
                [
                    f"dead experts     {r['dead_experts']} (per MoE layer: "
                    f"{', '.join(str(n) for n in r['dead_layers'])}; no token in the final "
                    "evaluation)"
                ]
                if r.get("dead_experts")
                else []
            )
        )

    return _emit(args, result, as_text)


def _fmt(v: object, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _coverage(tokens: int, batches: int, total: int) -> str:
    """What an evaluation covered: "65,536 tokens (64 of 312 batches; ...)"."""
    if batches >= total:
        return f"{tokens:,} tokens (all {total} batches)"
    return f"{tokens:,} tokens ({batches} of {total} batches; --max-batches all for every batch)"


def _eval_truncation(args: argparse.Namespace) -> int:
    from moelab.diagnostics import evaluate_truncation, load_run

    result = evaluate_truncation(
        load_run(args.run, args.step),
        args.threshold_scale,
        data=args.data,
        max_batches=args.max_batches,
    )

    def table(rows: list[dict], title: str) -> list[str]:
        base = {r["threshold_scale"]: r["nll"] for r in rows}.get(1.0)
        lines = [
            title,
            f"{'scale':>5}  {'NLL':>8}  {'retained':>8}  {'active':>7}  {'dNLL':>9}",
        ]
        for r in rows:
            d = None if base is None else r["nll"] - base
            mark = " *" if r["threshold_scale"] == 1.0 else ""
            lines.append(
                f"{r['threshold_scale']:>5g}  {r['nll']:>8.4f}  {_fmt(r['retained_mass']):>8}  "
                f"{_fmt(r['active_experts'], '.3f'):>7}  {_fmt(d, '+.5f'):>9}{mark}"
            )
        return lines

    def as_text(r: dict) -> str:
        thresholds = ", ".join(f"{t:.4g}" for t in r["thresholds"])
        lines = [
            f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}  "
            f"E={r['n_experts']}  trained thresholds {thresholds} (scale 1, *)"
        ]
        first = r["results"][0]
        cover = _coverage(first["tokens"], first["batches"], r["batches_total"])
        lines += table(r["results"], f"validation split, {cover}:")
        if "results_data" in r:
            first = r["results_data"][0]
            cover = _coverage(first["tokens"], first["batches"], r["batches_total_data"])
            lines += table(r["results_data"], f"corpus {r['data']}, {cover}:")
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _eval(args: argparse.Namespace) -> int:
    from moelab.diagnostics import evaluate, load_run

    if _run_or_hf(args):
        return _eval_hf(args)
    if args.threshold_scale is not None:
        return _eval_truncation(args)
    loaded = load_run(args.run, args.step)
    result = evaluate(loaded, args.top_k, data=args.data, max_batches=args.max_batches)

    def table(rows: list[dict], trained: int, title: str) -> list[str]:
        base = {r["top_k"]: r["nll"] for r in rows}.get(trained)
        lines = [title, f"{'K':>3}  {'NLL':>8}  {'retained':>8}  {'contrib':>7}  {'dNLL':>9}"]
        for r in rows:
            d = None if base is None else r["nll"] - base
            mark = " *" if r["top_k"] == trained else ""
            lines.append(
                f"{r['top_k']:>3}  {r['nll']:>8.4f}  {_fmt(r['retained_mass']):>8}  "
                f"{_fmt(r['contributors'], '.3f'):>7}  {_fmt(d, '+.5f'):>9}{mark}"
            )
        return lines

    def as_text(r: dict) -> str:
        k = r["trained_top_k"]
        lines = [
            f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}  "
            f"E={r['n_experts']}  trained K={k} (*)"
        ]
        first = r["results"][0]
        cover = _coverage(first["tokens"], first["batches"], r["batches_total"])
        lines += table(r["results"], k, f"validation split, {cover}:")
        lines.append(
            f"NLL increase from K={k} to K={max(x['top_k'] for x in r['results'])}: "
            f"{_fmt(r['nll_increase'], '+.5f')}"
        )
        if "results_data" in r:
            first = r["results_data"][0]
            cover = _coverage(first["tokens"], first["batches"], r["batches_total_data"])
            lines += table(r["results_data"], k, f"corpus {r['data']}, {cover}:")
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _stats(args: argparse.Namespace) -> int:
    from moelab import maps
    from moelab.diagnostics import CERT_FIELDS, FIELDS, load_run, stats

    if _run_or_hf(args):
        return _stats_hf(args)
    result = stats(load_run(args.run, args.step), data=args.data, max_batches=args.max_batches)
    cols = (
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

    def as_text(r: dict) -> str:
        alpha = "" if r["alpha"] is None else f" alpha={r['alpha']}"
        split = f"corpus {r['data']}" if "data" in r else "validation split"
        lines = [
            f"run {r['run']}  checkpoint step {r['checkpoint_step']}  map {r['map']}{alpha}  "
            + ("truncating" if r["truncating"] else f"K={r['top_k']}"),
            f"{split}: nll {r['nll']:.4f} over "
            + _coverage(r["tokens"], r["batches"], r["batches_total"]),
            "active params per token (measured: non-expert + active experts x expert): "
            + (
                "-"
                if r["active_params"] is None
                else f"{_human(round(r['active_params']))} ({r['active_params']:,.0f})"
            ),
            "mean over MoE layers:",
        ]
        lines += [f"  {f:<28} {_fmt(r['mean'][f])}" for f in FIELDS]
        lines.append(f"temperature and certified top-1 radii (schedule {r['schedule']}):")
        lines += [f"  {f:<28} {_fmt(r['mean'][f])}" for f in CERT_FIELDS]
        if maps.info(r["map"]).needs_k:
            learned = "learned" if r["learned_allocation"] else "fixed"
            lines.append(f"LapSum ({learned} k per layer):")
            for lay in r["layers"]:
                lines.append(
                    f"  layer {lay['layer']}: k_l {_fmt(lay['lapsum_k'])}  cut "
                    f"{_fmt(lay['truncation'])}  active experts {_fmt(lay['active_experts'])}"
                )
        lines.append("per layer:")
        lines.append(f"{'layer':>5} {'block':>5} " + " ".join(f"{c[:10]:>10}" for c in cols))
        for lay in r["layers"]:
            lines.append(
                f"{lay['layer']:>5} {lay['block']:>5} "
                + " ".join(f"{_fmt(lay[c]):>10}" for c in cols)
            )
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _run_or_hf(args: argparse.Namespace) -> bool:
    """True for a Hugging Face model (--hf DIR), False for a moelab RUN; ValueError
    unless exactly one is given (and --data with --hf)."""
    if args.hf is None:
        if args.run is None:
            raise ValueError("give a run folder RUN, or --hf DIR for a Hugging Face model")
        for flag in ("max_tokens", "map", "alpha", "router", "trust_remote_code"):
            if getattr(args, flag, None):
                raise ValueError(
                    f"--{flag.replace('_', '-')} applies to --hf models only; drop it for RUN"
                )
        return False
    if args.run is not None:
        raise ValueError(f"give either RUN ({args.run}) or --hf {args.hf}, not both")
    if getattr(args, "step", None) is not None:
        raise ValueError("--step picks a checkpoint of a moelab RUN; drop it for --hf")
    if args.data is None:
        raise ValueError("--hf needs --data TEXT_OR_DIR (a text file or a folder of .txt files)")
    if getattr(args, "threshold_scale", None) is not None:
        raise ValueError("--threshold-scale applies to moelab runs; use --top-k with --hf")
    return True


def _hf_call(fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
    """Call the Hugging Face integration; a missing transformers is a user error."""
    try:
        return fn(*args, **kwargs)
    except ImportError as err:
        if "transformers" not in str(err):
            raise
        raise ValueError(str(err)) from err


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


def _hf_head(r: dict) -> str:
    return f"model {r['run']}  ({r['model_type']}, family {r['family']})  E={r['n_experts']}"


def _eval_hf(args: argparse.Namespace) -> int:
    from moelab.integrations.hf.sweep import hf_eval

    result = _hf_call(
        hf_eval,
        args.hf,
        args.data,
        args.top_k,
        router_keys=_hf_router_keys(args),
        max_tokens=args.max_tokens,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    )

    def as_text(r: dict) -> str:
        k = r["trained_top_k"]
        base = {x["top_k"]: x["nll"] for x in r["results"]}.get(k)
        keys = " ".join(f"{a}={b}" for a, b in r["router_keys"].items())
        lines = [
            f"{_hf_head(r)}  own K={k} (*)" + (f"  swapped routers: {keys}" if keys else ""),
            f"text {r['data']}, {r['results'][0]['tokens']:,} target tokens:",
            f"{'K':>3}  {'NLL':>8}  {'retained':>8}  {'contrib':>7}  {'dNLL':>9}",
        ]
        for x in r["results"]:
            d = None if base is None else x["nll"] - base
            mark = " *" if x["top_k"] == k else ""
            lines.append(
                f"{x['top_k']:>3}  {x['nll']:>8.4f}  {_fmt(x['retained_mass']):>8}  "
                f"{_fmt(x['contributors'], '.3f'):>7}  {_fmt(d, '+.5f'):>9}{mark}"
            )
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _stats_hf(args: argparse.Namespace) -> int:
    from moelab.diagnostics import FIELDS
    from moelab.integrations.hf.stats import hf_stats

    result = _hf_call(
        hf_stats,
        args.hf,
        args.data,
        max_tokens=args.max_tokens,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    )
    cols = ("discarded_mass", "contributors", "score_rms", "gap_p50", "contrib_cv", "load_cv")

    def as_text(r: dict) -> str:
        lines = [
            f"{_hf_head(r)}  K={r['top_k']}  statistics map {r['map']} (over all E)",
            f"text {r['data']}: nll {r['nll']:.4f} over {r['tokens']:,} tokens",
            "mean over MoE layers:",
        ]
        lines += [f"  {f:<28} {_fmt(r['mean'][f])}" for f in FIELDS]
        lines.append("per layer:")
        lines.append(f"{'layer':>5} " + " ".join(f"{c[:10]:>10}" for c in cols) + "  router")
        for lay in r["layers"]:
            lines.append(
                f"{lay['layer']:>5} "
                + " ".join(f"{_fmt(lay[c]):>10}" for c in cols)
                + f"  {lay['name']}"
                + ("  (routed by token id)" if lay.get("routed_by") == "token_id" else "")
            )
        return "\n".join(lines)

    return _emit(args, result, as_text)


def _check_device(device: str) -> None:
    """``--device``: a torch device string, and a CUDA device that torch sees (else a
    ValueError saying what to give instead)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device} is not a torch device; give cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}, but torch.cuda.is_available() is False (no CUDA GPU, or a "
            "torch built without CUDA); use --device cpu"
        )
    count = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and dev.index is not None and dev.index >= count:
        raise ValueError(
            f"--device {device}, but torch sees {count} CUDA GPU(s); give cuda:0 .. "
            f"cuda:{count - 1}"
        )


def _downstream(args: argparse.Namespace) -> int:
    _check_device(args.device)  # before any run is loaded
    from moelab.integrations.lm_eval import run_downstream
    from moelab.integrations.lm_eval.run import format_downstream

    try:
        result = run_downstream(
            args.runs, args.tasks, include_path=args.include_path, top_ks=args.top_k,
            limit=args.limit, batch_size=args.batch_size, device=args.device, hf=args.hf,
            network=args.network, progress=not args.json, num_fewshot=args.num_fewshot,
            step=args.step, trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    except ImportError as err:  # the eval extra is missing: the user's to install
        raise ValueError(str(err)) from err
    except KeyboardInterrupt:  # every finished (run, K) is already in RUN/downstream.json
        print("moelab downstream: interrupted; finished results are saved", file=sys.stderr)
        if args.json:
            print(to_json({"interrupted": "SIGINT"}))
        return 130
    return _emit(args, result, format_downstream)


TRUST_REMOTE_CODE_HELP = (
    "{prefix}let a Hugging Face folder run the Python it names (an auto_map in config.json "
    "or tokenizer_config.json){what}. This runs arbitrary code from the folder with your "
    "permissions: give it only for a folder you trust. Without it such a folder is "
    "refused, nothing is asked on stdin, and only safetensors weights, tokenizer.json and "
    "JSON configs are read (docs/huggingface.md)"
)


def _trust_argument(p: argparse.ArgumentParser, prefix: str = "", what: str = "") -> None:
    """--trust-remote-code on a command that loads a Hugging Face folder."""
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=TRUST_REMOTE_CODE_HELP.format(prefix=prefix, what=what),
    )


def _hf_arguments(p: argparse.ArgumentParser, swap: bool) -> None:
    """--hf DIR and its options on the stats / eval parser."""
    p.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="a local Hugging Face MoE model folder (save_pretrained layout: model and "
        "tokenizer) instead of RUN; with --data TEXT_OR_DIR; nothing is downloaded",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="--hf: feed at most N tokens of --data (default: all of it)",
    )
    _trust_argument(p, prefix="--hf: ")
    if swap:
        p.add_argument(
            "--map", default=None, help="--hf: swap the routers for moelab ones with this map"
        )
        p.add_argument("--alpha", type=float, default=None, help="--hf: the swapped map's alpha")
        p.add_argument(
            "--router",
            action="append",
            metavar="KEY=VALUE",
            help="--hf: another router key of the swapped routers (repeatable)",
        )


def _train_defaults() -> str:
    import dataclasses

    from moelab.train import TrainConfig

    shown = ("preset", "map", "alpha", "top_k", "steps", "out", "data", "progress", "model")
    shown += ("parallel", "ep", "compile", "checkpoint_activations")
    return ", ".join(
        f"{f.name}={f.default!r}"
        for f in dataclasses.fields(TrainConfig)
        if f.name not in shown and f.default is not dataclasses.MISSING
    )


def _step_argument(parser: argparse.ArgumentParser, what: str = "RUN") -> None:
    parser.add_argument(
        "--step",
        type=_positive_step,
        default=None,
        metavar="N",
        help=f"use the checkpoint of step N of {what} instead of the newest (e.g. an intact "
        "older one when the newest is damaged)",
    )


def _positive_step(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"give a checkpoint step >= 0, got {text!r}")
    return n


def _max_batches_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-batches",
        type=_max_batches,
        default=DEFAULT_MAX_BATCHES,
        metavar="N|all",
        help="evaluate the first N validation batches in file order ('all': every batch)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moelab",
        description="Mixture-of-experts routing: probability maps, benchmarks and demos.",
        epilog="A mistake the user can fix (a bad value, a missing run, a corrupted "
        "checkpoint) prints 'moelab COMMAND: error: ...' and exits with code 2 (with --json, "
        'stdout holds {"error": ...}); a traceback means a bug.',
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moelab {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of every error, user errors too (also after the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

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
    bench.add_argument("--json", action="store_true", help="print one JSON document")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser(
        "demo",
        help="the embedded default: the sparse-maps study (four maps trained, swept over K)",
        description="The sparse-maps study at the cpu scale, one seed (moelab study "
        "sparse-maps --scale cpu --out OUT): train the tiny preset with softmax, entmax 1.5, "
        "sparsemax and normmax 2 (top-2, 1000 steps of 8 x 128 tokens, same seed and data) "
        "on the default corpus, measure their routing, evaluate each with K in 1 2 4 8 and "
        "write OUT/report.md with its tables and figures (about 15 minutes on 2 CPU "
        "cores; --quick: a shrunken model, about 20 seconds). Runs that exist in OUT are "
        "reused. OUT must be new, empty or the demo's own folder (--overwrite: also another "
        "study's or a report's folder). --maps shows the tour of the maps instead.",
        formatter_class=_HelpFormatter,
    )
    demo.add_argument(
        "--quick", action="store_true", help="the study's quick scale, for a first look"
    )
    demo.add_argument(
        "--dense",
        action="store_true",
        help="also train the dense reference (larger active budget; one more run of as many steps)",
    )
    demo.add_argument("--out", default="demo", help="output folder (runs/, report.md)")
    demo.add_argument("--overwrite", action="store_true", help=_STUDY_OVERWRITE)
    demo.add_argument(
        "--maps",
        action="store_true",
        help="instead: a tour of the maps (weights, supports, the threshold law)",
    )
    demo.add_argument(
        "--rows", type=int, default=100_000, help="with --maps: random rows for the law check"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON document")
    demo.set_defaults(func=_demo)

    rep = sub.add_parser(
        "report",
        help="Markdown + PNG comparison of trained runs (and saved HF results)",
        description="Training and validation loss curves, routing statistics, the K budget "
        "sweep, top-2 gap histograms, routing curves and expert loads of each RUN, written "
        "to DIR/report.md, PNG figures and DIR/tables.tex. A RUN may also be a JSON file "
        "saved from `moelab stats --hf M --json` or `moelab eval --hf M --json`: it joins "
        "the routing, per-layer, gap and load tables (stats) or the budget sweep (eval), "
        "labelled by M's folder name (a stats and an eval file of one model make one "
        "entry); sections that need training curves or a checkpoint leave it out. DIR "
        "must be new, empty or the folder of an earlier report, which is refreshed (the "
        "new files replace the old ones only once all are written); --overwrite also "
        "writes into a study's or a run's folder. A folder holding files moelab did not "
        "write is always refused.",
        formatter_class=_HelpFormatter,
    )
    rep.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run folders, or JSON files of `moelab stats/eval --hf ... --json`",
    )
    rep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    rep.add_argument(
        "--overwrite",
        action="store_true",
        help="write the report into DIR even when another moelab command made it (a study's "
        "or a run's folder); never into a folder holding files moelab did not write",
    )
    rep.add_argument(
        "--top-k",
        type=int,
        nargs="+",
        default=None,
        help="values of K to sweep on each run folder, each from 1 to its experts (default: "
        f"{' '.join(map(str, REPORT_TOP_KS))}, those within each run's experts; a saved eval "
        "result shows its own)",
    )
    _step_argument(rep, "every RUN folder")
    _max_batches_argument(rep)
    rep.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: the paths and every table's rows as numbers",
    )
    rep.set_defaults(func=_report)

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
        formatter_class=_HelpFormatter,
    )
    params.add_argument(
        "--preset", required=True, choices=available_presets(), help="the model preset"
    )
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
    params.add_argument("--json", action="store_true", help="print one JSON document")
    params.set_defaults(func=_params)

    tr = sub.add_parser(
        "train",
        help="train an MoE language model and write a run folder",
        description="Train a preset model with the given router on a corpus (the Python "
        "documentation by default): the run folder gets the tokenizer, token shards, "
        "metrics.jsonl, checkpoints and summary.json. Any TrainConfig or model field can be "
        "set with --set key=value (e.g. --set lr=1e-3 --set router.renorm=true "
        "--set n_layers=2). LapSum with learned allocation across layers: --map lapsum "
        "--set model.k_total=4 --set router.selection=threshold (thresholds calibrated on "
        "the first batches).",
        epilog="other settings and their defaults (change with --set): " + _train_defaults(),
        formatter_class=_HelpFormatter,
    )
    tr.add_argument("--preset", default="tiny", choices=available_presets(), help="model preset")
    tr.add_argument("--map", default=None, help="router map (None: the preset's)")
    tr.add_argument("--alpha", type=float, default=None, help="alpha of entmax / normmax")
    tr.add_argument("--top-k", type=int, default=None, help="experts per token (None: preset's)")
    tr.add_argument("--steps", type=int, default=200, help="optimiser steps")
    tr.add_argument("--out", required=True, help="run folder")
    tr.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (dotted keys: lr, n_layers, router.map, ...); the value "
        "is read as the field's type: bools true/false, yes/no, on/off, 1/0; none/null where "
        "a field may be None; lists as [a, b] or a,b",
    )
    tr.add_argument(
        "--data",
        default=None,
        help="corpus folder or file, or a folder of `moelab data prepare` (its tokenizer and "
        "shards are used as they are) (None: the Python docs)",
    )
    tr.add_argument(
        "--parallel",
        default=None,
        choices=("ddp", "fsdp"),
        help="under torchrun: ddp (every rank holds the model) or fsdp (FSDP2, parameters, "
        "gradients and optimizer state sharded per block); one process runs the bare model "
        "(None: ddp, or fsdp with --ep N > 1)",
    )
    tr.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert parallelism: split each MoE layer's experts over groups of N ranks "
        "(with FSDP, which it takes without --parallel; N divides the ranks and n_experts)",
    )
    tr.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    tr.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block's activations in the backward pass (less memory)",
    )
    mode = tr.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="continue from the run's newest checkpoint"
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing run folder first (only a moelab run folder: one holding "
        "files moelab did not write is refused)",
    )
    tr.add_argument(
        "--resume-from",
        type=int,
        default=None,
        metavar="STEP",
        help="resume from the checkpoint of STEP instead of the newest (e.g. to skip a "
        "damaged one; --resume already falls back to the newest intact one)",
    )
    tr.add_argument("--json", action="store_true", help="print one JSON document")
    tr.set_defaults(func=_train)

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
        formatter_class=_HelpFormatter,
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
    ev.add_argument("--data", default=None, help="also evaluate this corpus folder")
    _step_argument(ev)
    _max_batches_argument(ev)
    _hf_arguments(ev, swap=True)
    ev.add_argument("--json", action="store_true", help="print one JSON document")
    ev.set_defaults(func=_eval)

    from moelab.data import prepare as dp  # the module moelab.data.prepare

    data = sub.add_parser(
        "data",
        help="prepare a large corpus: token shards that train --data reads",
        description="prepare: tokenise the corpus SRC as a stream, in --workers processes, "
        "into DIR (tokenizer.json, train/val token shards, prepare.json), which "
        "`moelab train --data DIR` trains on as it is. The output is the same for any "
        "--workers; memory does not grow with the corpus. See moelab.data.prepare.",
        formatter_class=_HelpFormatter,
    )
    data_sub = data.add_subparsers(dest="action", required=True)
    prep = data_sub.add_parser(
        "prepare",
        help="tokenise SRC into the token shards of DIR",
        description="SRC: a folder of .txt/.md/.rst files (one document per file), a .jsonl "
        "(.jsonl.gz) file or folder (one JSON object per line), a .parquet file or folder, "
        "or a folder saved by datasets' save_to_disk (Parquet and Arrow need pyarrow: pip "
        "install 'moelab[data]'). Rows whose text is null or blank are skipped. Documents go "
        "to validation as in training (a hash of the seed and the document's index). "
        "Ctrl-C leaves no half-written shard.",
        formatter_class=_HelpFormatter,
    )
    prep.add_argument("src", metavar="SRC", help="the corpus: file or folder")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    prep.add_argument(
        "--tokenizer",
        default="moelab",
        metavar="moelab|HF_DIR",
        help="'moelab': train moelab's byte-level BPE (--vocab-size) on the first "
        "--sample-chars characters of training documents; or a Hugging Face tokenizer "
        "directory holding tokenizer.json (<|endoftext|> is added when it lacks it)",
    )
    prep.add_argument(
        "--workers", type=int, default=1, metavar="N", help="encoding processes (one thread each)"
    )
    prep.add_argument(
        "--format",
        default="auto",
        choices=dp.FORMATS,
        help="how to read SRC (auto: from the file names; a saved datasets folder is arrow)",
    )
    prep.add_argument(
        "--field", default="text", help="JSONL field / Parquet or Arrow column holding the text"
    )
    prep.add_argument(
        "--split",
        default=None,
        help="a saved DatasetDict's split (None: train)",
    )
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=dp.DEFAULT_VOCAB_SIZE,
        help="--tokenizer moelab: the BPE's vocabulary",
    )
    prep.add_argument(
        "--sample-chars",
        type=int,
        default=dp.DEFAULT_SAMPLE_CHARS,
        help="--tokenizer moelab: characters of training documents, from the start of the "
        "corpus, that the BPE is trained on",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=dp.DEFAULT_VAL_FRACTION,
        help="share of documents for validation",
    )
    prep.add_argument(
        "--seed", type=int, default=dp.DEFAULT_SEED, help="seed of the train/validation split"
    )
    prep.add_argument(
        "--overwrite", action="store_true", help="replace the prepared data of a non-empty DIR"
    )
    prep.add_argument("--json", action="store_true", help="print one JSON document")
    prep.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    prep.set_defaults(func=_data)

    sy = sub.add_parser(
        "study",
        help="a paper's experiment grid: train every arm with N seeds, tables and figures",
        description="Run one paper's study: train every arm (with --seeds N seeds each), "
        "measure the runs as the paper does and write OUT/report.md, PNG figures, "
        "OUT/tables.tex and OUT/results.json; with N >= 2 every number is mean ± sd. "
        "Run folders that exist are reused (finished arms) or resumed (interrupted ones). "
        "OUT must be new, empty or this study's own folder; --overwrite also writes into "
        "another study's or a report's folder; a run folder, a corpus or a folder holding "
        "files moelab did not write is always refused. "
        "Scales: quick (a smoke run), cpu (the tiny preset on the default corpus), paper "
        "(writes the configs and torchrun commands of the paper's scale; --run trains "
        "them). See docs/studies.md.",
        formatter_class=_HelpFormatter,
    )
    sy.add_argument(
        "name", choices=["sparse-maps", "temperature", "softmoe", "gate-norm"], help="the study"
    )
    sy.add_argument("--scale", choices=["quick", "cpu", "paper"], default="cpu")
    sy.add_argument("--seeds", type=int, default=1, help="seeds per arm (0 .. N-1)")
    sy.add_argument("--out", default=None, help="output folder (default: studies/NAME-SCALE)")
    sy.add_argument("--overwrite", action="store_true", help=_STUDY_OVERWRITE)
    sy.add_argument("--data", default=None, help="training corpus (default: the Python docs)")
    sy.add_argument(
        "--eval-data",
        default=None,
        help="a second, out-of-domain corpus for routing statistics (sparse-maps)",
    )
    sy.add_argument(
        "--dense", action="store_true", help="sparse-maps: also train the dense references"
    )
    sy.add_argument("--run", action="store_true", help="--scale paper: also train the arms")
    sy.add_argument(
        "--max-batches",
        type=_batches,
        default=None,
        metavar="N",
        help="validation batches of the analysis (default: the scale's own)",
    )
    sy.add_argument("--json", action="store_true", help="print one JSON document")
    sy.set_defaults(func=_study)

    st = sub.add_parser(
        "stats",
        help="routing statistics of a run, overall and per MoE layer",
        description="Routing statistics (discarded mass, contributors, support sizes, load "
        "balance, score gaps; see moelab.diagnostics.stats) of the newest checkpoint of RUN "
        "(or --step N's) with its trained K, on its validation split or the corpus --data. "
        "With --hf DIR instead of RUN: the same statistics of a local Hugging Face MoE "
        "model on the text --data (a file or a folder of .txt files); see docs/huggingface.md.",
        formatter_class=_HelpFormatter,
    )
    st.add_argument("run", nargs="?", default=None, help="run folder (or --hf DIR)")
    st.add_argument("--data", default=None, help="corpus folder instead of the validation split")
    _step_argument(st)
    _max_batches_argument(st)
    _hf_arguments(st, swap=False)
    st.add_argument("--json", action="store_true", help="print one JSON document")
    st.set_defaults(func=_stats)

    ds = sub.add_parser(
        "downstream",
        help="downstream tasks (lm-evaluation-harness) per K, with routing per task",
        description="Evaluate runs on lm-evaluation-harness tasks for each K and print one "
        "table (rows: run x K, columns: acc / acc_norm per task) and the routing "
        "statistics of each task's tokens. Offline unless --network: tasks come from "
        "YAML files under --include-path (dataset_path: json with local data_files), or "
        "are the ready cloze task moelab_cloze, generated from each run's held-out text. "
        "Results are also saved to RUN/downstream.json with the checkpoint step and "
        "--limit (an earlier file of another step or limit is moved to RUN/downstream/), "
        "which moelab report reads. Needs "
        "the eval extra (pip install 'moelab[eval]'); see docs/downstream.md.",
        formatter_class=_HelpFormatter,
    )
    ds.add_argument("runs", nargs="*", metavar="RUN", help="run folders (or --hf DIR)")
    ds.add_argument("--tasks", nargs="+", required=True, metavar="NAME", help="task names")
    ds.add_argument(
        "--include-path", action="append", default=None, metavar="DIR",
        help="a folder of task YAMLs (repeatable)",
    )  # fmt: skip
    ds.add_argument(
        "--top-k", type=int, nargs="+", default=None, help="values of K (None: the trained K)"
    )
    ds.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="N",
        help="at most N documents per task (below 1: that fraction of them)",
    )
    ds.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    ds.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples (None: the task's own number, usually 0)",
    )
    ds.add_argument("--device", default="cpu", help="torch device")
    _step_argument(ds, "every RUN")
    ds.add_argument(
        "--hf", action="append", default=None, metavar="DIR",
        help="a local Hugging Face MoE model folder to evaluate the same way (repeatable)",
    )  # fmt: skip
    _trust_argument(
        ds, what=", and let the harness run the Python of the task YAMLs under "
        "--include-path (!function, metric scripts, includes from outside the folder) and "
        "render their templates outside Jinja's sandbox",
    )  # fmt: skip
    ds.add_argument(
        "--network", action="store_true",
        help="let lm-evaluation-harness and datasets download the tasks' data from the "
        "Hugging Face Hub into the local cache (needed once for the harness's own tasks, "
        "e.g. hellaswag; offline otherwise)",
    )  # fmt: skip
    ds.add_argument("--json", action="store_true", help="print one JSON document")
    ds.set_defaults(func=_downstream)
    for name in THREADED:
        sub.choices[name].add_argument(
            "--threads",
            type=int,
            default=None,
            metavar="N",
            help="torch's intra-op CPU threads (default: the free cores, those of the "
            "process's affinity mask that the load average leaves idle; see "
            "moelab.train.threads)",
        )
    for command in sub.choices.values():
        # NOTE: SUPPRESS keeps the subcommand from resetting a --debug given before it
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
    return parser


def _message(err: BaseException) -> str:
    """The error's message on one line."""
    if isinstance(err, OSError) and err.strerror and err.filename:
        text = f"{err.filename}: {err.strerror}"  # e.g. a file open() could not find
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (0, or 2 for a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except _ArgumentError as err:  # argparse printed the usage and the message
        if "--json" in argv:
            print(to_json({"error": err.message}))
        raise
    try:
        if args.command in THREADED and args.command != "train":
            from moelab.train.threads import use_threads

            args.threads = use_threads(args.threads)  # resolved: the demo's runs share it
        from moelab.data.corpus import corpus_warnings_as_lines

        def say(line: str) -> None:
            print(f"moelab {args.command}: {line}", file=sys.stderr)

        # skipped corpus files: one formatted line in every command (eval and stats
        # --data, study, demo), not Python's display of a warning with its source line
        with corpus_warnings_as_lines(say):
            return int(args.func(args))
    except KeyboardInterrupt:
        # NOTE: Ctrl-C where a command has no handler of its own (training's writes a
        # checkpoint, or stops at once on the second): every file moelab writes is
        # written whole or not at all, so there is nothing to clean up
        if args.debug:
            raise
        print(f"moelab {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # NOTE: the reader closed the pipe (`moelab stats RUN --json | head`): stop
        # quietly, as the shell's own tools do; stdout goes to devnull so that the
        # interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except USER_ERRORS as err:
        if args.debug:
            raise
        message = _message(err)
        print(f"moelab {args.command}: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(to_json({"error": message}))
        return 2


if __name__ == "__main__":
    sys.exit(main())
