"""moelab: mixture-of-experts routing, from probability maps to routing statistics."""

from __future__ import annotations

from . import maps

__version__ = "0.1.0"

__all__ = ["__version__", "maps"]
