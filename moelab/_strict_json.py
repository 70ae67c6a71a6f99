"""Strict JSON (RFC 8259) for everything moelab writes or prints: a number that is not
finite (a diverged loss, a masked expert's -inf score) becomes null, never the ``NaN``
or ``-Infinity`` that Python's json would write and strict parsers refuse."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["json_safe", "strict_dumps"]


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN / infinity replaced by None, numpy and torch scalars and
    arrays as Python numbers and lists, tuples as lists, dict keys and paths as strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy / torch array or scalar
        return json_safe(obj.tolist())
    return obj


def strict_dumps(obj: Any, indent: int | None = 2) -> str:
    """One strict JSON document of ``obj`` (see :func:`json_safe`)."""
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)
