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
    ``moelab data prepare`` folder); for a run's ``data`` folder or the run folder
    itself, what :func:`data_fix` says (never to start over a run that has
    checkpoints); or write the file again."""
    if (folder / MANIFEST).is_file():
        return f"prepare the data again (moelab data prepare SRC --out {folder} --overwrite)"
    run = folder.parent if folder.name == "data" else folder
    if (run / "tokenizer.json").is_file() or (run / "config.json").is_file():
        return data_fix(run)
    return "write it again"


def checkpoint_folders(run: Path) -> list[Path]:
    """The run's checkpoints, oldest first: its step folders that hold a manifest (the
    rule of moelab.runs.checkpoints.list_checkpoints, which moelab.data does not import)."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "manifest.json").is_file()
    )


def data_fix(run: Path) -> str:
    """What to do about a tokenizer.json or data shard of ``run`` that is damaged or not
    the run's, without losing its work: a run with checkpoints gets its files put back,
    or prepared again by resuming it (train prepares what is missing from the run's
    corpus and checks it against config.json's record); one without a checkpoint has
    nothing to lose, and is started over."""
    if not checkpoint_folders(run):
        return (
            "start the run over with --overwrite (it has no checkpoint yet; if its --data is a "
            "`moelab data prepare` folder, prepare that again first)"
        )
    prepared = ""
    try:
        data = json.loads((run / "config.json").read_text(encoding="utf-8")).get("data")
        if isinstance(data, str) and (Path(data) / MANIFEST).is_file():
            prepared = f" (its --data {data} is a `moelab data prepare` folder: it must be intact)"
    except (OSError, ValueError, AttributeError):
        pass
    return (
        f"put the run's own file back (from a copy of the run), or move {run / 'tokenizer.json'} "
        f"and {run / 'data'} out of the run folder and resume the run (`moelab train` with its "
        f"settings, --out {run} --resume), which prepares both again from its corpus{prepared} "
        "and checks them against what it trained on; its checkpoints are kept"
    )


def config_fix(run: Path) -> str:
    """What to do about a run's config.json that is not its settings: put the run's own
    back (they are in every checkpoint's state.json). Never to start the run over."""
    have = checkpoint_folders(run)
    where = (
        f'{have[-1] / "state.json"} holds the run\'s settings under "config"'
        if have
        else "a copy of the run folder holds it"
    )
    return f"put the run's own config.json back ({where})"


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
