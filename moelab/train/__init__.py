"""Training: the run config and dotted overrides, the training loop, checkpoints and
data-parallel helpers (``torchrun``)."""

from __future__ import annotations

from moelab.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from moelab.train.config import TrainConfig, apply_overrides
from moelab.train.loop import calibrate_thresholds, lr_at, router_state, routing_numbers, train

__all__ = [
    "CheckpointError",
    "TrainConfig",
    "apply_overrides",
    "calibrate_thresholds",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_at",
    "router_state",
    "routing_numbers",
    "train",
]
