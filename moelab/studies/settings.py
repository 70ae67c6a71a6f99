"""The base settings of each scale that every study starts from (TrainConfig fields),
and :func:`settings`, which applies a study's overrides to them.

A study states only what differs from its scale's base, as dotted keys
(``"model.n_experts": 8``) or small dicts (``"model": {"router": {...}}``, merged key by
key into the base), as torchtitan's config registry builds its named configs from a base.
``DEFAULT`` removes a base value, leaving the field to the preset or TrainConfig.

The paper scale has no base: each paper states its own model, data and budget, and a
study gives them in full (their order is the order of the flags in ``commands.sh``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["BASE", "DEFAULT", "QUICK_MODEL", "settings"]

QUICK_MODEL: dict[str, Any] = dict(
    n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32, n_experts=4
)
"""The quick scale's model: the tiny preset shrunk to two layers of width 32 and four
experts (a smoke run of a few seconds)."""

BASE: dict[str, dict[str, Any]] = {
    "quick": dict(
        preset="tiny",
        model=QUICK_MODEL,
        steps=16,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=2,
        eval_every=8,
        eval_batches=1,
        checkpoint_every=0,
        log_every=2,
        vocab_size=300,
        device="cpu",
        threads=1,
    ),
    "cpu": dict(
        preset="tiny",
        steps=250,
        batch_size=8,
        seq_len=128,
        warmup_steps=20,
        eval_every=50,
        eval_batches=8,
        checkpoint_every=0,
        log_every=10,
    ),
}
"""quick: a smoke run (under a minute per study); cpu: the tiny preset on the default
corpus, a few minutes a run on two cores. Read through :func:`settings`."""


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""An override value that removes the base's value (the preset or TrainConfig decides)."""


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> None:
    for key, value in over.items():
        if value is DEFAULT:
            base.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            base[key] = dict(base[key])
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def settings(scale: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The base settings of ``scale`` with ``overrides`` applied: each key a field or a
    dotted path (``"model.router.top_k"``); a dict value merges key by key into a dict
    it meets, any other value replaces; ``DEFAULT`` removes. A new dict each call."""
    if scale not in BASE:
        raise ValueError(f"scale {scale!r} has no base settings; choose one of {', '.join(BASE)}")
    out = copy.deepcopy(BASE[scale])
    for key, value in (overrides or {}).items():
        *path, last = key.split(".")
        node = out
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        _merge(node, {last: value})
    return out
