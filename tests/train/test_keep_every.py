"""TrainConfig.keep_every: checked against checkpoint_every (that the checkpoints of its
multiples stay, the rest are pruned: tests/runs/test_checkpoints.py)."""

from __future__ import annotations

import pytest

from moelab.train import TrainConfig


def test_keep_every_is_checked() -> None:
    with pytest.raises(ValueError, match="keep_every must be >= 0"):
        TrainConfig(keep_every=-1)


def test_keep_every_must_be_a_multiple_of_checkpoint_every() -> None:
    with pytest.raises(ValueError, match="multiple of checkpoint_every = 100"):
        TrainConfig(keep_every=150)
    with pytest.raises(ValueError, match="multiple of checkpoint_every = 0"):
        TrainConfig(keep_every=100, checkpoint_every=0)
    assert TrainConfig(keep_every=300, checkpoint_every=100).keep_every == 300
