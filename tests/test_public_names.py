"""What crosses a module is public: no module of moelab imports an underscore name from
another module (``from moelab.a import _x``), and a private module (``moelab/a/_m.py``)
is imported only by modules of its own package ``moelab.a``. Imports inside functions
count too. Walks the source (ast); ``python tests/test_public_names.py`` lists them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module(path: Path, root: Path) -> tuple[str, str]:
    """The dotted name of the module at ``path`` and of the package it belongs to."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _outside(imported: str, package: str) -> str | None:
    """``imported`` when it names a private module of a package ``package`` is not in."""
    parts = imported.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            inside = package == owner or package.startswith(owner + ".")
            return None if inside else ".".join(parts[: i + 1])
    return None


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The dotted module a ``from ... import`` reads (a relative one resolved)."""
    if node.level == 0:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def crossings(root: Path = ROOT) -> list[str]:
    """``file: name`` for every import of a private name or module from outside it."""
    found = []
    for path in sorted((root / "moelab").rglob("*.py")):
        module, package = _module(path, root)
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, package)
                if not source.startswith("moelab"):
                    continue
                if (bad := _outside(source, package)) is not None:
                    found.append(f"{where}: {bad}")
                for alias in node.names:
                    if _private(alias.name) and source != module:
                        if not _is_module(root, f"{source}.{alias.name}"):
                            found.append(f"{where}: {source}.{alias.name}")
                        elif (bad := _outside(f"{source}.{alias.name}", package)) is not None:
                            found.append(f"{where}: {bad}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("moelab"):
                        if (bad := _outside(alias.name, package)) is not None:
                            found.append(f"{where}: {bad}")
    return found


def test_no_module_imports_another_modules_private_names():
    assert crossings() == []


def test_the_check_sees_a_private_import(tmp_path):
    """The walk finds both kinds (a guard that the test above can fail)."""
    pkg = tmp_path / "moelab"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "_m.py").write_text("X = 1\n_y = 2\n")
    (pkg / "a" / "ok.py").write_text("from moelab.a._m import X\n")
    (pkg / "a" / "rel.py").write_text("from . import _m\nfrom ._m import _y\n")
    (pkg / "b.py").write_text("from moelab.a._m import X\nfrom moelab.a.ok import _y\n")
    (pkg / "c.py").write_text("from moelab.a import _m\n")
    assert crossings(tmp_path) == [
        "moelab/a/rel.py: moelab.a._m._y",
        "moelab/b.py: moelab.a._m",
        "moelab/b.py: moelab.a.ok._y",
        "moelab/c.py: moelab.a._m",
    ]


if __name__ == "__main__":
    print("\n".join(crossings()) or "none")
