"""Training: the run config and dotted overrides, the training loop, checkpoints and
data-parallel helpers (``torchrun``)."""

from __future__ import annotations

from moelab.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
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
