"""moelab.runs.metrics: an append on a full disk leaves whole lines (the file as it was,
the error naming it)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moelab.runs.metrics import append_metrics


def test_a_full_disk_in_a_metrics_append_leaves_whole_lines(tmp_path: Path) -> None:
    append_metrics(tmp_path, {"step": 1, "loss": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    mp = pytest.MonkeyPatch()
    mp.setattr(
        "moelab.runs.metrics.write_file",
        lambda f, data: (f.write(data[:5]), f.flush(), _raise_enospc()),
    )
    try:
        with pytest.raises(OSError, match="No space left") as err:
            append_metrics(tmp_path, {"step": 2, "loss": 0.5})
    finally:
        mp.undo()
    assert err.value.filename == str(tmp_path / "metrics.jsonl")
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def _raise_enospc() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
