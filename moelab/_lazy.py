"""A package's names imported on first use (PEP 562), so that importing the package stays
light: ``import moelab`` and ``moelab --help`` load no torch, and ``moelab.train.config``
imports without the training loop."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str,
    table: Mapping[str, str | tuple[str, str | None]],
    public: Iterable[str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``table`` is read the
    first time it is asked for, then kept in the package. An entry names where from: a
    module (its attribute of the same name), ``(module, attr)``, or ``(module, None)``
    for the module itself. ``public``: the package's ``__all__`` (listed by ``dir``)."""
    listed = tuple(public)

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        entry = table[name]
        module, attr = (entry, name) if isinstance(entry, str) else entry
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(listed))

    return __getattr__, __dir__
