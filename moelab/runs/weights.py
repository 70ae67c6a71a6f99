"""A run's weights read back: the checkpoint of a step (:func:`step_folder`), and the
choice of the checkpoint a model is loaded from (:func:`load_weights`): the one asked
for, else the newest that ``checkpoints/latest`` names or, where that pointer is gone,
the newest step folder that loads; an older one is never taken unasked in place of a
damaged one (its results would be another model's)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from moelab.runs.checkpoints import (
    CheckpointError,
    CheckpointMismatch,
    ConfigMismatch,
    checkpoint_folder,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from moelab.runs.config import mismatch_error

__all__ = ["load_weights", "step_folder", "steps_text"]


def steps_text(folders: Sequence[Path]) -> str:
    """The steps of checkpoint ``folders``, as the messages list them ("2, 4"; "none")."""
    return ", ".join(str(checkpoint_step(p)) for p in folders) or "none"


def step_folder(run_dir: str | Path, step: int) -> Path:
    """The checkpoint folder of ``step`` in ``run_dir``; FileNotFoundError, listing the
    steps the run has, when there is none (checked without reading it)."""
    folder = checkpoint_folder(run_dir, step)
    if not folder.is_dir():
        have = steps_text(list_checkpoints(run_dir))
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint of step {step} (steps it has: {have})"
        )
    return folder


def load_weights(run: Path, model: nn.Module, step: int | None) -> dict[str, Any]:
    """Load the checkpoint of ``step`` into ``model``, or the newest one: the folder
    ``checkpoints/latest`` names or, where that pointer is gone, the newest step folder
    that loads. Returns its state.json.

    Raises:
        FileNotFoundError: no checkpoint of ``step`` (the message lists the steps there).
        ConfigMismatch: the checkpoint's tensors do not fit the model built from
            config.json (config.json was edited): the settings that disagree and both
            values (:func:`moelab.runs.config.mismatch_error`); no older step is
            offered, since each disagrees the same way.
        CheckpointError: the checkpoint asked for, or the one ``latest`` names, is damaged;
            the message names it and the intact older steps to pass as ``step``
            (``--step N``). An older checkpoint is never taken in its place unasked: its
            results would be another model's.
    """
    folders = list_checkpoints(run)

    def load(folder: Path) -> dict[str, Any]:
        try:
            return load_checkpoint(folder, model, restore_rng=False)
        except CheckpointMismatch as err:
            # NOTE: config.json edited: said as such, and no older step offered
            raise mismatch_error(run, folder) or err from None

    if step is not None:
        return load(step_folder(run, step))
    newest = latest_checkpoint(run)
    if newest is None:  # the pointer is gone: the newest step folder that loads
        for folder in reversed(folders):
            try:
                return load(folder)
            except ConfigMismatch:
                raise
            except CheckpointError:
                continue
        raise CheckpointError(
            f"{run} has no checkpoints/latest and none of its step folders ({steps_text(folders)}) "
            "holds an intact checkpoint"
        )
    try:
        return load(newest)
    except CheckpointError as err:
        if isinstance(err, ConfigMismatch):
            raise
        older = []
        for folder in reversed([f for f in folders if f.name < newest.name]):
            try:
                verify_checkpoint(folder)
                older.append(folder)
            except CheckpointError:
                continue
        hint = (
            f"intact older checkpoints: steps {steps_text(older[::-1])}; pass --step "
            f"{checkpoint_step(older[0])} (step=) to use one"
            if older
            else "no older checkpoint is intact"
        )
        raise CheckpointError(f"the newest checkpoint {newest} is damaged ({err}); {hint}") from err
