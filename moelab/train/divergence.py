"""When a run has diverged, and what it then says.

A run has diverged when its loss or its weights stop being finite, or when its
training or validation loss goes above :func:`loss_limit` (``2 ln V``). The training
loop (:mod:`moelab.train.loop`) checks the loss of every step on the device, reads it
with the weights at each logged step and before each checkpoint
(:func:`check_finite`), checks each row it writes (:func:`above_limit`) and raises
:class:`TrainingDiverged` (:func:`diverged`: what happened, what is kept, what to try);
no checkpoint of a diverged state is ever written."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from moelab.runs.checkpoints import checkpoint_extra, checkpoint_step, latest_checkpoint

from . import distributed as D
from . import parallel as P
from .checkpointing import local_finite
from .config import TrainConfig

__all__ = [
    "TrainingDiverged",
    "above_limit",
    "check_finite",
    "diverged",
    "kept_checkpoint",
    "loss_limit",
    "too_high",
]


class TrainingDiverged(ValueError):
    """The loss or the weights stopped being finite: training stops before writing a
    checkpoint of them (none is ever written). ``step`` is the first step seen with a
    loss (or weights) that is not finite; the message says what is kept and what to
    try."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def loss_limit(vocab_size: int) -> float:
    """The largest training or validation loss a run may log: ``2 ln V``. A uniform
    guess over the V tokens scores ``ln V`` whatever the text, and a model starts near
    it (small initial logits); a loss above ``2 ln V`` gives the right token a mean
    (geometric) probability below ``1 / V**2``, the square of a guess's: the model has
    diverged and only confident wrong predictions get there. Healthy runs stay far
    below it, their first steps included (they start at ln V)."""
    return 2.0 * math.log(vocab_size)


def kept_checkpoint(run: Path, vocab_size: int | None) -> str:
    """What the diverged message says of the newest checkpoint: kept, with its last
    logged loss, and not as a good one when that loss is above ``ln V``."""
    newest = latest_checkpoint(run)
    if newest is None:
        return "there is no checkpoint"
    step = checkpoint_step(newest)
    loss = checkpoint_extra(newest).get("loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"the newest checkpoint, step {step}, is finite and kept"
    if vocab_size and loss > math.log(vocab_size):
        return (
            f"the newest checkpoint, step {step}, is kept, but its loss {loss:.4g} is above "
            f"ln V = {math.log(vocab_size):.3g} (a uniform guess): no better than guessing, "
            "so not worth resuming"
        )
    return f"the newest checkpoint, step {step} (loss {loss:.4g}), is finite and kept"


def diverged(
    config: TrainConfig, run: Path, step: int, what: str, lr: float, vocab_size: int | None = None
) -> TrainingDiverged:
    """The error of a run that diverged at ``step``: ``what`` happened (it names the
    step), what is kept and what to try."""
    clip = f"grad_clip = {config.grad_clip:g}" if config.grad_clip > 0 else "grad_clip off"
    return TrainingDiverged(
        f"training diverged: {what}, so no checkpoint of it is written; "
        f"{kept_checkpoint(run, vocab_size)}. Try a lower learning rate (lr = {config.lr:g}, "
        f"{lr:g} at that step: --set lr=...) or a tighter gradient clip ({clip}: "
        "--set grad_clip=...) in a new run folder (--out; --overwrite would delete this "
        "run's checkpoints)",
        step,
    )


def too_high(name: str, loss: float, step: int, vocab_size: int) -> str | None:
    """What a diverged message says of ``loss`` (``name`` in the rows) at ``step`` when it
    is above :func:`loss_limit`; None when it is not."""
    limit = loss_limit(vocab_size)
    if not loss > limit or not math.isfinite(loss):
        return None
    return (
        f"the {name.replace('_', ' ')} is {loss:.4g} at step {step}, above 2 ln V = "
        f"{limit:.3g} (ln V = {math.log(vocab_size):.3g}, a uniform guess's loss over the "
        f"{vocab_size} tokens: the model does worse than guessing)"
    )


def check_finite(
    par: P.Parallel, bad_step: torch.Tensor, step: int, config: TrainConfig, run: Path, lr: float
) -> None:
    """Raise TrainingDiverged when any rank saw a loss that is not finite (``bad_step``:
    the first such step, 0 for none) or holds weights that are not after ``step``
    (collective under torchrun: every rank raises alike)."""
    info = par.info
    local_bad = int(bad_step)
    weights_bad = not local_finite(par)
    if not D.max_over_ranks(int(bool(local_bad) or weights_bad), info):
        return
    big = 1 << 62
    first = -D.max_over_ranks(-(local_bad or big), info)
    vocab = par.model.config.vocab_size
    if first < big:
        raise diverged(config, run, first, f"the loss is not finite at step {first}", lr, vocab)
    raise diverged(config, run, step, f"the weights hold NaN or inf at step {step}", lr, vocab)


def above_limit(row: dict[str, Any], vocab_size: int) -> str | None:
    """What the diverged message says when the loss or the validation loss of ``row`` is
    above :func:`loss_limit` (a warning of the row then says it too); None when
    neither is."""
    step = row["step"]
    what = too_high("loss", row.get("loss", math.nan), step, vocab_size) or too_high(
        "val_loss", row.get("val_loss", math.nan), step, vocab_size
    )
    if what is not None:
        row.setdefault("warnings", []).append(f"warning: training diverged: {what}")
    return what
