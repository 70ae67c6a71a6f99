"""``RUN/metrics.jsonl``: one JSON object per line, appended as training logs (the rows:
moelab.train.metrics).

:func:`append_metrics` writes a whole line or nothing: when the write fails (a full
disk) the file is cut back to where it was and the OSError names the file.
:func:`read_rows` reads the rows of a file back, :func:`read_metrics` those of a run. A
last line cut off without its newline (a kill or a full disk in the middle of an append
by a moelab before this one) is dropped with a warning; any other line that is not a
JSON object is an error naming the file and the line, since the rows after it would be
read wrongly. :func:`restore_row` writes again a row a resumed run would lose.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moelab._io import json_bytes, write_file
from moelab.runs.layout import METRICS

__all__ = ["METRICS", "append_metrics", "read_metrics", "read_rows", "restore_row"]


def append_metrics(run: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one line of ``run/metrics.jsonl``: all of it or, when the write
    fails, nothing (the file is cut back to its previous size)."""
    path = Path(run) / METRICS
    data = json_bytes(row, indent=None)
    with open(path, "ab") as f:
        size = f.tell()
        try:
            write_file(f, data)
            f.flush()
        except OSError as err:
            try:
                f.truncate(size)
            except OSError:
                pass
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def read_rows(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
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


def restore_row(run: str | Path, row: dict[str, Any] | None, say: Callable[[str], None]) -> None:
    """Append ``row``, a checkpoint's copy of the row logged at its step, when
    ``run/metrics.jsonl`` has no row of that step: its line was cut off (a kill in the
    middle of the append, a disk that lost the unsynced end of the file) and dropped, and
    a run resumed from that checkpoint would never log the step again."""
    if not row:
        return
    step = row["step"]
    if any(r["step"] == step for r in read_rows(Path(run) / METRICS)):
        return
    append_metrics(run, row)
    say(f"note: the metrics row of step {step} was missing; written again from its checkpoint")


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run/metrics.jsonl`` (:func:`read_rows`: a cut-off last line is left
    out with a warning on stderr; any other bad line is an error naming the file and
    line, never skipped silently)."""
    return read_rows(Path(run) / METRICS, lambda line: print(line, file=sys.stderr, flush=True))
