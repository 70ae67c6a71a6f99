"""What every moelab command shares: the parser and help formatter, the common
arguments (each added by one function: :func:`add_json`, :func:`add_threads`,
:func:`add_debug`, :func:`add_step`, :func:`add_max_batches`,
:func:`add_hf`, :func:`add_trust_remote_code`), the value parsers, the number
formatters and the emitter (:func:`emit`, :func:`to_json`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from moelab._strict_json import strict_dumps

DEFAULT_MAX_BATCHES = 64
"""Validation batches that eval, stats and report evaluate unless --max-batches says
otherwise (``--max-batches all``: every batch)."""


def to_json(obj: Any) -> str:
    """One strict JSON document (RFC 8259): non-finite floats become null, so no
    ``NaN`` or ``-Infinity`` (which Python's json would print and strict parsers
    refuse) ever reaches stdout."""
    return strict_dumps(obj)


class ArgumentError(SystemExit):
    """argparse's usage error (exit code 2), with its message kept for --json."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(2)
        self.prog, self.message = prog, message


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise ArgumentError(self.prog, message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every command's --help: an option's default appended as ``(default: ...)``
    unless its help already names it, or the default is None (whose meaning the help
    says in words: "(default: the Python docs)", "(None: the trained K)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def module_source(module: str) -> Any:
    """The parsed source (an ``ast.Module``) of the moelab module ``module`` (a .py file),
    found without importing it or its package: only the top package ``moelab`` is
    imported. For --help, whose defaults live in modules that import torch."""
    import ast
    import importlib.util
    from pathlib import Path

    package, _, leaf = module.rpartition(".")
    spec = importlib.util.find_spec(package)  # imports package's parents, not package
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / f"{leaf}.py"
        if path.is_file():
            return ast.parse(path.read_text(encoding="utf-8"))
    raise ModuleNotFoundError(f"no source file of {module}")


def source_literals(module: str, *names: str) -> dict[str, Any]:
    """The values of the module-level constants ``names`` of ``module``, each assigned a
    literal (``DEFAULT_SEED = 0``), read from its source (:func:`module_source`) so that
    --help does not import the module (tests check them against the imported values)."""
    import ast

    found: dict[str, Any] = {}
    for node in module_source(module).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in names and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{module} assigns no literal to {', '.join(missing)}")
    return found


def preset_names() -> list[str]:
    """The names of the model presets (``moelab.model.available_presets()``), read from
    the folder of preset files without importing moelab.model (and torch with it), so
    that --help stays fast."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("moelab.model")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted({p.stem for f in folders for p in (Path(f) / "presets").glob("*.toml")})


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


def batch_count(text: str) -> int:
    """A number of batches >= 1."""
    n = _max_batches(text)
    if n is None:
        raise argparse.ArgumentTypeError("give a number of batches >= 1")
    return n


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is as Ctrl-C raises KeyboardInterrupt, so that a
    command stops on it as on SIGINT (training writes its checkpoint, the others end with
    one line); main() installs the handler (:func:`sigterm_as_interrupt`)."""


def interruption(err: KeyboardInterrupt) -> tuple[str, int]:
    """The signal that raised ``err`` and the exit code it gives (128 + its number):
    ("SIGTERM", 143) or ("SIGINT", 130)."""
    return ("SIGTERM", 143) if isinstance(err, Terminated) else ("SIGINT", 130)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def _default_sigterm_in_child() -> None:
    """After a fork, in the child: SIGTERM ends it again (see :func:`sigterm_as_interrupt`)."""
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within ``with``: SIGTERM raises :class:`Terminated` in this process. Signal
    handlers can only be set in the main thread; elsewhere this does nothing.

    NOTE: a process forked meanwhile (a worker of a multiprocessing pool that a library
    starts, e.g. lm-evaluation-harness's bootstrap) gets SIGTERM's default back at the
    fork. With the handler inherited, a ``Pool.terminate()`` that arrived before the
    worker blocked on its task queue only set Python's flag, and the worker slept on:
    ``moelab downstream`` hung in the suite."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


STDOUT = "standard output"
"""The file name an error gives for a failed write to stdout (``moelab eval --json >
FILE`` on a full disk: "moelab eval: error: standard output: No space left on device")."""


def stdout_error(err: OSError) -> OSError:
    """A failed write to stdout as an OSError that names it (:data:`STDOUT`); a closed
    pipe (BrokenPipeError, ``| head``) stays as it is: main() ends quietly on it."""
    if isinstance(err, BrokenPipeError) or err.filename is not None:
        return err
    return OSError(err.errno, err.strerror or str(err), STDOUT)


def print_out(text: str) -> None:
    """Print ``text`` on stdout and flush it, so that a failed write (a full disk under
    ``> FILE``) is raised here, as an OSError naming stdout (:func:`stdout_error`), not
    at the interpreter's exit."""
    try:
        print(text)
        sys.stdout.flush()
    except OSError as err:
        raise stdout_error(err) from err


def emit(args: argparse.Namespace, result: dict, as_text: Callable[[dict], str]) -> int:
    """Print one JSON document with --json, else the human-readable form."""
    print_out(to_json(result) if args.json else as_text(result))
    return 0


def fmt_value(v: object, spec: str = ".4f") -> str:
    """A float with ``spec``, anything else as it prints, through the one formatter
    (moelab._format.fmt: "-" for None, NaN and infinities, never "-0.0000")."""
    from moelab._format import fmt

    return fmt(v, spec if isinstance(v, float) else "s")


def coverage(tokens: int, batches: int, total: int) -> str:
    """What an evaluation covered: "65,536 tokens (64 of 312 batches; ...)"."""
    if batches >= total:
        return f"{tokens:,} tokens (all {total} batches)"
    return f"{tokens:,} tokens ({batches} of {total} batches; --max-batches all for every batch)"


STUDY_OVERWRITE_HELP = (
    "write into OUT even when another moelab command made it (another study's or a "
    "report's folder); never into a run folder, a corpus or a folder holding files "
    "moelab did not write"
)


def study_interrupted(args: argparse.Namespace, stop: Any) -> int:
    """A study (or the demo) stopped by SIGINT/SIGTERM: the arm's checkpoint is written
    (or, with the signal twice, the arm stopped at once at its newest checkpoint)."""
    from moelab.runs.checkpoints import checkpoint_step
    from moelab.train import TrainingAborted

    if isinstance(stop, TrainingAborted):
        kept = (
            f"its newest checkpoint is step {checkpoint_step(stop.checkpoint)}"
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


def run_or_hf(args: argparse.Namespace) -> bool:
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


def hf_call(fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
    """Call the Hugging Face integration; a missing transformers is a user error."""
    try:
        return fn(*args, **kwargs)
    except ImportError as err:
        if "transformers" not in str(err):
            raise
        raise ValueError(str(err)) from err


def hf_head(r: dict) -> str:
    rule = f": {r['rule']}" if r.get("rule") else ""
    return f"model {r['run']}  ({r['model_type']}, family {r['family']}{rule})  E={r['n_experts']}"


TRUST_REMOTE_CODE_HELP = (
    "{prefix}let a Hugging Face folder run the Python it names (an auto_map in config.json "
    "or tokenizer_config.json){what}. This runs arbitrary code from the folder with your "
    "permissions: give it only for a folder you trust. Without it such a folder is "
    "refused, nothing is asked on stdin, and only safetensors weights, tokenizer.json and "
    "JSON configs are read (docs/huggingface.md)"
)


def add_trust_remote_code(p: argparse.ArgumentParser, prefix: str = "", what: str = "") -> None:
    """--trust-remote-code on a command that loads a Hugging Face folder."""
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=TRUST_REMOTE_CODE_HELP.format(prefix=prefix, what=what),
    )


def add_hf(p: argparse.ArgumentParser, swap: bool) -> None:
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
    add_trust_remote_code(p, prefix="--hf: ")
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


def add_step(parser: argparse.ArgumentParser, what: str = "RUN") -> None:
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


def add_max_batches(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-batches",
        type=_max_batches,
        default=DEFAULT_MAX_BATCHES,
        metavar="N|all",
        help="evaluate the first N validation batches in file order ('all': every batch)",
    )


def add_json(parser: argparse.ArgumentParser, text: str = "print one JSON document") -> None:
    """--json: print one strict JSON document (:func:`emit`) instead of the text."""
    parser.add_argument("--json", action="store_true", help=text)


def add_threads(parser: argparse.ArgumentParser) -> None:
    """--threads N of the commands in moelab.cli.THREADED."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch's intra-op CPU threads (default: the free cores, those of the "
        "process's affinity mask that the load average leaves idle; see "
        "moelab.train.threads)",
    )


def add_debug(parser: argparse.ArgumentParser) -> None:
    """--debug after the command (``moelab COMMAND ... --debug``)."""
    # NOTE: SUPPRESS keeps the subcommand from resetting a --debug given before it
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
