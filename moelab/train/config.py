"""Configuration of a training run: one validated dataclass, and dotted ``key=value``
overrides (``--set router.map=entmax --set lr=1e-3``) applied to it."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moelab.model.config import ModelConfig
from moelab.model.presets import preset_data
from moelab.routing.config import RouterConfig

DEVICE_CHOICES = ("auto", "cpu", "cuda")

__all__ = ["TrainConfig", "apply_overrides", "parse_value"]


@dataclass
class TrainConfig:
    """Everything a run needs: the model (a preset plus overrides), the optimiser and its
    schedule, the data and where the run is written."""

    preset: str = "tiny"
    """Name of the model preset (``moelab.model.available_presets()``)."""
    model: dict[str, Any] = field(default_factory=dict)
    """Overrides of the preset's ModelConfig fields; ``model["router"]`` overrides
    RouterConfig fields (merged key by key with the preset's router table)."""
    map: str | None = None
    """Shortcut for ``model["router"]["map"]``; None keeps the preset's."""
    alpha: float | None = None
    """Shortcut for ``model["router"]["alpha"]`` (entmax, normmax)."""
    top_k: int | None = None
    """Shortcut for ``model["router"]["top_k"]``."""
    steps: int = 200
    """Optimiser steps of the whole run (the learning-rate schedule spans them)."""
    batch_size: int = 8
    """Sequences per optimiser step, over all ranks (each rank takes batch_size // world)."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's max_seq_len."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms and biases get none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seed of the model init, the data split and order, and every RNG."""
    eval_every: int = 100
    """Evaluate the validation loss every this many steps (and at the end); 0: only at
    the end."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    checkpoint_every: int = 100
    """Write a checkpoint every this many steps (and at the end); 0: only at the end."""
    log_every: int = 10
    """Append a line to metrics.jsonl every this many steps."""
    calibrate_batches: int = 4
    """Truncating routers (router.selection = "threshold"): before the first step, set
    each MoE layer's threshold on this many training batches so that about k experts
    per token pass it (k: the layer's learned k_l, else router.lapsum_k, else
    router.top_k), layer after layer. 0 keeps router.threshold as configured."""
    out: str = "runs/run"
    """The run folder: tokenizer, shards, metrics.jsonl, config.json, checkpoints."""
    data: str | None = None
    """Corpus: None for the default (the Python documentation), or a folder / file /
    saved `datasets` folder (see ``moelab.data.load_corpus``)."""
    vocab_size: int = 2048
    """Vocabulary size the tokenizer is trained for; the model's vocab_size follows the
    trained tokenizer (a small corpus may give fewer tokens)."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "calibrate_batches"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr = {self.lr}], got {self.min_lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0 (grad_clip 0 disables it)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a dict of ModelConfig overrides, got {self.model!r}")
        # fail now, not after the data is prepared, on a bad preset or model override
        mc = self.model_config()
        if self.seq_len > mc.max_seq_len:
            raise ValueError(
                f"seq_len = {self.seq_len} exceeds the model's max_seq_len = {mc.max_seq_len}; "
                "lower seq_len or set model.max_seq_len"
            )

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig: the preset, then ``model`` overrides, then the map/alpha/top_k
        shortcuts; ``vocab_size`` (the trained tokenizer's) replaces the model's."""
        data = preset_data(self.preset)
        overrides = copy.deepcopy(self.model)
        router = {**data.get("router", {}), **overrides.pop("router", {})}
        data.update(overrides)
        for key in ("map", "alpha", "top_k"):
            if getattr(self, key) is not None:
                router[key] = getattr(self, key)
        data["router"] = router
        if vocab_size is not None:
            data["vocab_size"] = vocab_size
        try:
            return ModelConfig(**data)
        except TypeError as err:
            raise ValueError(f"model overrides of preset {self.preset!r}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``TrainConfig(**d)`` rebuilds the config)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"1e-3"`` -> 0.001, ``"true"``/``"True"`` -> True, ``"null"``/``"None"``
    -> None, JSON lists and objects as such, anything else the string itself."""
    special = {"True": True, "False": False, "None": None}
    if text in special:
        return special[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_ROUTER_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)} - {"d_model", "n_experts"}


def _known(names: set[str]) -> str:
    return ", ".join(sorted(names))


def apply_overrides(
    config: TrainConfig | Mapping[str, Any], overrides: Iterable[str]
) -> TrainConfig:
    """A new TrainConfig with ``key=value`` overrides applied (``config`` is unchanged).

    ``config`` may also be a mapping of TrainConfig fields (the others take their
    defaults): it is only validated once the overrides are in, so a base that needs them
    (``{"map": "lapsum"}`` with ``router.lapsum_k=2``) works.

    Keys: a TrainConfig field (``lr=1e-3``); a model field, with or without the
    ``model.`` prefix (``n_layers=2``, ``model.d_model=64``); a router field as
    ``router.NAME`` or ``model.router.NAME`` (``router.map=entmax``). Values are parsed
    with :func:`parse_value`. Unknown keys raise ``ValueError`` naming the known ones.
    """
    if isinstance(config, TrainConfig):
        d = config.to_dict()
    else:
        unknown = set(config) - _TRAIN_FIELDS
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}")
        d = copy.deepcopy(dict(config))
        d["model"] = dict(d.get("model") or {})
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        value = parse_value(text.strip())
        parts = key.split(".")
        if parts[0] == "model":
            parts = parts[1:]
            if not parts:
                raise ValueError("give model fields one by one: model.NAME=value")
        elif parts[0] in _TRAIN_FIELDS:
            if len(parts) > 1:
                raise ValueError(f"{parts[0]!r} has no sub-keys; write {parts[0]}=value")
            d[parts[0]] = value
            continue
        if parts[0] == "router":
            if len(parts) != 2 or parts[1] not in _ROUTER_FIELDS:
                raise ValueError(
                    f"unknown router key {key!r}; router fields: {_known(_ROUTER_FIELDS)}"
                )
            d["model"].setdefault("router", {})[parts[1]] = value
        elif parts[0] in _MODEL_FIELDS and len(parts) == 1:
            d["model"][parts[0]] = value
        else:
            raise ValueError(
                f"unknown config key {key!r}; training fields: {_known(_TRAIN_FIELDS)}; "
                f"model fields (optionally model.NAME): {_known(_MODEL_FIELDS)}; "
                "router fields: router.NAME"
            )
    return TrainConfig(**d)
