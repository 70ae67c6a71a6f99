"""Named model presets: data files (TOML) in the ``presets/`` folder next to this module.

    load_preset("paper-300m")  # -> ModelConfig
    available_presets()        # -> ["dense-1b", "dense-283m", ...]

Each file holds the fields of `ModelConfig`; its ``[router]`` table holds RouterConfig
overrides (map, top_k, alpha, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .config import ModelConfig, param_counts

if sys.version_info >= (3, 11):
    import tomllib
else:  # NOTE: Python 3.10 has no tomllib; tomli is the same parser under its old name
    import tomli as tomllib

PRESET_DIR = Path(__file__).with_suffix("")  # moelab/model/presets/

__all__ = ["PRESET_DIR", "available_presets", "load_preset", "param_counts", "preset_data"]


def available_presets() -> list[str]:
    """Names of the presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_data(name: str) -> dict[str, Any]:
    """The raw fields of preset ``name`` (a dict to override before building a config)."""
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(available_presets())}")
    with path.open("rb") as f:
        return tomllib.load(f)


def load_preset(name: str) -> ModelConfig:
    """The ModelConfig of preset ``name``."""
    data = preset_data(name)
    try:
        return ModelConfig(**data)
    except TypeError as err:  # an unknown key in the file
        raise ValueError(f"preset {name!r}: {err}") from None
