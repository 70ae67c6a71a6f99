"""What moelab reads from a Hugging Face model folder, checked before transformers is
called (:func:`check_folder`).

moelab never runs a folder's code and reads only formats that cannot run code:

- ``config.json`` and ``tokenizer_config.json`` are JSON. An ``auto_map`` in either
  (at any depth) names Python files that transformers would import (a custom
  configuration, model or tokenizer class): the folder is refused unless
  ``trust_remote_code`` (``--trust-remote-code``) is given. Every loader is also passed
  ``trust_remote_code`` explicitly, so transformers never asks on stdin.
- Weights: safetensors only (``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` names, each a plain relative path inside the folder,
  ending in ``.safetensors``); the model is loaded with ``use_safetensors=True``. A
  folder with pickle weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``) and
  no safetensors is refused before anything is opened: unpickling can run code.
- Tokenizer: ``tokenizer.json`` (the tokenizers library's JSON); a folder without one is
  refused (a slow tokenizer reads other vocabulary files). The file names that
  ``tokenizer_config.json`` gives in ``fast_tokenizer_files`` must stay inside the folder.
- ``adapter_config.json`` (a PEFT adapter, whose weights and base model transformers
  loads from the paths it names when peft is installed) is refused: moelab reads full
  model folders.

Every refusal is a ValueError of one line naming the folder and the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

__all__ = ["PICKLE_SUFFIXES", "TRUST_FLAG", "check_folder", "inside", "read_json"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight files in a pickle format (torch.save), never read."""

TRUST_FLAG = "--trust-remote-code"
"""The command-line flag that lets a folder's code run."""


def not_utf8(path: Path, err: UnicodeDecodeError | None = None) -> str:
    """``"PATH is not UTF-8 text (byte 0x.. at offset N)"``: the first byte of ``path``
    that does not decode (read again in pieces, so the offset is the file's, not a
    decoder buffer's); ``err``'s byte when the file no longer fails."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    try:
        with path.open("rb") as f:
            while piece := f.read(1 << 20):
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(piece)
                except UnicodeDecodeError as bad:
                    byte, at = bad.object[bad.start], done - pending + bad.start
                    return f"{path} is not UTF-8 text (byte 0x{byte:02x} at offset {at})"
                done += len(piece)
            pending = len(decoder.getstate()[0])
            if pending:
                return f"{path} is not UTF-8 text (it ends inside a character)"
    except OSError:
        pass
    byte = f" (byte 0x{err.object[err.start]:02x})" if err is not None else ""
    return f"{path} is not UTF-8 text{byte}"


def first_not_utf8(
    folder: Path, suffixes: tuple[str, ...] = (".json", ".txt", ".jinja")
) -> str | None:
    """:func:`not_utf8` of the first file of ``folder`` (its top level, sorted) with one of
    ``suffixes`` that is not UTF-8, or None."""
    for path in sorted(folder.iterdir()):
        if path.suffix in suffixes and path.is_file():
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                return not_utf8(path, err)
            except OSError:
                continue
    return None


UTF8_HINT = "transformers reads it as UTF-8: save it again as UTF-8"
"""What to do about a file of the folder that is not UTF-8."""


def read_json(path: Path, where: str) -> Any:
    """The JSON document of ``path``; ValueError naming ``where`` and the file when it is
    not UTF-8 or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: {not_utf8(path, err)}; {UTF8_HINT}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {path.name} is not valid JSON ({err})") from None


def inside(name: Any) -> bool:
    """Whether the file name ``name`` (as written in a file of the folder) stays inside
    the folder: a non-empty relative path without ``..``, on POSIX and on Windows."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return False
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return False
    return True


def _auto_maps(doc: Any, at: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``auto_map`` of the JSON document ``doc`` (nested configs included)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "auto_map" and value:
                yield at, value
            else:
                yield from _auto_maps(value, f"{at}{key}.")
    elif isinstance(doc, list):
        for value in doc:
            yield from _auto_maps(value, at)


def _describe(auto_map: Any) -> str:
    if isinstance(auto_map, dict):
        text = ", ".join(f"{k}: {v}" for k, v in auto_map.items())
    else:
        text = str(auto_map)
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def _native_hint(config: Any) -> str:
    """A way out for a folder whose model type transformers implements itself."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return ""
    from moelab.integrations.hf.families import import_transformers

    try:
        import_transformers()  # the offline switches first
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return ""
    if model_type not in CONFIG_MAPPING_NAMES:
        return ""
    return (
        f"; transformers has its own {model_type!r} code: delete auto_map from config.json "
        "to load the folder with that instead"
    )


def check_code(path: Path, where: str, config: Any, trust_remote_code: bool) -> None:
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        file = path / name
        if name == "config.json":
            doc = config
        else:
            doc = read_json(file, where) if file.is_file() else {}
        for at, auto_map in _auto_maps(doc):
            hint = _native_hint(config) if name == "config.json" else ""
            raise ValueError(
                f"{where}: {name} names custom code ({at}auto_map: {_describe(auto_map)}); "
                f"moelab does not run a model folder's code unless you pass {TRUST_FLAG} "
                f"(it runs that Python with your permissions){hint}"
            )


def check_weights(path: Path, where: str) -> None:
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        return
    if index.is_file():
        doc = read_json(index, where)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{where}: {index.name} has no weight_map of shard files")
        for shard in sorted(set(map(str, weight_map.values()))):
            if not inside(shard):
                raise ValueError(
                    f"{where}: {index.name} names the shard {shard!r}, not a file inside the "
                    "folder; moelab reads only the folder's own files"
                )
            if not shard.endswith(".safetensors"):
                raise ValueError(
                    f"{where}: {index.name} names the shard {shard!r}, not a .safetensors "
                    "file; moelab reads safetensors weights only"
                )
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        raise ValueError(
            f"{where}: the weights are a pickle ({shown}) and there is no model.safetensors; "
            "moelab reads safetensors weights only (unpickling a file can run code): convert "
            "them where you trust the file (model.save_pretrained(DIR) writes safetensors)"
        )
    raise ValueError(
        f"{where}: no model.safetensors (or model.safetensors.index.json) there; give a "
        "folder saved with save_pretrained (moelab reads safetensors weights only)"
    )


def _check_tokenizer(path: Path, where: str) -> None:
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"{where}: no tokenizer there (no tokenizer.json; moelab reads a tokenizer from "
            "tokenizer.json only, not a slow tokenizer's vocabulary files); save the "
            "tokenizer beside the model (tokenizer.save_pretrained(DIR) of a fast tokenizer)"
        )
    file = path / "tokenizer_config.json"
    doc = read_json(file, where) if file.is_file() else {}
    names = doc.get("fast_tokenizer_files") if isinstance(doc, dict) else None
    if names is None:
        return
    for name in names if isinstance(names, list) else [names]:
        if not inside(name):
            raise ValueError(
                f"{where}: tokenizer_config.json names {name!r} in fast_tokenizer_files, "
                "not a file inside the folder; moelab reads only the folder's own files"
            )


def check_folder(model_dir: str | Path, trust_remote_code: bool = False) -> None:
    """Refuse (ValueError, one line) a model folder that moelab would not read (see the
    module docstring): no folder or config.json, custom code named by an ``auto_map``
    unless ``trust_remote_code``, pickle weights without safetensors, a file named
    outside the folder, no tokenizer.json, a PEFT adapter. Reads the folder's JSON
    files only; nothing of transformers runs."""
    path = Path(model_dir)
    where = f"--hf {model_dir}"
    if not path.is_dir():
        raise ValueError(
            f"{where}: no such directory; give a local folder saved with "
            "save_pretrained (config.json, weights, tokenizer); nothing is downloaded"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{where}: no config.json there; give a folder saved with "
            "save_pretrained (model and tokenizer)"
        )
    config = read_json(path / "config.json", where)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config.json is not a JSON object")
    check_code(path, where, config, trust_remote_code)
    if (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{where}: adapter_config.json names a PEFT adapter, whose files transformers "
            "would load from the paths it gives; moelab reads full model folders only "
            "(merge the adapter and save_pretrained the model)"
        )
    check_weights(path, where)
    _check_tokenizer(path, where)
