"""Named router presets: data files (TOML) in ``presets/routers/`` next to this module,
chosen by ``ModelConfig.router_preset`` (``--set model.router_preset=deepseek-v4``).

    router_preset("deepseek-v4")  # -> RouterPreset(name, about, router, router_layers)
    available_router_presets()    # -> ["deepseek-v3", "deepseek-v4", "gpt-oss", "kimi-k2"]

A model preset (:mod:`moelab.model.presets`) sets the model's shape; a router preset sets
how its MoE layers route, whatever the shape: its ``[router]`` table holds RouterConfig
overrides shared by every MoE layer and its optional ``router_layers`` the per-layer ones
(a list, or a rule such as ``{first = 3, set = {selection = "hash"}}``, see
:func:`moelab.model.config.layer_overrides`). In the model config they sit beneath
``router`` and ``router_layers``: what the config sets itself wins, key by key.

Each file cites the model family it follows; tests/model/test_router_presets.py checks the
presets against moelab's written-out rules of those families
(:func:`moelab.integrations.hf.rules.apply_rule`) on the same logits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # NOTE: Python 3.10 has no tomllib; tomli is the same parser under its old name
    import tomli as tomllib

ROUTER_PRESET_DIR = Path(__file__).with_name("presets") / "routers"

__all__ = ["ROUTER_PRESET_DIR", "RouterPreset", "available_router_presets", "router_preset"]


@dataclass(frozen=True)
class RouterPreset:
    """One router preset, as its file gives it."""

    name: str
    about: str
    """One line: the rule, in words."""
    router: dict[str, Any] = field(default_factory=dict)
    """RouterConfig overrides shared by every MoE layer."""
    router_layers: list[dict[str, Any] | None] | dict[str, Any] | None = None
    """Per-MoE-layer overrides (``ModelConfig.router_layers``'s forms), or None."""


def available_router_presets() -> list[str]:
    """Names of the router presets, sorted."""
    return sorted(p.stem for p in ROUTER_PRESET_DIR.glob("*.toml"))


def router_preset(name: str) -> RouterPreset:
    """The router preset ``name``; ValueError naming the choices for an unknown one."""
    path = ROUTER_PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(
            f"unknown router_preset {name!r}; choose one of {', '.join(available_router_presets())}"
        )
    with path.open("rb") as f:
        data = tomllib.load(f)
    unknown = sorted(set(data) - {"about", "router", "router_layers"})
    if unknown:
        raise ValueError(f"router preset {name!r}: unknown keys {unknown}")
    return RouterPreset(
        name, str(data.get("about", "")), dict(data.get("router", {})), data.get("router_layers")
    )
