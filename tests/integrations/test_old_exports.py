"""Folders exported with ``--format remote`` carry a ``modeling_moelab.py`` that imports
moelab by name; every name any released export imports must keep importing, so that a
folder exported before a refactor loads with today's moelab."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import moelab

REMOTE = Path(moelab.__file__).parent / "integrations" / "hf" / "remote" / "modeling_moelab.py"

OLD_IMPORTS = [
    ("moelab.model", "ModelConfig"),
    ("moelab.model", "Transformer"),
    ("moelab.model.transformer", "rope_tables"),
    # exports written before the checkpoint format moved to moelab.runs
    ("moelab.train.checkpoint", "set_extra_states"),
]


def _imports_of(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").startswith("moelab")
        for alias in node.names
    ]


@pytest.mark.parametrize("module, name", OLD_IMPORTS + _imports_of(REMOTE))
def test_what_exported_code_imports_still_imports(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_the_old_path_is_the_same_function() -> None:
    from moelab.runs.checkpoints import set_extra_states
    from moelab.train.checkpoint import set_extra_states as old

    assert old is set_extra_states
