"""Checkpoints: model, optimiser, step, RNG states and config, written atomically and
checked by sha256 before they are loaded.

A checkpoint is a folder ``RUN/checkpoints/step_NNNNNNNN/`` holding

    model.safetensors      the model's tensors (safetensors)
    optimizer.safetensors  the optimiser's tensors, flattened as ``state.{param}.{name}``
    rng.safetensors        torch CPU (and CUDA) generator states
    state.json             step, config, optimiser structure (param groups and the
                           non-tensor state), numpy / python RNG states, module extra state
    manifest.json          size and sha256 of each file above; written last

and ``RUN/checkpoints/latest`` names the newest complete one. A checkpoint is written in
a hidden folder ``.step_NNNNNNNN.partial`` (each file flushed and fsynced, the manifest
last) that is renamed to ``step_NNNNNNNN`` once whole, so a kill, a full disk or a
second Ctrl-C at any moment leaves either the whole checkpoint or none: a step folder
exists only complete. The rename, the ``latest`` pointer and the pruning of older
checkpoints run with SIGINT and SIGTERM held back, so no signal lands between them. A
write that fails removes its partial folder and raises :class:`CheckpointWriteError`,
which names the file; the checkpoints before it stay as they were.

A step folder without a manifest (left by a moelab that wrote in place) is an absent
checkpoint: :func:`list_checkpoints` leaves it out. A file that is truncated or
modified afterwards no longer matches the manifest and :func:`load_checkpoint` refuses
it. A load reads and checks only the files it needs: the model's weights need
model.safetensors and state.json, not the optimiser's file (which evaluation can do
without). Model tensors that are not finite are never written (:func:`save_checkpoint`
refuses them), and a checkpoint whose tensors do not fit the model (another shape)
raises CheckpointError naming the tensor, both shapes and the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from moelab._io import json_bytes, write_atomic
from moelab.runs.layout import CHECKPOINTS

FORMAT = "moelab-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
KEEP = 2  # checkpoints kept on disk (the newest ones)

__all__ = [
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointWriteError",
    "ConfigMismatch",
    "checkpoint_extra",
    "checkpoint_folder",
    "checkpoint_step",
    "has_checkpoint",
    "incomplete_checkpoints",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "model_tensors",
    "nonfinite_tensors",
    "read_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted, or does not fit the
    model."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint's tensors do not fit the model built from the run's config.json
    (another shape, missing or unexpected tensors): the files are intact, the settings
    disagree (was config.json edited?). Older checkpoints of the run disagree the same
    way, so none is taken in its place."""


class ConfigMismatch(CheckpointMismatch):
    """A checkpoint does not fit the model because config.json and the settings the
    checkpoint was written with disagree (the message names them): config.json was
    edited. Not damage: no other checkpoint of the run is taken in its place."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (e.g. the disk is full); the message names the
    file. Nothing of it is left behind, and the checkpoints before it are kept."""


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within: SIGINT and SIGTERM wait (blocked at the OS level) and are delivered on
    exit, so a handler that raises cannot land inside the block. Only in the main
    thread, where Python runs signal handlers; elsewhere a plain block."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # NOTE: some platforms cannot open folders; the rename still happened
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ flattening


def model_tensors(
    model: nn.Module | Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict (of a module, or given) split into tensors (for safetensors: on
    the CPU, contiguous) and the rest (module extra state such as a router's top_k),
    which goes to JSON; what a checkpoint's model.safetensors and state.json hold."""
    tensors, extra = {}, {}
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().cpu().contiguous()
        else:
            extra[key] = value
    return tensors, extra


def _optimizer_flat(
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for pid, pstate in sd["state"].items():
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                other.setdefault(str(pid), {})[name] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "other_state": other}


def _optimizer_unflat(tensors: dict[str, torch.Tensor], structure: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, values in structure["other_state"].items():
        state.setdefault(int(pid), {}).update(values)
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()}
        for g in structure["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _rng_states() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, pystate, pygauss = random.getstate()
    other = {
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(pystate), pygauss],
    }
    return tensors, other


def _set_rng_states(tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))
    if cuda and torch.cuda.is_available():
        states = [tensors[k] for k in cuda][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)
    name, keys, pos, has_gauss, gauss = other["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, pystate, pygauss = other["python"]
    random.setstate((version, tuple(pystate), pygauss))


# ------------------------------------------------------------------------------ save


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module | Mapping[str, Any],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_every: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` under ``run_dir/checkpoints`` and point
    ``latest`` at it; keep the newest :data:`KEEP` checkpoints and, with ``keep_every``
    > 0, those of the steps that are multiples of it (``TrainConfig.keep_every``).
    Returns its folder.

    ``model`` is the bare model (unwrap DistributedDataParallel first) or its whole
    state dict, ``optimizer`` the optimiser or its ``state_dict()`` (state keyed by
    parameter index; moelab.train.parallel gathers both under FSDP); ``extra`` is
    stored in state.json (e.g. the data position, running metrics)."""
    root = Path(run_dir) / CHECKPOINTS
    folder = root / f"step_{step:08d}"
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    blobs = _checkpoint_blobs(step, model, optimizer, config, extra)
    partial = root / f".{folder.name}.partial"
    _write_partial(partial, blobs, step)
    with signals_held():  # NOTE: no signal between the rename, the pointer and the pruning
        _publish(Path(run_dir), partial, folder, step, keep_every)
    return folder


def _checkpoint_blobs(
    step: int,
    model: nn.Module | Mapping[str, Any],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    config: dict[str, Any],
    extra: dict[str, Any] | None,
) -> dict[str, bytes]:
    """The bytes of each file of the checkpoint of ``step`` (:data:`FILES`); model
    tensors that are not finite raise CheckpointError."""
    model_t, model_extra = model_tensors(model)
    bad = nonfinite_tensors(model_t)
    if bad:
        raise CheckpointError(
            f"refusing to write the checkpoint of step {step}: model tensors hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); training diverged"
        )
    optim_t, optim_structure = _optimizer_flat(optimizer)
    rng_t, rng_other = _rng_states()
    state = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "config": config,
        "optimizer": optim_structure,
        "rng": rng_other,
        "model_extra_state": model_extra,
        "extra": extra or {},
    }
    return {
        "model.safetensors": st_save(model_t, metadata={"format": FORMAT}),
        "optimizer.safetensors": st_save(optim_t, metadata={"format": FORMAT}),
        "rng.safetensors": st_save(rng_t, metadata={"format": FORMAT}),
        # NOTE: strict JSON: a NaN (extra's val_loss before any evaluation) is null
        "state.json": json_bytes(state),
    }


def _write_partial(partial: Path, blobs: dict[str, bytes], step: int) -> None:
    """Write ``blobs`` and their manifest (last) into the hidden folder ``partial``; on
    any failure remove it (an OSError becomes CheckpointWriteError, naming the file)."""
    try:
        partial.mkdir()
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "files": {},
        }
        for name, data in blobs.items():
            write_atomic(partial / name, data)
            manifest["files"][name] = {
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        # NOTE: the manifest goes last: a checkpoint without one is incomplete, never loaded
        write_atomic(partial / MANIFEST, json_bytes(manifest))
        _fsync_dir(partial)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            where = err.filename or partial
            raise CheckpointWriteError(
                f"the checkpoint of step {step} could not be written ({where}: "
                f"{err.strerror or err}); nothing of it is left and the checkpoints before "
                "it are kept"
            ) from err
        raise


def _publish(run_dir: Path, partial: Path, folder: Path, step: int, keep_every: int = 0) -> None:
    """Rename the whole ``partial`` to its step ``folder``, point ``latest`` at it and
    prune the older checkpoints but the steps that are multiples of ``keep_every`` (the
    caller holds the signals back)."""
    root = folder.parent
    if folder.exists():  # a checkpoint of this step from a trajectory left behind
        _remove_folder(folder)
    os.replace(partial, folder)
    _fsync_dir(root)
    try:
        write_atomic(root / "latest", f"{folder.name}\n".encode())
    except OSError as err:
        # the step folder is whole: a resume finds it among the step folders
        raise CheckpointWriteError(
            f"the checkpoint of step {step} is written, but {err.filename}: "
            f"{err.strerror} (the pointer to the newest checkpoint)"
        ) from err
    _fsync_dir(root)
    old = [p for p in list_checkpoints(run_dir) if p.name < folder.name]
    for p in old[: max(len(old) - (KEEP - 1), 0)]:
        if keep_every > 0 and checkpoint_step(p) % keep_every == 0:
            continue  # kept for good (saturation over training)
        _remove_folder(p)


def _remove_folder(folder: Path) -> None:
    """Delete a checkpoint folder: first renamed to a hidden name (one atomic step, after
    which it is absent), then removed."""
    gone = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """The hidden folders an interrupted write or removal left in ``root``."""
    for p in root.glob(".step_*"):
        if p.is_dir() and (p.name.endswith(".partial") or p.name.endswith(".old")):
            shutil.rmtree(p, ignore_errors=True)


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors in ``tensors`` (on one device) that hold
    a NaN or an infinity: one pass over each, one read of the flags by the host."""
    named = [(name, t) for name, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named])
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]


# ------------------------------------------------------------------------------ load


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder named by ``run_dir/checkpoints/latest``, or None when there is none
    (no pointer, or it names a folder that is gone or has no manifest)."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not (name.startswith("step_") and name[5:].isdigit()):  # NOTE: never a path out
        return None
    folder = root / name
    return folder if (folder / MANIFEST).is_file() else None


def _step_folders(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoint folders of a run, oldest first: those with a manifest (complete
    when written; :func:`verify_checkpoint` checks the files). A step folder without one
    is an absent checkpoint (:func:`incomplete_checkpoints`)."""
    return [p for p in _step_folders(run_dir) if (p / MANIFEST).is_file()]


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run has a checkpoint: the one ``checkpoints/latest`` names or, where
    that pointer is gone, a step folder with a manifest."""
    return latest_checkpoint(run_dir) is not None or bool(list_checkpoints(run_dir))


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Step folders without a manifest: writes a moelab before this one left unfinished
    (this one writes a hidden folder and renames it whole). They are not checkpoints."""
    return [p for p in _step_folders(run_dir) if not (p / MANIFEST).is_file()]


def checkpoint_folder(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (it may not exist)."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def checkpoint_step(folder: str | Path) -> int:
    """The step of the checkpoint in ``folder`` (``step_NNNNNNNN``)."""
    return int(Path(folder).name[5:])


def checkpoint_extra(folder: str | Path) -> dict[str, Any]:
    """The ``extra`` of the checkpoint's state.json (the loss, the data position, ...),
    read as written, without the manifest's check: for what a message says of it,
    never to load it; {} where it cannot be read."""
    try:
        state = json.loads((Path(folder) / "state.json").read_text(encoding="utf-8"))
        extra = state["extra"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return extra if isinstance(extra, dict) else {}


def _verified_bytes(folder: Path, names: tuple[str, ...] = FILES) -> dict[str, bytes]:
    """The bytes of the files ``names``, after checking the manifest and each file's
    size and sha256 against it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} has no {MANIFEST}: it is incomplete (its write was "
            "interrupted) or not a moelab checkpoint, so it is not a checkpoint; use another "
            "step"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt ({e})") from e
    if manifest.get("format") != FORMAT or set(files) != set(FILES):
        raise CheckpointError(f"{manifest_path} is not a {FORMAT} v{VERSION} manifest")
    out = {}
    for name in names:
        info = files[name]
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        data = path.read_bytes()
        if len(data) != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {len(data)} bytes, the "
                f"manifest says {info['bytes']}; it will not be loaded"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupted: sha256 {digest[:16]}... differs from "
                f"the manifest's {info['sha256'][:16]}...; it will not be loaded"
            )
        out[name] = data
    return out


def verify_checkpoint(folder: str | Path) -> None:
    """Check every file of the checkpoint in ``folder`` against its manifest, loading
    nothing. Raises :class:`CheckpointError` as :func:`load_checkpoint` does."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {folder}")
    _verified_bytes(folder)


def check_model_keys(missing: list[str], unexpected: list[str], extra: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointMismatch` when a checkpoint's tensors do not fit a model:
    ``missing`` (less the keys of module extra state, ``extra``) or ``unexpected``
    keys, as ``load_state_dict(strict=False)`` reports them."""
    missing = [k for k in missing if k not in extra]
    if missing or unexpected:
        raise CheckpointMismatch(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; was it written with a different config?"
        )


def check_model_shapes(
    expected: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], source: str | Path
) -> None:
    """Raise :class:`CheckpointMismatch` when a tensor of ``tensors`` (read from ``source``)
    has another shape than the model's tensor of that name (``expected``: the model's
    state dict, or its shapes), instead of ``load_state_dict``'s size-mismatch error."""
    for key, t in tensors.items():
        want = expected.get(key)
        shape = getattr(want, "shape", want)
        if shape is not None and tuple(shape) != tuple(t.shape):
            raise CheckpointMismatch(
                f"{source}: tensor {key} has shape {list(t.shape)}, the model built from "
                f"config.json has {list(shape)}; the checkpoint was written for another "
                "architecture (was config.json edited?)"
            )


def set_extra_states(model: nn.Module, extra: Mapping[str, Any]) -> None:
    """Give each module its extra state (``state.json``'s ``model_extra_state``)."""
    modules = dict(model.named_modules())
    for key, value in extra.items():
        module = modules[key.rsplit(".", 1)[0] if "." in key else ""]
        module.set_extra_state(value)


def _load_model_state(
    model: nn.Module, tensors: dict[str, torch.Tensor], extra: dict, source: str | Path
) -> None:
    check_model_shapes(model.state_dict(), tensors, source)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    check_model_keys(missing, unexpected, extra)
    set_extra_states(model, extra)


def load_checkpoint(
    folder: str | Path,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Verify the checkpoint in ``folder`` and load it into ``model`` / ``optimizer``
    (each optional) and the global RNGs. Returns its state.json (step, config, extra).

    Only the files needed are read and checked: state.json always, model.safetensors
    with ``model``, optimizer.safetensors with ``optimizer``, rng.safetensors with
    ``restore_rng``; so ``load_checkpoint(folder, model, restore_rng=False)`` loads the
    weights of a checkpoint whose optimiser file is gone.

    Raises :class:`CheckpointError` on a missing manifest or file, or a file whose size
    or sha256 differs from the manifest (truncated or corrupted)."""
    state, tensors, optim_sd = read_checkpoint(
        folder, model=model is not None, optimizer=optimizer is not None, restore_rng=restore_rng
    )
    if model is not None:
        assert tensors is not None
        _load_model_state(
            model, tensors, state["model_extra_state"], Path(folder) / "model.safetensors"
        )
    if optimizer is not None:
        optimizer.load_state_dict(optim_sd)
    return state


def read_checkpoint(
    folder: str | Path, *, model: bool = True, optimizer: bool = True, restore_rng: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """Verify and read the checkpoint in ``folder`` without loading it into modules:
    ``(state, model_tensors, optimizer_state_dict)``, the last two None unless asked
    for (``optimizer_state_dict`` as ``Optimizer.state_dict()`` gives it). With
    ``restore_rng`` the global RNGs are set from it. The modules' extra state is
    ``state["model_extra_state"]``. Raises :class:`CheckpointError` as
    :func:`load_checkpoint` does."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {folder}")
    wanted = (model, optimizer, restore_rng, True)
    needed = tuple(name for name, w in zip(FILES, wanted, strict=True) if w)
    blobs = _verified_bytes(folder, needed)
    state = json.loads(blobs["state.json"])
    tensors = st_load(blobs["model.safetensors"]) if model else None
    optim_sd = None
    if optimizer:
        optim_sd = _optimizer_unflat(st_load(blobs["optimizer.safetensors"]), state["optimizer"])
    if restore_rng:
        _set_rng_states(st_load(blobs["rng.safetensors"]), state["rng"])
    return state, tensors, optim_sd
