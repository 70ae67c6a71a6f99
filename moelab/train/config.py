"""Configuration of a training run: one validated dataclass, and dotted ``key=value``
overrides (``--set router.map=entmax --set lr=1e-3``) applied to it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moelab.model.config import ModelConfig
from moelab.model.presets import preset_data
from moelab.model.router_presets import router_preset
from moelab.routing.config import (
    ALIASES,
    RouterConfig,
    canonical_key,
    canonical_keys,
    implied_by_saved,
)

DEVICE_CHOICES = ("auto", "cpu", "cuda")
PARALLEL_CHOICES = ("ddp", "fsdp")
LOG_SINKS = ("jsonl", "tensorboard", "wandb")
"""The names ``TrainConfig.log`` takes; ``jsonl`` (RUN/metrics.jsonl) is always written."""

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
    """Seed of the model init, the data order and every RNG; also of the data split
    (hence the tokenizer) unless ``data_seed`` is set."""
    data_seed: int | None = None
    """Seed of the train/validation split of the documents, on which the tokenizer is
    trained: runs that share it (and the corpus and vocab_size) read the same tokenizer
    and shards whatever their ``seed``, so that seeds vary the initialisation, the data
    order and sampling noise only (paired seeds; every study sets it to 0). None: the
    split follows ``seed``. A ``moelab data prepare`` folder has its own split."""
    eval_every: int = 100
    """Evaluate the validation loss every this many steps (and at the end); 0: only at
    the end."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    checkpoint_every: int = 100
    """Write a checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_every: int = 0
    """Keep for good the checkpoints of the steps that are multiples of this (for
    ``moelab analyze saturation``, which compares each kept checkpoint with the last);
    the others are pruned as usual, the newest two kept. 0: none kept beyond the newest
    two. Must be a multiple of ``checkpoint_every`` (k times it keeps every k-th
    checkpoint); a resumed run may change it."""
    log_every: int = 10
    """Append a line to metrics.jsonl every this many steps."""
    calibrate_batches: int = 4
    """Routers whose selection rule calibrates its cut on p (router.selection =
    "threshold"): before the first step, set each MoE layer's cut (router.truncation) on
    this many training batches so that about k experts per token pass it (k: the layer's
    learned k_l, else router.lapsum_k, else router.top_k), layer after layer. 0 keeps
    router.truncation as configured. config.json and summary.json record the cuts
    under "calibrated" (moelab.train.records.calibration_record)."""
    out: str = "runs/run"
    """The run folder: tokenizer, shards, metrics.jsonl, config.json, checkpoints."""
    data: str | None = None
    """Corpus: None for the default (the Python documentation), or a folder / file /
    saved `datasets` folder (see ``moelab.data.load_corpus``), or a folder written by
    ``moelab data prepare`` (moelab.data.prepare): its tokenizer and shards are used as
    they are, so vocab_size and val_fraction are the folder's (the run takes and
    records them: moelab.train.records)."""
    vocab_size: int = 2048
    """Vocabulary size the tokenizer is trained for; the model's vocab_size follows the
    trained tokenizer (a small corpus may give fewer tokens)."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    progress: bool = True
    """Show progress on stderr: a bar on a terminal, else a plain line per logged step
    (moelab.train.progress)."""
    threads: int | None = None
    """torch's intra-op CPU threads (``torch.set_num_threads``) while training; None:
    the free cores (``moelab.train.threads.default_threads``: the affinity mask less
    the cores other work keeps busy). config.json records the number used, since it
    changes float results; a resumed run may use another (it warns)."""
    parallel: str | None = None
    """How the ranks of a ``torchrun`` run share the model (moelab.train.parallel):
    "ddp" (DistributedDataParallel: every rank holds the whole model; one process runs
    the bare model, as always) or "fsdp" (FSDP2 ``fully_shard`` per transformer block:
    parameters, gradients and optimizer state sharded over the ranks); None: "ddp", or
    "fsdp" when ep > 1 (expert parallelism composes with FSDP only; the run says so).
    A run may resume under another mode."""
    ep: int = 1
    """Expert parallelism: the experts of every MoE layer are split over groups of this
    many ranks (the mesh's "ep" dimension; the "dp" dimension is world / ep). 1: none.
    Takes parallel = "fsdp" (None chooses it); must divide the number of ranks and the
    model's n_experts."""
    compile: bool = False
    """``torch.compile`` each transformer block (the loop itself stays eager)."""
    checkpoint_activations: bool = False
    """Recompute each transformer block's activations in the backward pass instead of
    keeping them (``torch.utils.checkpoint``): less memory, about one more forward."""
    log: tuple[str, ...] = ()
    """Live sinks of the metrics rows beside ``RUN/metrics.jsonl`` (always written, the
    source of truth): "tensorboard" (event files under ``RUN/tensorboard/``) and
    "wandb" (Weights & Biases, offline under ``RUN/wandb/`` unless the environment's
    ``WANDB_MODE`` says otherwise); moelab.train.sinks. Both need the track extra
    (``pip install 'moelab[track]'``). Only rank 0 writes; a resumed run may change it."""
    dead_fraction: float = 0.0
    """An expert is dead over a logging window when its load is at most this fraction of
    its layer's mean expert load (0: no token at all); ``dead_layers`` of
    metrics.jsonl and the dead-expert warnings (moelab.train.health)."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.log = _sink_names(self.log)
        if not 0.0 <= self.dead_fraction < 1.0:
            raise ValueError(
                f"dead_fraction must be in [0, 1) (a share of the mean load), got "
                f"{self.dead_fraction}"
            )
        if self.keep_every > 0 and (
            not self.checkpoint_every or self.keep_every % self.checkpoint_every
        ):
            raise ValueError(
                f"keep_every = {self.keep_every} must be a multiple of checkpoint_every = "
                f"{self.checkpoint_every} (a checkpoint is kept only when one is written)"
            )
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "eval_every",
            "checkpoint_every",
            "keep_every",
            "calibrate_batches",
        ):
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
        if self.data is not None and not str(self.data).strip():
            # NOTE: Path("") is the current directory; an empty --data is a mistake
            raise ValueError(
                "data is an empty string; give a corpus folder or file, or None (no --data) "
                "for the default corpus"
            )
        if self.data_seed is not None and (
            isinstance(self.data_seed, bool)
            or int(self.data_seed) != self.data_seed
            or self.data_seed < 0
        ):
            raise ValueError(
                f"data_seed must be a whole number >= 0 or None, got {self.data_seed!r}"
            )
        if self.threads is not None and (int(self.threads) != self.threads or self.threads < 1):
            raise ValueError(f"threads must be a whole number >= 1 or None, got {self.threads}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.parallel is not None and self.parallel not in PARALLEL_CHOICES:
            raise ValueError(
                f"parallel must be one of {PARALLEL_CHOICES} or None (ddp, or fsdp with "
                f"ep > 1), got {self.parallel!r}"
            )
        if int(self.ep) != self.ep or self.ep < 1:
            raise ValueError(
                f"ep must be a whole number >= 1 (1: no expert parallelism), got {self.ep}"
            )
        if self.ep > 1 and self.parallel == "ddp":
            raise ValueError(
                f"ep = {self.ep} needs parallel = 'fsdp' (--parallel fsdp, or no --parallel): "
                "expert parallelism composes with FSDP, not with DDP"
            )
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a dict of ModelConfig overrides, got {self.model!r}")
        # fail now, not after the data is prepared, on a bad preset or model override
        mc = self.model_config()
        if self.seq_len > mc.max_seq_len:
            raise ValueError(
                f"seq_len = {self.seq_len} exceeds the model's max_seq_len = {mc.max_seq_len}; "
                "lower seq_len or set model.max_seq_len"
            )
        if self.ep > 1 and mc.n_experts % self.ep:
            raise ValueError(
                f"ep = {self.ep} does not divide the model's n_experts = {mc.n_experts}; "
                "every rank of an expert-parallel group holds n_experts / ep experts"
            )

    @property
    def split_seed(self) -> int:
        """The seed of the data split and tokenizer: ``data_seed``, else ``seed``."""
        return int(self.seed if self.data_seed is None else self.data_seed)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig: the preset, then ``model`` overrides, then the map/alpha/top_k
        shortcuts; ``vocab_size`` (the trained tokenizer's) replaces the model's."""
        data = preset_data(self.preset)
        overrides = copy.deepcopy(self.model)
        # NOTE: old router key names (ALIASES) as their current ones, so that an
        # override in either spelling replaces the preset's value; a router preset's keys
        # sit between the model preset's router table and the overrides
        router = {
            **canonical_keys(data.get("router", {})),
            **self._router_preset_keys(data),
            **canonical_keys(overrides.pop("router", {})),
        }
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
        d["log"] = list(self.log)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """The TrainConfig of a run's config.json: its fields, without the run's
        provenance (``"run_info"``, see moelab.train.provenance) and the cuts its
        calibration set (``"calibrated"``, see moelab.train.records). ``"model"`` may be
        the overrides a run was started with ({} in runs written before it held the
        resolved config) or the resolved config itself (:meth:`resolved_model`)."""
        fields = {k: v for k, v in d.items() if k not in ("run_info", "calibrated")}
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown TrainConfig fields {sorted(unknown)}; was the run written by a "
                "newer moelab?"
            )
        config = cls(**copy.deepcopy(fields))
        # NOTE: a run written before a router default changed routed with the old value
        # (moelab.routing.config.CHANGED_DEFAULTS); its config says so only by lacking
        # the key, so the key is filled in with the value it used
        rc = config.model_config().router_config()
        implied = implied_by_saved(config.router_keys_set(), rc)
        if implied:
            config.model = {**config.model, "router": {**config.model.get("router", {}), **implied}}
            config = cls(**config.to_dict())
        return config

    def _router_preset_keys(self, data: dict[str, Any]) -> dict[str, Any]:
        """The shared router keys of the router preset (``model.router_preset``, else
        that of the model preset, whose fields are ``data``), by their current names; {}
        without one."""
        name = self.model.get("router_preset", data.get("router_preset"))
        return {} if name is None else canonical_keys(router_preset(name).router)

    def router_keys_set(self) -> dict[str, Any]:
        """The router keys this config sets itself, by their current names: the preset's
        router table, then the router preset's, then ``model["router"]``, then the
        map/alpha/top_k shortcuts. A RouterConfig field not named here takes the
        library's default."""
        shortcuts = {k: v for k in ("map", "alpha", "top_k") if (v := getattr(self, k)) is not None}
        data = preset_data(self.preset)
        return {
            **canonical_keys(data.get("router", {})),
            **self._router_preset_keys(data),
            **canonical_keys(self.model.get("router", {})),
            **shortcuts,
        }

    def resolved_model(self, vocab_size: int | None = None) -> dict[str, Any]:
        """Every field of the ModelConfig this config builds (:meth:`model_config`),
        with ``"router"`` holding every RouterConfig field (but d_model, n_experts and
        vocab_size, which come from the model): the run's model spelled out, independent of the
        preset's file. Used as ``model`` it gives the same ModelConfig again."""
        mc = self.model_config(vocab_size)
        rc = dataclasses.asdict(mc.router_config())
        del rc["d_model"], rc["n_experts"], rc["vocab_size"]
        d = dataclasses.asdict(mc)
        d["router"] = rc
        return d


def _sink_names(log: Any) -> tuple[str, ...]:
    """``TrainConfig.log`` as a tuple of sink names without ``jsonl`` (always on) and
    without repeats; a comma-separated string is split."""
    if isinstance(log, str):
        log = [part for part in log.split(",") if part.strip()]
    if not isinstance(log, (list, tuple)):
        raise ValueError(f"log must be a list of sink names {LOG_SINKS}, got {log!r}")
    names: list[str] = []
    for name in log:
        name = str(name).strip().lower()
        if name not in LOG_SINKS:
            raise ValueError(f"log: unknown sink {name!r}; choose from {', '.join(LOG_SINKS)}")
        if name != "jsonl" and name not in names:
            names.append(name)
    return tuple(names)


_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})
_NULL = frozenset({"none", "null"})


class _Mismatch(ValueError):
    """Text that is not a value of the type asked for (turned into a message that
    names the field by :func:`parse_value`)."""


def parse_value(text: str, field_type: Any = Any, name: str = "value") -> Any:
    """Parse the text of an override as a value of the field's declared type.

    With ``field_type`` (a type annotation such as ``bool``, ``int | None`` or
    ``tuple[float, float]``):

    * ``bool``: true/false, yes/no, on/off, 1/0 (any case); other text is an error;
    * ``int``: an integer literal (``2.5`` and ``true`` are errors);
    * ``float``: any finite number (``3``, ``1e-3``);
    * ``str``: the text as it is;
    * ``list[X]`` / ``tuple[X, ...]``: a JSON list (``[0.9, 0.95]``) or comma-separated
      items (``0.9,0.95``), each parsed as X (a fixed-length tuple checks the length);
    * ``dict``: a JSON object;
    * a union (``X | None``, ``str | list[int]``): ``none``/``null`` (any case) where it
      allows None, else the first member that accepts the text (``str`` last);
    * ``Any`` (the default, no type known): ``"3"`` -> 3, ``"1e-3"`` -> 0.001,
      ``"true"``/``"True"`` -> True, ``"null"``/``"None"`` -> None, JSON lists and
      objects as such, anything else the string itself.

    Raises:
        ValueError: the text is not a value of ``field_type``; the message names
            ``name`` (the override's key) and the type.
    """
    try:
        return _parse_typed(text.strip(), field_type)
    except _Mismatch:
        raise ValueError(f"{name} takes {_describe(field_type)}; got {text.strip()!r}") from None


def _parse_loose(text: str) -> Any:
    special = {"True": True, "False": False, "None": None}
    if text in special:
        return special[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_typed(text: str, tp: Any) -> Any:
    if tp is Any:
        return _parse_loose(text)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NULL:
            return None
        # NOTE: str accepts any text, so it is tried last ("1,3" is a list for
        # `str | list[int]`, "all" the string)
        for member in sorted((a for a in args if a is not type(None)), key=lambda a: a is str):
            try:
                return _parse_typed(text, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise _Mismatch
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise _Mismatch from None
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            raise _Mismatch from None
        if not math.isfinite(value):
            raise _Mismatch
        return value
    if tp is str:
        return text
    if origin in (list, tuple):
        return _parse_sequence(text, origin, args)
    if tp is dict or origin is dict:
        return _json_of(text, dict)
    return _parse_loose(text)  # a type this parser does not know: no narrower reading


def _json_of(text: str, kind: type) -> Any:
    """``text`` read as a JSON value of type ``kind`` (a dict or a list), else _Mismatch."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise _Mismatch from None
    if not isinstance(value, kind):
        raise _Mismatch
    return value


def _parse_sequence(text: str, origin: type, args: tuple[Any, ...]) -> list[Any] | tuple:
    if text.startswith("["):
        items = _json_of(text, list)
        texts = [i if isinstance(i, str) else json.dumps(i) for i in items]
    else:
        texts = [t.strip() for t in text.split(",")] if text else []
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(texts) != len(args):
            raise _Mismatch
        return tuple(_parse_typed(t, a) for t, a in zip(texts, args, strict=True))
    element = args[0] if args else Any
    values = [_parse_typed(t, element) for t in texts]
    return tuple(values) if origin is tuple else values


def _describe(tp: Any) -> str:
    """The type in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(a) for a in args if a is not type(None)]
        if type(None) in args:
            words.append("none/null")
        return " or ".join(words)
    if tp is bool:
        return "a bool (true/false, yes/no, on/off, 1/0)"
    if tp is int:
        return "an int"
    if tp is float:
        return "a finite float"
    if tp is str:
        return "a string"
    if origin in (list, tuple):
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        nouns = [_describe(a).split(" (")[0].split(" ")[-1] for a in args] or ["value"]
        if fixed:
            what = f"{len(args)} {nouns[0]}s" if len(set(nouns)) == 1 else ", ".join(nouns)
        else:
            what = f"a list of {nouns[0]}s"
        return f"{what} ([a, b] or a,b)"
    if tp is dict or origin is dict:
        return "a JSON object"
    return f"a {getattr(tp, '__name__', tp)}"


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The declared (resolved) type of each field of a config dataclass."""
    return typing.get_type_hints(cls)


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
    ``router.NAME`` or ``model.router.NAME`` (``router.map=entmax``), also under an old
    name of ``moelab.routing.config.ALIASES`` (``router.cap_factor`` sets
    ``token_cap_factor``); one MoE layer's router field as ``router_layers.I.NAME`` or
    ``model.router_layers.I.NAME`` (I: the MoE layer, counted from 0 among the MoE
    layers; ``router_layers.0.selection=hash``), an entry of the list form of
    ``ModelConfig.router_layers`` (entries before I that are not set stay null, as the
    shared config). Each value is parsed by :func:`parse_value` as the field's
    declared type (``router.renorm=no`` is False, ``steps=2.5`` an error). Unknown keys
    and values of the wrong type raise ``ValueError`` (naming the known keys, or the
    field and its type), before the config is built.
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
        parts = key.split(".")
        if parts[0] == "model":
            parts = parts[1:]
            if not parts:
                raise ValueError("give model fields one by one: model.NAME=value")
        elif parts[0] in _TRAIN_FIELDS:
            if len(parts) > 1:
                raise ValueError(f"{parts[0]!r} has no sub-keys; write {parts[0]}=value")
            d[parts[0]] = parse_value(text, _field_types(TrainConfig)[parts[0]], key)
            continue
        if parts[0] == "router":
            name = canonical_key(parts[1]) if len(parts) == 2 else ""
            if name not in _ROUTER_FIELDS:
                raise ValueError(
                    f"unknown router key {key!r}; router fields: {_known(_ROUTER_FIELDS)} "
                    f"(old names: {_known(set(ALIASES))})"
                )
            value = parse_value(text, _field_types(RouterConfig)[name], key)
            router = canonical_keys(d["model"].get("router") or {})
            d["model"]["router"] = {**router, name: value}
        elif parts[0] == "router_layers" and len(parts) > 1:
            d["model"]["router_layers"] = _layer_override(
                d["model"].get("router_layers"), parts, text, key
            )
        elif parts[0] in _MODEL_FIELDS and len(parts) == 1:
            d["model"][parts[0]] = parse_value(text, _field_types(ModelConfig)[parts[0]], key)
        else:
            raise ValueError(
                f"unknown config key {key!r}; training fields: {_known(_TRAIN_FIELDS)}; "
                f"model fields (optionally model.NAME): {_known(_MODEL_FIELDS)}; "
                "router fields: router.NAME; one MoE layer's: router_layers.I.NAME"
            )
    return TrainConfig(**d)


def _layer_override(layers: Any, parts: list[str], text: str, key: str) -> list[Any]:
    """``model.router_layers`` (None or the list form) with MoE layer ``parts[1]``'s
    router field ``parts[2]`` set to ``text`` parsed as that field's type."""
    if len(parts) != 3 or not parts[1].isdigit():
        raise ValueError(
            f"override {key!r}: address one MoE layer's router field as "
            "router_layers.I.NAME=value (I: the MoE layer, counted from 0)"
        )
    name = canonical_key(parts[2])
    if name not in _ROUTER_FIELDS:
        raise ValueError(
            f"unknown router key {key!r}; router fields: {_known(_ROUTER_FIELDS)} "
            f"(old names: {_known(set(ALIASES))})"
        )
    if layers is not None and not isinstance(layers, list):
        raise ValueError(
            f"override {key!r}: model.router_layers is a rule ({json.dumps(layers)}); one "
            "layer is addressed in the list form: give model.router_layers as a list"
        )
    value = parse_value(text, _field_types(RouterConfig)[name], key)
    out = list(layers or [])
    i = int(parts[1])
    out += [None] * (i + 1 - len(out))
    out[i] = {**canonical_keys(out[i] or {}), name: value}
    return out
