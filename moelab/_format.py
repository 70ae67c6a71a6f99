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
    """A count in three significant figures or more: 297.0M, 1.01B, 1.31M, 33.3K, 196.9T
    (below 1,000: the whole number; from 1,000T on: 1.97e+15)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            v = n / scale
            if unit == "T" and v >= 999.95:
                return f"{n:.3g}"
            return f"{v:.{2 if v < 9.995 else 1}f}{unit}"
    return str(int(n))
