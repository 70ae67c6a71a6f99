"""The map stage of the router: ``probs_TE = map(logits_TE)``, a map of
:mod:`moelab.maps` with its parameters.

The stage takes its own settings, a :class:`MapConfig` (the Router builds it from
``RouterConfig``: ``map``, ``alpha``, ``lapsum_k``).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moelab import maps

__all__ = ["MAP_PARAMS", "MapConfig", "apply_map"]

MAP_PARAMS: dict[str, str] = {"alpha": "alpha", "lapsum_k": "k"}
"""Config key -> the parameter of the map (``maps.info(map).params``) it sets."""


@dataclass(frozen=True)
class MapConfig:
    """The map stage's settings, checked on construction by the map's own record
    (:meth:`moelab.maps.MapInfo.check_params`, messages in the config keys' names)."""

    name: str
    """The probability map, a name of ``moelab.maps.available()`` (``RouterConfig.map``)."""
    n_experts: int
    """E, the bound of a budget k (0 < k < E)."""
    alpha: float | None = None
    """alpha of entmax / normmax; None: the map's default, filled in on construction."""
    lapsum_k: float | None = None
    """k of a map with a budget (LapSum); ignored by a map without one, as it always was,
    so that saved configs that carry one still load."""

    def __post_init__(self) -> None:
        record = maps.info(self.name)  # an unknown map raises, naming the known ones
        # NOTE: lapsum_k of a map without a budget k is ignored; alpha of a map without
        # one is refused
        given = {"alpha": self.alpha}
        if "k" in record.params:
            given["k"] = self.lapsum_k
        keys = {p: key for key, p in MAP_PARAMS.items()}
        checked = record.check_params(self.n_experts, keys, **given)
        if "alpha" in record.params:
            object.__setattr__(self, "alpha", checked["alpha"])  # the default when not given

    @property
    def params(self) -> dict[str, Any]:
        """The map's own parameters as this config sets them (``{"alpha": 1.5}``,
        ``{"k": 2.0}``; the map's defaults for the others), keyed as ``fn`` takes them."""
        taken = maps.info(self.name).params
        return {p: getattr(self, key) for key, p in MAP_PARAMS.items() if p in taken}


def apply_map(
    config: MapConfig, logits_TE: torch.Tensor, lapsum_k: float | torch.Tensor | None = None
) -> torch.Tensor:
    """The configured probability map on all E logits, with its parameters from the
    config (``config.params``) and, for a map with a budget k, the ``lapsum_k`` of this
    call when given (a learned per-layer k)."""
    record = maps.info(config.name)
    params = config.params
    if lapsum_k is not None and "k" in record.params:
        params["k"] = lapsum_k
    return record.fn(logits_TE, **params)
