"""``RUN/metrics.jsonl``: one JSON object per line, appended as training logs.

:func:`append_metrics` writes a whole line or nothing: when the write fails (a full
disk) the file is cut back to where it was and the OSError names the file.
:func:`read_metrics` reads the rows back. A last line cut off without its newline (a
kill or a full disk in the middle of an append by a moelab before this one) is dropped
with a warning; any other line that is not a JSON object is an error naming the file
and the line, since the rows after it would be read wrongly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checkpoint import _write_file

__all__ = ["METRICS", "append_metrics", "read_metrics"]

METRICS = "metrics.jsonl"


def append_metrics(run: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one line of ``run/metrics.jsonl``: all of it or, when the write
    fails, nothing (the file is cut back to its previous size)."""
    path = Path(run) / METRICS
    data = (json.dumps(row) + "\n").encode()
    with open(path, "ab") as f:
        size = f.tell()
        try:
            _write_file(f, data)
            f.flush()
        except OSError as err:
            try:
                f.truncate(size)
            except OSError:
                pass
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def read_metrics(
    path: str | Path, warn: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (``[]`` when there is no file). A cut-off last line is
    dropped, with a line to ``warn``; any other bad line raises ValueError naming the
    file and line and what to do."""
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows: list[dict[str, Any]] = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = n == len(lines)  # NOTE: only text after the final newline can be cut off
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if last:
                if warn is not None:
                    warn(
                        f"warning: {path} ends in a cut-off line {n} (a write was "
                        "interrupted); it is left out"
                    )
                break
            raise ValueError(
                f"{path}, line {n}, is not valid JSON ({err}); delete or repair that line "
                "(each line is one logged step)"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(
                f"{path}, line {n}, is not a logged step (a JSON object with an integer "
                "'step'); delete or repair that line"
            )
        rows.append(row)
    return rows
