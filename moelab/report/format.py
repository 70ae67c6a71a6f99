"""One number formatter for every table and figure label of the report."""

from __future__ import annotations

import math
from typing import Any

from moelab._strict_json import json_safe as json_value

__all__ = ["fmt", "json_value"]


def fmt(v: Any, spec: str) -> str:
    """``v`` formatted with the format spec ``spec`` ("s": as text); "-" for None, NaN and
    infinities. A number that rounds to zero prints without a minus sign: -1e-6 with
    ".4f" gives "0.0000" (and "+0.0000" with "+.4f"), never "-0.0000"."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if spec == "s":
        return str(v)
    try:
        text = format(v, spec)
    except (TypeError, ValueError):
        return str(v)
    if text.startswith("-"):
        try:
            if float(text) == 0.0:
                # NOTE: Python keeps the sign of a value that rounds to zero ("-0.0000");
                # formatting 0.0 instead gives the same width, digits and "+" if asked.
                return format(0.0, spec)
        except ValueError:
            pass
    return text
