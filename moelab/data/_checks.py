"""Reading moelab's data files without believing them: JSON that fails in one line
naming the file, typed fields, names that stay in their folder, and the advice of what
to do about a bad file.

Everything here reads JSON (strict: ``NaN`` and ``Infinity`` are refused) or plain
bytes; nothing in ``moelab.data`` unpickles or evaluates what a file holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "prepare.json"  # NOTE: prepare.MANIFEST; here so that shards.py need not import it


def remedy(folder: Path) -> str:
    """What to do about a bad data file in ``folder``: prepare the data again (a
    ``moelab data prepare`` folder), start the run over (a run's ``data`` folder or
    the run folder itself), or write the file again."""
    if (folder / MANIFEST).is_file():
        return f"prepare the data again (moelab data prepare SRC --out {folder} --overwrite)"
    run = folder.parent if folder.name == "data" else folder
    if (run / "tokenizer.json").is_file() or (run / "config.json").is_file():
        return (
            "start the run over with --overwrite (if its --data is a `moelab data prepare` "
            "folder, prepare that again first)"
        )
    return "write it again"


def one_line(text: object) -> str:
    """``text`` on one line (a library's message may span several)."""
    return " ".join(str(text).split())


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``what``, for the message); ``ValueError`` in one
    line naming the file when it is not UTF-8, not strict JSON, or not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not UTF-8 text, so not a {what}; {remedy(path.parent)}"
        ) from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, NaN / Infinity, too deep
        raise ValueError(
            f"{path} is not valid JSON ({one_line(e)}): the {what} is truncated or damaged; "
            f"{remedy(path.parent)}"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path} holds a JSON {type(obj).__name__}, not the object of a {what}; "
            f"{remedy(path.parent)}"
        )
    return obj


def int_field(
    obj: dict[str, Any], key: str, path: Path, low: int = 0, high: int | None = None
) -> int:
    """``obj[key]`` as an int in [low, high) (``high`` None: no bound); ``ValueError``
    naming ``path`` when it is missing, not a whole number (``true`` is not) or out of
    range."""
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: {key} is {value!r}, not a whole number; {remedy(path.parent)}")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{path}: {key} = {value} is not in {bound}; {remedy(path.parent)}")
    return value


def plain_name(value: Any, key: str, path: Path) -> str:
    """``value`` when it names a file or folder directly in ``path``'s folder: a
    non-empty string without path separators, NUL, ``.`` or ``..``; else
    ``ValueError`` naming ``path`` (a data file must not send moelab elsewhere)."""
    if not isinstance(value, str) or value in ("", ".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(
            f"{path}: {key} {value!r} is not a plain name of a file in {path.parent} (a data "
            f"file may name only files beside it); {remedy(path.parent)}"
        )
    return value


def inside(target: Path, folder: Path) -> bool:
    """Whether ``target``, links resolved, lies in ``folder`` (links resolved)."""
    return target.resolve().is_relative_to(folder.resolve())
