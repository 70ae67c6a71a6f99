"""Read a Weights & Biases offline run's ``run-<id>.wandb`` file without a server.

The file is a LevelDB-style record log (a 7-byte header ``:W&B``, magic, version; then
32 KiB blocks of chunks, each with a 4-byte checksum, a 2-byte little-endian length and
a 1-byte type: full, first, middle, last) whose records are ``wandb_internal_pb2.Record``
protocol buffers. The tests read the history (``run.log``) records back from it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of the file, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending, out = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind in (_FULL, _FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The rows ``run.log`` sent, in order: ``{"_step": step, key: value, ...}``
    (values decoded from their JSON)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        if record.history.HasField("step"):
            row.setdefault("_step", record.history.step.num)
        rows.append(row)
    return rows


def run_id(path: Path) -> str:
    """The run id the file's run record names."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return str(record.run.run_id)
    raise ValueError(f"{path} holds no run record")
