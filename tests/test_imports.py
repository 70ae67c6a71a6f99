"""No import circle in moelab: every module imports alone in a fresh interpreter, and the
graph of module-level imports has no cycle.

The first test is cheap: one subprocess imports the third-party libraries moelab imports
at module level, then forks one child per moelab module; each child starts with no moelab
module loaded, imports only its module and reports back. The second walks the source
(ast), so it needs no import at all: module-level imports (those under ``if
TYPE_CHECKING:`` excluded, those inside functions excluded), relative imports and ``from
package import name`` resolved to modules.

``python tests/test_imports.py`` prints the cycles, at module level and with the imports
inside functions (lazy) counted too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moelab"


def module_files() -> dict[str, Path]:
    """Every module of moelab by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, lazy: bool, type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when imported (``lazy``: and those inside its
    functions), never those under ``if TYPE_CHECKING:`` (``type_checking``: those too,
    what a type checker reads)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                if lazy:
                    visit(child)
            else:
                visit(child)

    visit(tree)
    return found


def _targets(
    name: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> tuple[set[str], set[str]]:
    """(moelab modules, third-party names) that one import statement loads; a
    third-party ``from a import b`` gives both ``a`` and ``a.b`` (b may be a module)."""
    is_package = modules[name].name == "__init__.py"
    # (module, explicit): an explicit one is needed even when it is a package above the
    # importer (``from moelab.pkg import Name`` inside moelab.pkg.sub needs pkg's
    # __init__ run that far); the packages above an imported module are only loaded,
    # which for the importer's own packages has already begun.
    loaded: list[tuple[str, bool]] = []
    if isinstance(node, ast.Import):
        loaded = [(alias.name, True) for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        submodules = [f"{source}.{alias.name}" for alias in node.names]
        names_a_module = all(sub in modules for sub in submodules)
        loaded = [(source, not names_a_module)] + [
            (sub, True) for sub in submodules if sub in modules or not sub.startswith("moelab.")
        ]
    ours, theirs = set(), set()
    for dotted, explicit in loaded:
        top = dotted.split(".")[0]
        if top != "moelab":
            if top and top != "__future__":
                theirs.add(dotted)
            continue
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target not in modules or target == name:
                continue
            if (explicit and i == len(parts)) or not name.startswith(target + "."):
                ours.add(target)
    return ours, theirs


def import_graph(
    lazy: bool = False, type_checking: bool = False
) -> tuple[dict[str, set[str]], set[str]]:
    """Edges module -> moelab modules it imports, and the third-party names imported
    (``lazy``: the imports inside functions counted too; ``type_checking``: those under
    ``if TYPE_CHECKING:`` too)."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    third_party: set[str] = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in _imports(tree, lazy, type_checking):
            ours, theirs = _targets(name, node, modules)
            graph[name] |= ours
            third_party |= theirs
    return graph, third_party


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one module that
    imports itself (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each component of :func:`components`: a shortest path from
    the component's first module back to it."""
    found = []
    for component in components(graph):
        members = set(component)
        start = component[0]
        # breadth-first from start's successors back to start, inside the component
        parent: dict[str, str] = {}
        frontier = [w for w in sorted(graph[start]) if w in members]
        for w in frontier:
            parent.setdefault(w, start)
        while start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        path.append(start)
        path.reverse()
        found.append(path)
    return found


# Each child imports one module and writes one JSON line (its name, the traceback or "")
# to its pipe, short enough for the pipe's buffer so that it can exit before it is read;
# a few children run at a time.
_FORK_SCRIPT = r"""
import importlib, json, os, sys, traceback
modules, third_party = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in third_party:
    try:
        importlib.import_module(name)
    except Exception:  # a child whose module needs it reports the failure
        pass
assert not [m for m in sys.modules if m == "moelab" or m.startswith("moelab.")]
# NOTE: with PYTHONDONTWRITEBYTECODE every child would compile the sources it imports
# again (most of its time); compile them once into a private cache the children read.
import importlib.util, py_compile, tempfile
cache = tempfile.TemporaryDirectory()
sys.pycache_prefix, sys.dont_write_bytecode = cache.name, False
for path in json.loads(sys.argv[3]):
    py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)
running, todo = {}, list(reversed(modules))
while todo or running:
    while todo and len(running) < max(2, os.cpu_count() or 1):
        name = todo.pop()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                importlib.import_module(name)
                message = ""
            except BaseException:
                message = traceback.format_exc()[-30000:]
            os.write(write, json.dumps([name, message]).encode())
            os._exit(0)
        os.close(write)
        running[pid] = (name, read)
    pid, status = os.wait()
    name, read = running.pop(pid)
    data = os.read(read, 65536)
    os.close(read)
    print(data.decode() or json.dumps([name, f"child died (wait status {status})"]))
cache.cleanup()
"""


def test_every_module_imports_alone() -> None:
    graph, third_party = import_graph()
    modules = sorted(graph)
    # NOTE: third-party libraries are loaded once before the forks (they are the slow
    # part); each child still starts with no moelab module in sys.modules.
    preload = sorted(third_party)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _FORK_SCRIPT,
            json.dumps(modules),
            json.dumps(preload),
            json.dumps([str(path) for path in module_files().values()]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    reports = dict(json.loads(line) for line in result.stdout.splitlines() if line.strip())
    assert sorted(reports) == modules, result.stderr
    failed = {name: message for name, message in reports.items() if message}
    assert not failed, "\n\n".join(f"{name}:\n{message}" for name, message in failed.items())


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-lazy-imports"])
def test_no_import_cycle(lazy: bool) -> None:
    """No cycle among moelab's modules, counting the imports at module level and (the
    second case) those inside functions too: a lazy import saves start-up time, it does
    not excuse a circle."""
    graph, _ = import_graph(lazy)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def routing_graph() -> dict[str, set[str]]:
    """The import graph of ``moelab.routing``'s modules among themselves, every import
    counted: module level, inside functions and under ``if TYPE_CHECKING:``."""
    graph, _ = import_graph(lazy=True, type_checking=True)
    inside = {
        name for name in graph if name == "moelab.routing" or name.startswith("moelab.routing.")
    }
    return {name: graph[name] & inside for name in sorted(inside)}


def test_no_import_cycle_in_routing_even_for_the_type_checker() -> None:
    """Each routing stage imports its own small config, never ``RouterConfig``, so that
    ``moelab.routing`` has no import circle, not even one that only ``if TYPE_CHECKING:``
    keeps from running (DESIGN.md section 1: the Router wires the stages)."""
    found = cycles(routing_graph())
    assert not found, "routing import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]


if __name__ == "__main__":
    for lazy in (False, True):
        graph, _ = import_graph(lazy)
        print("with lazy imports" if lazy else "module level")
        for cycle, members in zip(cycles(graph), components(graph), strict=True):
            print(f"  {' -> '.join(cycle)}\n    ({len(members)} modules: {', '.join(members)})")
    print("moelab.routing, TYPE_CHECKING imports counted")
    graph = routing_graph()
    for cycle, members in zip(cycles(graph), components(graph), strict=True):
        print(f"  {' -> '.join(cycle)}\n    ({len(members)} modules: {', '.join(members)})")
