"""A run's settings read back: ``RUN/config.json`` (written by moelab.train.run_folder:
the TrainConfig, its model resolved, the thread count, ``run_info``), checked to be what
:meth:`TrainConfig.from_dict` reads, with errors in one line that name the file and the
field and say how to restore it (:func:`read_config`); and where it disagrees with the
settings a checkpoint was written with (:func:`mismatch_error`)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from moelab.data import config_fix
from moelab.model import ModelConfig
from moelab.routing.config import RouterConfig
from moelab.runs.checkpoints import ConfigMismatch
from moelab.runs.layout import CONFIG
from moelab.train.config import TrainConfig

__all__ = ["flat", "mismatch_error", "model_disagreement", "read_config"]


def flat(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``d`` with its nested objects spelled out as dotted keys under ``prefix``
    (``{"router": {"map": ..}}`` -> ``{"PREFIX" + "router.map": ..}``), tuples as lists."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def _expected(hint: Any) -> str:
    """What a type hint of a config field asks for, in JSON's words."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_expected(a) for a in typing.get_args(hint))
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin is tuple and args and Ellipsis not in args:
        return f"an array of {len(args)} ({', '.join(_expected(a) for a in args)})"
    words = {
        bool: "true or false",
        int: "a whole number",
        float: "a number",
        str: "a string",
        type(None): "null",
        dict: "an object",
        list: "an array",
        tuple: "an array",
    }
    return words.get(origin, str(hint))


def _fits(value: Any, hint: Any) -> bool:
    """Whether the JSON ``value`` is of the type ``hint`` (a dataclass field's: int,
    float, bool, str, None, unions of them, dict, list and tuple of them)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) is dict:
        return isinstance(value, dict)
    if (origin or hint) in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and Ellipsis not in args:
            return len(value) == len(args) and all(map(_fits, value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    return True


def _type_problems(saved: dict[str, Any]) -> list[str]:
    """The fields of a config.json whose JSON type is not the one its TrainConfig,
    ModelConfig (``model``) or RouterConfig (``model.router``) field takes (a
    :meth:`TrainConfig.from_dict` of them fails far from the file, or not at all)."""

    def check(d: dict[str, Any], cls: type, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        out = []
        for key, value in d.items():
            if key == "log" and isinstance(value, str):
                continue  # NOTE: TrainConfig splits a comma-separated string of sinks
            if key in names and not _fits(value, hints[key]):
                out.append(f"{prefix}{key} is {json.dumps(value)}, not {_expected(hints[key])}")
        return out

    problems = check(saved, TrainConfig, "")
    if not problems and isinstance(saved.get("model"), dict):
        model = saved["model"]
        problems = check(model, ModelConfig, "model.")
        if not problems and isinstance(model.get("router"), dict):
            problems = check(model["router"], RouterConfig, "model.router.")
    info = saved.get("run_info")
    if info is not None and not isinstance(info, dict):
        problems.append(f"run_info is {json.dumps(info)}, not an object")
    elif isinstance(info, dict) and not isinstance(info.get("resumes", []), list):
        problems.append(f"run_info.resumes is {json.dumps(info['resumes'])}, not an array")
    return problems


def read_config(run: str | Path) -> dict[str, Any]:
    """``run/config.json`` as a dict that :meth:`TrainConfig.from_dict` reads (checked
    by reading it so), for every command that reads a run folder back. Raises
    ValueError in one line that names the file and the field, and says how to restore
    it, when the file is not UTF-8 JSON, not an object (``[1, 2]``, ``null``), a field
    has the wrong JSON type (``"n_experts": "8"``, ``"router": 3``) or value;
    FileNotFoundError when it is missing."""
    run = Path(run)
    path = run / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{run} is not a moelab run folder (no config.json)")
    fix = config_fix(run)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        what = " ".join(str(err).split())
        raise ValueError(f"{path} is not valid JSON ({what}); {fix}") from None
    if not isinstance(saved, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(saved), "a number")
        what = "null" if saved is None else f"{kind} ({json.dumps(saved)[:40]})"
        raise ValueError(f"{path} holds {what}, not an object of the run's settings; {fix}")
    problems = _type_problems(saved)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems[:3])}; {fix}")
    try:
        TrainConfig.from_dict(saved)
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        what = " ".join(str(err).split())
        raise ValueError(f"{path} is not a valid run config ({what}); {fix}") from None
    return saved


def model_disagreement(run: Path, folder: Path) -> list[str]:
    """The model settings on which ``run``'s config.json and the checkpoint in
    ``folder`` (the settings its state.json holds under ``"config"``) disagree, as
    ``"model.n_experts: 4 in config.json, 8 in the checkpoint"``; [] where they agree
    or either cannot be read."""
    try:
        saved = read_config(run)
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        vocab = (saved.get("model") or {}).get("vocab_size")
        ours = flat(TrainConfig.from_dict(saved).resolved_model(vocab), "model.")
        # NOTE: the settings as training held them (TrainConfig.to_dict), built as it
        # built them: not from_dict, whose fill-in of router keys an older moelab left
        # out would differ from config.json's resolved values
        fields = {k: v for k, v in state["config"].items() if k not in ("run_info", "calibrated")}
        theirs = flat(TrainConfig(**fields).resolved_model(vocab), "model.")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []
    return [
        f"{key}: {ours.get(key)!r} in config.json, {theirs.get(key)!r} in the checkpoint"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]


def mismatch_error(run: Path, folder: Path) -> ConfigMismatch | None:
    """The error for a checkpoint whose tensors do not fit the model built from
    config.json, where config.json and the settings the checkpoint was written with
    (its state.json) disagree: those settings, both values, and how to put config.json
    right. Not "damaged": its files are intact, and every other checkpoint of the run
    disagrees the same way. None where the settings agree (the checkpoint's tensors
    then fit not even its own settings: it was altered, and is damaged as any other)."""
    diff = model_disagreement(run, folder)
    if not diff:
        return None
    return ConfigMismatch(
        f"{run / 'config.json'} and the checkpoint {folder} disagree on the model "
        f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}): config.json was changed "
        "after the checkpoint was written; put back the values the run trained with "
        f'({folder / "state.json"} holds them under "config"); the checkpoint itself is intact'
    )
