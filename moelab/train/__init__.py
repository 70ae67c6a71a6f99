"""Training: the run config and dotted overrides, the training loop, checkpoints and
data-parallel helpers (``torchrun``).

The names below are imported on first use (PEP 562), so that importing one module of
the package (``moelab.train.config``: the run's settings, which moelab.runs reads
config.json with) does not load the training loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moelab._lazy import lazy_names

if TYPE_CHECKING:
    from moelab.runs.checkpoints import CheckpointError, latest_checkpoint, load_checkpoint
    from moelab.train.config import TrainConfig, apply_overrides
    from moelab.train.divergence import TrainingDiverged
    from moelab.train.loop import (
        TrainingAborted,
        TrainingInterrupted,
        calibrate_thresholds,
        lr_at,
        resume_command,
        router_state,
        routing_numbers,
        train,
    )
    from moelab.train.threads import default_threads, use_threads

__all__ = [
    "CheckpointError",
    "TrainConfig",
    "TrainingAborted",
    "TrainingDiverged",
    "TrainingInterrupted",
    "apply_overrides",
    "calibrate_thresholds",
    "default_threads",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_at",
    "resume_command",
    "router_state",
    "routing_numbers",
    "train",
    "use_threads",
]

_LAZY = {
    "CheckpointError": "moelab.runs.checkpoints",
    "latest_checkpoint": "moelab.runs.checkpoints",
    "load_checkpoint": "moelab.runs.checkpoints",
    "TrainConfig": "moelab.train.config",
    "apply_overrides": "moelab.train.config",
    "TrainingDiverged": "moelab.train.divergence",
    "TrainingAborted": "moelab.train.loop",
    "TrainingInterrupted": "moelab.train.loop",
    "calibrate_thresholds": "moelab.train.loop",
    "lr_at": "moelab.train.loop",
    "resume_command": "moelab.train.loop",
    "router_state": "moelab.train.loop",
    "routing_numbers": "moelab.train.loop",
    "train": "moelab.train.loop",
    "default_threads": "moelab.train.threads",
    "use_threads": "moelab.train.threads",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
