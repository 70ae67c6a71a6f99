"""What moelab lets lm-evaluation-harness run from a task folder.

The harness indexes every ``*.yaml`` under an include path (parsing them without
running anything) and builds the tasks it evaluates from their YAML. Building can run
Python that the folder names:

- a ``!function NAME`` tag imports ``NAME``'s module, the ``.py`` beside the YAML first
  (or any importable module), and the harness calls what it finds (``process_docs``,
  ``doc_to_text``, ``class``, a metric, a filter, ...);
- ``include:`` merges another YAML, with its own tags, from wherever it points;
- a metric the harness does not define (or one marked ``hf_evaluate: true``) is loaded
  by HF ``evaluate``, which imports a metric script it finds on disk (or on the Hub);
- the templates (``doc_to_text``, ``doc_to_target``, ...) are rendered by an
  unsandboxed Jinja environment, through which a template can reach Python's builtins.

Unless ``trust_remote_code``, :func:`check_task_folders` refuses, before the harness
builds anything, a task folder with a YAML that holds a ``!function`` (or any tag but
YAML's plain ones), an ``include`` of a file outside the folder, or a metric the
harness does not define (or ``hf_evaluate: true``); and :func:`sandboxed_templates`
renders the templates in Jinja's sandbox while the harness evaluates, so a template that
reaches for an unsafe attribute fails (``jinja2.exceptions.SecurityError``) instead of
running. The checks cover every ``*.yaml`` under the folder (as the harness indexes
them) and, recursively, what they include. The harness's own installed tasks are not
checked: their code is part of the installed harness. moelab's own cloze task has none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_task_folders", "sandboxed_templates"]

_FLAG = "--trust-remote-code"
_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as the harness's index


class _Function:
    """A ``!function`` tag, recorded instead of imported."""

    def __init__(self, spec: str) -> None:
        self.spec = spec


def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def function(loader: Any, node: Any) -> _Function:
        return _Function(str(loader.construct_scalar(node)))

    Loader.add_constructor("!function", function)
    return Loader


def _refuse(file: Path, what: str) -> ValueError:
    return ValueError(
        f"task file {file} {what}; moelab does not run a task folder's code unless you "
        f"pass {_FLAG} (it runs that Python with your permissions)"
    )


def _walk(doc: Any) -> Iterator[Any]:
    yield doc
    if isinstance(doc, dict):
        for value in doc.values():
            yield from _walk(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _walk(value)


def _known_metrics() -> Any:
    import lm_eval.api.metrics  # noqa: F401  (fills the registry)
    from lm_eval.api.registry import metric_registry

    return metric_registry


def _within(path: Path, root: Path) -> bool:
    """Whether ``path`` lies under ``root``, compared on normalised names (a symlink is
    followed by what reads it, and that is checked there)."""
    p, r = os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(root))
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def _check_file(file: Path, root: Path, metrics: Any, seen: set[str]) -> None:
    import yaml

    key = os.path.normpath(os.path.abspath(file))
    if key in seen:
        return
    seen.add(key)
    try:
        with file.open("rb") as f:
            doc = yaml.load(f, Loader=_loader())  # a SafeLoader: no Python tags
    except yaml.constructor.ConstructorError as err:
        tag = " ".join((getattr(err, "problem", "") or str(err)).split())
        raise _refuse(file, f"uses a YAML tag moelab does not read ({tag})") from None
    except (OSError, yaml.YAMLError) as err:
        text = " ".join(str(err).split())
        raise ValueError(f"task file {file}: not YAML moelab can read ({text})") from None
    for node in _walk(doc):
        if isinstance(node, _Function):
            module = node.spec.rpartition(".")[0] or node.spec
            raise _refuse(
                file,
                f"holds !function {node.spec}, which the harness would call after importing "
                f"{module.replace('.', '/')}.py beside it (or an installed module {module})",
            )
        if isinstance(node, dict) and isinstance(node.get("metric_list"), list):
            for entry in node["metric_list"]:
                if not isinstance(entry, dict):
                    continue
                name = entry.get("metric")
                if entry.get("hf_evaluate") is True:
                    raise _refuse(
                        file,
                        f"loads the metric {name!r} with HF evaluate (hf_evaluate: true), "
                        "which imports a metric script",
                    )
                if isinstance(name, str) and name not in metrics:
                    raise _refuse(
                        file,
                        f"names the metric {name!r}, which lm-evaluation-harness does not "
                        "define; the harness would load it with HF evaluate, which imports "
                        "a metric script of that name",
                    )
    includes = doc.get("include") if isinstance(doc, dict) else None
    if includes is None:
        return
    for inc in includes if isinstance(includes, list) else [includes]:
        target = Path(str(inc))
        target = target if target.is_absolute() else file.parent / target
        if not isinstance(inc, str) or not _within(target, root):
            raise _refuse(
                file,
                f"includes {inc!r}, a YAML outside its task folder {root} (moelab reads a "
                "task folder's files only, and checks them: the harness would run the "
                "included file's code too); copy it inside the folder",
            )
        if not target.is_file():
            raise ValueError(f"task file {file}: includes {inc!r}, which is not there")
        _check_file(target, root, metrics, seen)


def check_task_folders(folders: Sequence[str | Path]) -> None:
    """Refuse (ValueError, one line naming the file) a task folder whose YAMLs would
    make the harness run code (see the module docstring). Call it after the harness is
    importable (the metric names are checked against its registry), before any task is
    built."""
    metrics = _known_metrics()
    seen: set[str] = set()
    for folder in folders:
        root = Path(folder)
        for file in sorted(root.glob("**/*.yaml")):
            if _IGNORE_DIRS.isdisjoint(file.relative_to(root).parts) and file.is_file():
                _check_file(file, root, metrics, seen)


@contextlib.contextmanager
def sandboxed_templates() -> Iterator[None]:
    """While inside, the harness renders task templates (``lm_eval.utils.env``) with a
    Jinja ``SandboxedEnvironment`` of the same settings and filters: a template that
    reaches for an attribute starting with ``_`` or another unsafe one raises
    ``jinja2.exceptions.SecurityError`` instead of running Python."""
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    saved = utils.env
    env = SandboxedEnvironment(
        loader=saved.loader,
        undefined=saved.undefined,
        keep_trailing_newline=saved.keep_trailing_newline,
    )
    env.filters.update(saved.filters)
    utils.env = env
    try:
        yield
    finally:
        utils.env = saved
