"""Checkpoints during training (the format: moelab.runs.checkpoints):
:class:`Checkpointing` decides when (``should_save(step)``: every ``checkpoint_every``
steps and after the last; the loop also saves on a stop) and writes them
(:func:`_save`: the state gathered to rank 0); :func:`restore_checkpoint` loads the one
a resumed run continues from, skipping damaged ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moelab.runs.checkpoints import (
    CheckpointError,
    CheckpointMismatch,
    CheckpointWriteError,
    checkpoint_folder,
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    nonfinite_tensors,
    read_checkpoint,
    save_checkpoint,
)
from moelab.runs.config import mismatch_error
from moelab.runs.weights import steps_text

from . import distributed as D
from . import parallel as P
from .config import TrainConfig
from .run_folder import resume_command, say_main


def _load(folder: Path, par: P.Parallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint in ``folder`` into the model (as ``par`` holds it), the
    optimiser and the RNGs; return its state.json. A checkpoint whose weights are not
    finite (written by a moelab that did not check) raises CheckpointError."""
    state, tensors, optim_sd = read_checkpoint(folder)
    par.load_full_state(
        optimizer, tensors, state["model_extra_state"], optim_sd, folder / "model.safetensors"
    )
    if not finite_weights(par):
        raise CheckpointError(
            f"checkpoint {folder} holds weights that are NaN or infinite (the run had "
            "diverged when a moelab that did not check wrote it)"
        )
    return state


def local_finite(par: P.Parallel) -> bool:
    """Whether this rank's parameters (its shards under FSDP) are all finite."""
    local = {
        name: p.detach().to_local() if hasattr(p, "to_local") else p.detach()  # a DTensor's shard
        for name, p in par.model.named_parameters()
    }
    return not nonfinite_tensors(local)


def finite_weights(par: P.Parallel) -> bool:
    """Whether every rank's parameters are finite (collective under torchrun)."""
    return not D.max_over_ranks(0 if local_finite(par) else 1, par.info)


def _save(
    par: P.Parallel,
    run: Path,
    step: int,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    extra: dict[str, Any],
) -> None:
    """The checkpoint of ``step``: the whole state gathered to rank 0 (collective under
    FSDP: every rank calls this), which writes it. A write that fails (a full disk)
    raises CheckpointWriteError, which says how to resume once it is fixed."""
    model_sd, optim_sd = par.full_state(optimizer)
    if par.info.is_main:
        assert model_sd is not None and optim_sd is not None
        try:
            save_checkpoint(
                run, step, model_sd, optim_sd, config.to_dict(), extra, config.keep_every
            )
        except CheckpointWriteError as err:
            raise CheckpointWriteError(
                f"{err}; free space (or fix the cause), then resume with: {resume_command(config)}"
            ) from err


def restore_checkpoint(
    run: Path,
    par: P.Parallel,
    optimizer: torch.optim.Optimizer,
    resume_from: int | None,
    info: D.DistInfo,
) -> dict[str, Any] | None:
    """Load the checkpoint a resumed run continues from (model, optimiser, RNGs) and
    return its state.json; None when the run has no checkpoint yet.

    ``resume_from``: that step's checkpoint. Otherwise the newest (``latest``); when it
    is damaged (truncated, altered) or its weights are not finite, the newest older one
    that is intact and finite, with a warning. One that config.json does not fit because
    the two disagree on the model (config.json was edited) is refused at once, naming
    the settings (:func:`moelab.runs.config.mismatch_error`): every older one would
    disagree the same way. A step folder without a manifest (a write that was
    interrupted) is no checkpoint at all: a run whose only checkpoint write was cut short
    starts again from step 0."""
    for folder in incomplete_checkpoints(run):
        say_main(
            info,
            f"note: {folder} has no manifest (its write was interrupted), so it is no "
            "checkpoint; it is left as it is",
        )
    if resume_from is not None:
        folder = checkpoint_folder(run, resume_from)
        have = list_checkpoints(run)
        if folder not in have:
            steps = steps_text(have)
            raise ValueError(
                f"{run} has no checkpoint of step {resume_from} (steps it has: {steps})"
            )
        try:
            return _load(folder, par, optimizer)
        except CheckpointMismatch as err:
            raise mismatch_error(run, folder) or err from None
    newest = latest_checkpoint(run)
    older = [p for p in reversed(list_checkpoints(run)) if newest is None or p.name < newest.name]
    failures: list[str] = []
    for folder in ([newest] if newest is not None else []) + older:
        try:
            state = _load(folder, par, optimizer)
        except CheckpointError as err:
            # NOTE: config.json disagrees with it, and so with every older one: not damage
            explained = mismatch_error(run, folder) if isinstance(err, CheckpointMismatch) else None
            if explained is not None:
                raise explained from None
            failures.append(str(err))
            continue
        if failures:
            say_main(
                info,
                "warning: skipped "
                + (
                    "a damaged checkpoint"
                    if len(failures) == 1
                    else f"{len(failures)} damaged checkpoints"
                )
                + f" ({'; '.join(failures)}); resuming from {folder.name}, the newest intact one",
            )
        return state
    if failures:
        raise CheckpointError(
            f"no intact checkpoint in {run}: {'; '.join(failures)}; restore the checkpoints "
            "from a copy of the run, or train a new run in another folder (--out)"
        )
    return None


class Checkpointing:
    """The checkpoints of steps ``start`` to ``end``: when (:meth:`should_save`: every
    ``checkpoint_every`` steps and after the last) and the write (:meth:`save`,
    collective under FSDP: every rank calls it)."""

    def __init__(
        self,
        par: P.Parallel,
        run: Path,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        end: int,
    ) -> None:
        self.par, self.run, self.optimizer, self.config, self.end = par, run, optimizer, config, end

    def should_save(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` is written as the steps go (a stop writes one
        too)."""
        every = self.config.checkpoint_every
        return bool((every and step % every == 0) or step == self.end)

    def save(self, step: int, extra: dict[str, Any]) -> None:
        """The checkpoint of ``step`` (:func:`_save`)."""
        _save(self.par, self.run, step, self.optimizer, self.config, extra)
