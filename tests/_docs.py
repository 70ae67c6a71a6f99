"""The code blocks of the docs, for the tests that run a page's code as it is written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def page_code(page: str, first_line: str) -> str:
    """The ```python block of ``docs/PAGE`` whose first line is ``first_line``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(first_line)]
    if len(blocks) != 1:
        raise AssertionError(f"docs/{page}: {len(blocks)} code blocks start with {first_line!r}")
    return blocks[0]


def install_page_module(monkeypatch: pytest.MonkeyPatch, page: str, name: str) -> types.ModuleType:
    """The module ``name`` (``moelab.cli.hello``) as the new file that ``docs/PAGE``
    gives in a block starting ``# moelab/cli/hello.py`` (or, for a package,
    ``# moelab/studies/toy/__init__.py``): run from the page and put in ``sys.modules``
    for the test (as if the file were added to the package)."""
    path = name.replace(".", "/") + ".py"
    if f"# {path}\n" not in (DOCS / page).read_text(encoding="utf-8"):
        path = name.replace(".", "/") + "/__init__.py"
    module = types.ModuleType(name)
    module.__file__ = path
    exec(compile(page_code(page, f"# {path}\n"), path, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module
