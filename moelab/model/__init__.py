"""The model: a decoder-only transformer with MoE feed-forward layers, its config, and
named presets (data files under presets/: model presets, and router presets under
presets/routers/)."""

from __future__ import annotations

from .config import ModelConfig, param_counts
from .presets import available_presets, load_preset
from .router_presets import available_router_presets, router_preset
from .transformer import ModelOutput, Transformer

__all__ = [
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "available_presets",
    "available_router_presets",
    "load_preset",
    "param_counts",
    "router_preset",
]
