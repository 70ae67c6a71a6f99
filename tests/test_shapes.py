"""The shape legend (moelab.shapes) is the one place that says what a shape letter means:
every shape-suffixed name in moelab uses its letters, and every module with such names
says which in one docstring line that points there instead of a legend of its own."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from moelab.shapes import KEPT_NAMES, LETTERS

PACKAGE = Path(__file__).resolve().parents[1] / "moelab"
SUFFIXED = re.compile(r"^[a-z][a-z0-9_]*?_([A-Z][A-Z0-9]*)$")
LINE = re.compile(r"^Shape suffixes: ([A-Z](?:, [A-Z])*) \(moelab\.shapes\)", re.M)
# NOTE: copied byte for byte into exported Hugging Face folders: an edit would change
# what `moelab export --format remote` writes
UNCHANGED = {"integrations/hf/remote/modeling_moelab.py"}


def _letters(source: str) -> set[str]:
    """The shape letters of the names (not strings or comments) of ``source``."""
    found: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        match = SUFFIXED.match(tok.string) if tok.type == tokenize.NAME else None
        if match and tok.string not in KEPT_NAMES:
            found |= {c for c in match.group(1) if c.isalpha()}
    return found


MODULES = sorted(
    str(p.relative_to(PACKAGE))
    for p in PACKAGE.rglob("*.py")
    if p.name != "shapes.py" and _letters(p.read_text(encoding="utf-8"))
)


@pytest.mark.parametrize("module", MODULES)
def test_letters_come_from_the_legend(module: str) -> None:
    source = (PACKAGE / module).read_text(encoding="utf-8")
    used = _letters(source)
    assert used <= set(LETTERS), f"letters {sorted(used - set(LETTERS))} are not in moelab.shapes"
    if module in UNCHANGED:
        return
    doc = ast.get_docstring(ast.parse(source)) or ""
    lines = LINE.findall(doc)
    assert len(lines) == 1, "the docstring needs one 'Shape suffixes: ... (moelab.shapes)' line"
    assert set(lines[0].split(", ")) == used
    assert "Shape legend" not in doc


def test_kept_names_are_still_saved_names() -> None:
    """Every name of KEPT_NAMES is still assigned as an attribute somewhere in moelab."""
    assigned = {
        node.attr
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
    }
    assert set(KEPT_NAMES) <= assigned
