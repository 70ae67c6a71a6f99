"""Write the golden ``--help`` of every moelab command into ``help_snapshot/``.

Run from the repository root: ``python tests/cli/make_help_snapshot.py``. The texts are
made in-process from :func:`moelab.cli.build_parser` with COLUMNS=100, so the wrapping
does not depend on the terminal; ``test_help_snapshot.py`` compares them to the parser.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "help_snapshot"
COLUMNS = "100"


def help_texts() -> dict[str, str]:
    """File name -> ``--help`` text: ``moelab.txt`` (the top level), ``bench.txt``,
    ``data.txt``, ``data-prepare.txt`` ... (a sub-command joined with '-')."""
    os.environ["COLUMNS"] = COLUMNS  # read by argparse's formatter when it is made
    from moelab.cli import build_parser

    texts: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
        texts[("-".join(names) or "moelab") + ".txt"] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*names, name))

    walk(build_parser(), ())
    return texts


def main() -> None:
    SNAPSHOT.mkdir(exist_ok=True)
    for old in SNAPSHOT.glob("*.txt"):
        old.unlink()
    for name, text in help_texts().items():
        (SNAPSHOT / name).write_text(text)
        print(f"wrote {SNAPSHOT / name}")


if __name__ == "__main__":
    main()
