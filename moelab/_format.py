"""moelab's number formatters: :func:`fmt` for every table cell and figure label, and
:func:`human` for counts (parameters, tokens) in words such as 297.0M. Light on purpose
(no torch, no matplotlib): the command line imports it too."""

from __future__ import annotations

import math
from typing import Any

from moelab._strict_json import json_safe as json_value

__all__ = ["fmt", "human", "json_value"]


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


def human(n: float) -> str:
    """A count in three significant figures or so: 297.0M, 1.01B, 33.3K (below 1,000:
    the whole number)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(int(n))
