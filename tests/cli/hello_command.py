"""``moelab hello``: a toy command, the template of a new one."""

from __future__ import annotations

import argparse
from typing import Any

from moelab.cli._common import _emit, _HelpFormatter, add_json


def format_hello(r: dict) -> str:
    """The text of moelab hello."""
    return f"hello, {r['name']} ({r['times']} times)"


def _hello(args: argparse.Namespace) -> int:
    # heavy imports (torch, the library) go here, inside the handler
    if args.times < 1:
        raise ValueError(f"--times must be >= 1, got {args.times}")  # one line, exit 2
    result = {"name": args.name, "times": args.times}
    return _emit(args, result, format_hello)


def register(sub: Any) -> None:
    hello = sub.add_parser(
        "hello",
        help="say hello (a toy command)",
        description="Greet NAME: the template of a moelab command.",
        formatter_class=_HelpFormatter,
    )
    hello.add_argument("name", help="who to greet")
    hello.add_argument("--times", type=int, default=1, help="how many times")
    add_json(hello)
    hello.set_defaults(func=_hello)
