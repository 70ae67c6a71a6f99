"""moelab.runs.checkpoints: the checkpoints kept (the newest, and the multiples of
``keep_every``), and model tensors that are not finite never written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moelab.runs.checkpoints import (
    KEEP,
    CheckpointError,
    checkpoint_extra,
    checkpoint_step,
    list_checkpoints,
    save_checkpoint,
)


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


def test_a_nonfinite_checkpoint_is_never_written(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"hold NaN or inf \(weight\)"):
        save_checkpoint(tmp_path, 1, model, opt, {})
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_checkpoints_step_and_extra(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = save_checkpoint(tmp_path, 12, model, opt, {"x": 1}, extra={"loss": float("nan")})
    assert checkpoint_step(folder) == 12
    assert checkpoint_extra(folder) == {"loss": None}  # strict JSON: NaN is null
    (folder / "state.json").write_text("[1]")
    assert checkpoint_extra(folder) == {} and checkpoint_extra(tmp_path / "nowhere") == {}
