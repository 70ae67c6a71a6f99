"""TrainConfig.keep_every: the checkpoints of its multiples stay, the rest are pruned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moelab.runs.checkpoints import KEEP, list_checkpoints, save_checkpoint
from moelab.train import TrainConfig


def _steps(run: Path) -> list[int]:
    return [int(p.name[5:]) for p in list_checkpoints(run)]


@pytest.mark.parametrize("keep_every", [0, 4])
def test_keep_every_keeps_multiples_and_the_newest(tmp_path: Path, keep_every: int) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 11):
        save_checkpoint(tmp_path, step, model, opt, {"x": 1}, keep_every=keep_every)
    newest = list(range(10 - KEEP + 1, 11))
    if keep_every:
        assert _steps(tmp_path) == sorted({4, 8, *newest})
    else:
        assert _steps(tmp_path) == newest


def test_keep_every_is_checked() -> None:
    with pytest.raises(ValueError, match="keep_every must be >= 0"):
        TrainConfig(keep_every=-1)


def test_keep_every_must_be_a_multiple_of_checkpoint_every() -> None:
    with pytest.raises(ValueError, match="multiple of checkpoint_every = 100"):
        TrainConfig(keep_every=150)
    with pytest.raises(ValueError, match="multiple of checkpoint_every = 0"):
        TrainConfig(keep_every=100, checkpoint_every=0)
    assert TrainConfig(keep_every=300, checkpoint_every=100).keep_every == 300
