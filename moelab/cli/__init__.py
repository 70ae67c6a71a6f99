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
import contextlib
import errno
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moelab import __version__
from moelab.cli.common import (
    DEFAULT_MAX_BATCHES,
    ArgumentError,
    HelpFormatter,
    Parser,
    add_debug,
    add_threads,
    interruption,
    print_out,
    sigterm_as_interrupt,
    stdout_error,
    to_json,
)
from moelab.runs.folders import STAGING_PREFIX

__all__ = ["COMMANDS", "DEFAULT_MAX_BATCHES", "THREADED", "USER_ERRORS", "build_parser"]
__all__ += ["main", "to_json"]


def _user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS` (the checkpoint module, and torch with it, imported only when
    an error is handled: ``moelab --help`` does not load torch)."""
    from moelab.runs.checkpoints import CheckpointError

    return (ValueError, OSError, CheckpointError)


def __getattr__(name: str) -> Any:
    """``USER_ERRORS``: exceptions that mean a mistake the user can fix: ValueError (bad
    values, ``--set`` keys and types, unknown presets and maps, corrupt JSON), OSError
    (FileNotFoundError, NotADirectoryError, FileExistsError, PermissionError: missing
    runs, corpora, files) and the checkpoint module's CheckpointError (a truncated or
    altered checkpoint). The library raises ValueError, not KeyError, for bad keys, so a
    KeyError stays a bug. Computed on first use (PEP 562)."""
    if name == "USER_ERRORS":
        return _user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


THREADED = ("train", "eval", "stats", "report", "demo", "study", "downstream", "analyze")
"""Commands with ``--threads``: train passes it to TrainConfig.threads, the others set
torch's thread count with moelab.train.threads.use_threads before they start."""

COMMANDS = (
    "bench",
    "demo",
    "report",
    "params",
    "train",
    "eval",
    "data",
    "study",
    "stats",
    "downstream",
    "analyze",
    "export",
    "routing",
)
"""The commands, in the order of ``moelab --help``: each is the module moelab.cli.NAME,
whose ``register(sub)`` adds its parser (its arguments and ``func``, the handler). A new
command is one module and a line here with its name (docs/extending.md). A module and its
``register`` import no torch (the handler does, when it runs), so that ``--help`` is fast:
tests/cli/test_fast_help.py builds every parser with torch unimportable."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moelab",
        description="Mixture-of-experts routing: probability maps, benchmarks and demos.",
        epilog="A mistake the user can fix (a bad value, a missing run, a corrupted "
        "checkpoint) prints 'moelab COMMAND: error: ...' and exits with code 2 (with --json, "
        'stdout holds {"error": ...}); a traceback means a bug.',
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moelab {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of every error, user errors too (also after the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moelab.cli.{name}").register(sub)
    for name in THREADED:
        add_threads(sub.choices[name])
    for command in sub.choices.values():
        add_debug(command)
    return parser


_WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name)
)
"""A full disk, a quota, a file-size limit: errors of a write, which name no file."""


def _message(err: BaseException, out: object = None) -> str:
    """The error's message on one line. A file in a staging folder (``Staging``: the
    new files of a report or an analysis, moved into the output folder once all are
    written) is named by where it goes; a failed write that names no file names ``out``
    (the command's --out), where it was writing."""
    if isinstance(err, OSError) and err.strerror and err.filename is None and out:
        if err.errno in _WRITE_ERRNOS:
            err = OSError(err.errno, err.strerror, str(out))
    if isinstance(err, OSError) and err.strerror and err.filename:
        name = Path(os.fsdecode(err.filename))
        if name.parent.name.startswith(STAGING_PREFIX):
            name = name.parent.parent / name.name
        text = f"{name}: {err.strerror}"  # e.g. a file open() could not find
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def _quiet_stdout() -> None:
    """Send what is left of stdout to devnull: it cannot be written (a full disk, a
    closed pipe), and the interpreter's final flush would raise again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _warn_threads(threads: object, say: Callable[[str], None]) -> None:
    """One line when --threads asks for more threads than this process has cores: they
    take turns on the cores, and every step waits for the slowest (a count below 1 is
    refused where it is used)."""
    if not isinstance(threads, int) or threads < 2:
        return
    from moelab.train.threads import available_cores

    cores = available_cores()
    if threads > cores:
        say(
            f"warning: --threads {threads} is more than the {cores} core(s) this process "
            f"may use; the threads take turns on them, which can make it many times "
            f"slower: give --threads {cores} or less (or leave it out: the free cores)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (0, or 2 for a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except ArgumentError as err:  # argparse printed the usage and the message
        if "--json" in argv:
            try:
                print_out(to_json({"error": err.message}))
            except OSError:  # stdout cannot be written; stderr has the message
                _quiet_stdout()
        raise
    try:
        from moelab.train.allocator import keep_freed_memory

        # freed tensors stay in the process for the next step (3-4% of a CPU training
        # step went to the page faults of memory handed back; moelab.train.allocator)
        keep_freed_memory()

        def say(line: str) -> None:
            print(f"moelab {args.command}: {line}", file=sys.stderr)

        if args.command != "train":  # training says so itself, with the load taken in
            _warn_threads(getattr(args, "threads", None), say)
        if args.command in THREADED and args.command != "train":
            from moelab.train.threads import use_threads

            args.threads = use_threads(args.threads)  # resolved: the demo's runs share it
        from moelab.data.corpus import corpus_warnings_as_lines

        # skipped corpus files: one formatted line in every command (eval and stats
        # --data, study, demo), not Python's display of a warning with its source line;
        # SIGTERM stops a command as Ctrl-C does (it ended the process without a word)
        with corpus_warnings_as_lines(say), sigterm_as_interrupt():
            code = int(args.func(args))
        try:  # what a command printed itself: a failed write fails here, named
            sys.stdout.flush()
        except OSError as err:
            raise stdout_error(err) from err
        return code
    except KeyboardInterrupt as err:
        # NOTE: Ctrl-C or SIGTERM where a command has no handler of its own (training's
        # writes a checkpoint, or stops at once on the second): every file moelab writes
        # is written whole or not at all, so there is nothing to clean up
        if args.debug:
            raise
        name, code = interruption(err)
        print(f"moelab {args.command}: interrupted by {name}", file=sys.stderr)
        return code
    except BrokenPipeError:
        # NOTE: the reader closed the pipe (`moelab stats RUN --json | head`): stop
        # quietly, as the shell's own tools do; stdout goes to devnull so that the
        # interpreter's final flush does not raise again
        _quiet_stdout()
        return 141  # 128 + SIGPIPE
    except _user_errors() as err:  # NOTE: evaluated only once an exception is raised
        if args.debug:
            raise
        message = _message(err, getattr(args, "out", None))
        print(f"moelab {args.command}: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            try:
                print_out(to_json({"error": message}))
            except OSError:  # stdout is what failed: the line on stderr says so
                _quiet_stdout()
        return 2


if __name__ == "__main__":
    sys.exit(main())
