"""What a run records about the settings it actually ran with, where they differ from
the ones it was given.

* Prepared data (a ``moelab data prepare`` folder as ``TrainConfig.data``) brings its
  own tokenizer and validation split, so the run's ``vocab_size`` and ``val_fraction``
  are the folder's (:func:`with_prepared_settings`); ``moelab train`` refuses a
  ``--set`` of either that contradicts the folder (:func:`refuse_prepared_overrides`).
* A selection rule that calibrates its cut on p (``router.selection = "threshold"``)
  replaces ``router.truncation`` by a cut per MoE layer, set on the first training
  batches (``TrainConfig.calibrate_batches``). config.json keeps the requested value
  in ``model.router.truncation`` (the setting a resume compares) and records the cuts
  the run routes with under ``"calibrated"`` (:func:`calibration_record`); summary.json
  and the summary ``moelab train`` prints hold the same record. The checkpoints carry
  the cuts too (the routers' extra state), so eval, stats and a resumed run route
  with them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .config import TrainConfig

__all__ = [
    "CALIBRATED",
    "PREPARED_KEYS",
    "calibration_record",
    "prepared_settings",
    "refuse_prepared_overrides",
    "with_prepared_settings",
]

PREPARED_KEYS = ("vocab_size", "val_fraction")
"""TrainConfig fields that a prepared folder fixes (its tokenizer, its split)."""

CALIBRATED = "calibrated"
"""The key of config.json and summary.json that holds :func:`calibration_record`."""

_PREPARE_FLAGS = {"vocab_size": "--vocab-size", "val_fraction": "--val-fraction"}


def prepared_settings(data: str | Path | None) -> dict[str, Any] | None:
    """``{"vocab_size": ..., "val_fraction": ...}`` of the prepared folder ``data`` (its
    tokenizer's vocabulary size and its validation share, from ``prepare.json``); None
    when ``data`` is not a ``moelab data prepare`` folder."""
    from moelab.data.prepare import MANIFEST, is_prepared

    if not is_prepared(data):
        return None
    assert data is not None
    manifest = json.loads((Path(data) / MANIFEST).read_text(encoding="utf-8"))
    kinds = {"vocab_size": int, "val_fraction": float}
    return {key: kinds[key](manifest[key]) for key in PREPARED_KEYS if key in manifest}


def with_prepared_settings(
    config: TrainConfig, say: Callable[[str], None] | None = None
) -> TrainConfig:
    """``config`` with the ``vocab_size`` and ``val_fraction`` of its prepared data (the
    values the run trains with, hence those config.json records); ``config`` itself
    when ``config.data`` is not prepared. A value that differs from the folder's and
    from the field's default was asked for: ``say`` gets one line telling so."""
    fixed = prepared_settings(config.data)
    if not fixed:
        return config
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key, value in fixed.items():
        given = getattr(config, key)
        if say is not None and given != value and given != defaults[key]:
            say(
                f"warning: {key} = {given} does not apply to the prepared data {config.data} "
                f"(it was prepared with {key} = {value}); the run uses and records {value}"
            )
    return dataclasses.replace(config, **fixed)


def refuse_prepared_overrides(config: TrainConfig, overrides: Iterable[str]) -> None:
    """Raise ValueError when an override of ``overrides`` (``KEY=VALUE`` texts, as
    ``moelab train --set`` takes them) sets ``vocab_size`` or ``val_fraction`` to a
    value that the prepared data of ``config.data`` contradicts: the run would train
    with the folder's."""
    fixed = prepared_settings(config.data)
    if not fixed:
        return
    given = {item.partition("=")[0].strip() for item in overrides}
    for key, value in fixed.items():
        if key in given and getattr(config, key) != value:
            raise ValueError(
                f"--set {key}={getattr(config, key)} contradicts --data {config.data}, "
                f"prepared with {key} = {value} (its own tokenizer and split); drop "
                f"--set {key}, or prepare the corpus again with `moelab data prepare "
                f"{_PREPARE_FLAGS[key]} {getattr(config, key)}`"
            )


def calibration_record(model: Any, config: TrainConfig) -> dict[str, Any] | None:
    """What calibration set in ``model`` (a moelab Transformer), None when the run does
    not calibrate (no rule that ``calibrates``, or ``calibrate_batches = 0``):

    * ``"truncation_layers"``: each MoE layer's ``Router.truncation``, the cut on p it
      routes with (with ``router.truncation_relative`` in units of k / E, as the
      setting);
    * ``"requested_truncation"``: ``router.truncation`` as configured, which the cuts
      replaced;
    * ``"batches"``: the training batches they were calibrated on."""
    routers = [layer.router for layer in model.moe_layers]
    if not config.calibrate_batches or not any(r.selection.calibrates for r in routers):
        return None
    return {
        "truncation_layers": [float(r.truncation) for r in routers],
        "requested_truncation": float(routers[0].config.truncation),
        "batches": config.calibrate_batches,
    }
