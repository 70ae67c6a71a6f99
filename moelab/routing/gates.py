"""The gate stage: the weights of the selected slots, from the map's values at them.

A gate is one :class:`Gate` subclass registered under its name; ``RouterConfig.gate``
names the configured one (from the flat keys ``renorm`` and ``straight_through``):

``"map"`` (default)
    w = p, the map's values as they are (top-k after normalisation).
``"renorm"``
    w = p / sum over the selected slots of p (re-normalised, Mixtral's routing).
``"straight_through"``
    w = 1 forward, the gradient of log p backward: w = 1 + log p - sg(log p).

In every gate a selected slot with p = 0 keeps weight 0 (a filler), a slot that is not
selected weighs 0, and ``routed_scaling`` (DeepSeek-V3's routed scaling factor)
multiplies the weights after the gate's own rule.

Shape suffixes: T, K (moelab.shapes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from moelab.routing._registry import Registry

if TYPE_CHECKING:
    from moelab.routing.config import RouterConfig

__all__ = ["Gate", "available", "gate_weights", "get", "name_of", "register"]


class Gate:
    """A gate rule: ``gate(probs_TK, selected_TK) -> weights_TK``."""

    name: ClassVar[str] = ""
    """The registry key (``RouterConfig.gate``)."""

    def __init__(self, scaling: float = 1.0) -> None:
        self.scaling = float(scaling)

    def weigh(self, p_TK: torch.Tensor) -> torch.Tensor:
        """The rule on the map's values of the selected slots (0 elsewhere)."""
        raise NotImplementedError(f"gate {self.name!r} does not implement weigh()")

    def __call__(self, probs_TK: torch.Tensor, selected_TK: torch.Tensor) -> torch.Tensor:
        w_TK = self.weigh(torch.where(selected_TK, probs_TK, 0))
        return w_TK if self.scaling == 1.0 else w_TK * self.scaling


class MapValues(Gate):
    """w = p."""

    name = "map"

    def weigh(self, p_TK: torch.Tensor) -> torch.Tensor:
        return p_TK


class Renorm(Gate):
    """w = p / sum_selected p (0 for a token whose selected slots have no mass)."""

    name = "renorm"

    def weigh(self, p_TK: torch.Tensor) -> torch.Tensor:
        total = p_TK.sum(-1, keepdim=True)
        return torch.where(total > 0, p_TK / total.clamp_min(torch.finfo(p_TK.dtype).tiny), 0)


class StraightThrough(Gate):
    """w = 1 forward, d w = d log p backward, where p > 0 (0 elsewhere)."""

    name = "straight_through"

    def weigh(self, p_TK: torch.Tensor) -> torch.Tensor:
        positive = p_TK > 0
        log_p = torch.log(torch.where(positive, p_TK, 1))
        return torch.where(positive, 1 + log_p - log_p.detach(), 0)


_GATES: Registry[type[Gate]] = Registry("gate")
register = _GATES.register
available = _GATES.available
get = _GATES.get


_FLAGS = {"renorm": (True, False), "straight_through": (False, True)}
"""The built-in gates that the flat keys (renorm, straight_through) also choose."""


def name_of(config: RouterConfig) -> str:
    """The gate of a config: ``config.gate`` when set, else the one its flat keys
    choose (``renorm``, ``straight_through``; neither: "map")."""
    if config.gate is not None:
        return config.gate
    return _flag_name(config.renorm, config.straight_through)


def _flag_name(renorm: bool, straight_through: bool) -> str:
    """The built-in gate the flat keys choose (neither: "map")."""
    if renorm:
        return "renorm"
    return "straight_through" if straight_through else "map"


def check(config: RouterConfig) -> None:
    """Validate ``config.gate`` against the flat keys and set the flags it implies, so
    that code reading ``renorm`` / ``straight_through`` sees the gate in use."""
    if config.renorm and config.straight_through:
        raise ValueError("choose one of renorm and straight_through, not both")
    if config.gate is None:
        return
    get(config.gate)  # an unknown name raises, naming the known ones
    flags = _FLAGS.get(config.gate, (False, False))
    given = (config.renorm, config.straight_through)
    if any(given) and given != flags:
        raise ValueError(
            f"gate={config.gate!r} and renorm={config.renorm}, straight_through="
            f"{config.straight_through} disagree: give the gate by one of the two ways"
        )
    config.renorm, config.straight_through = flags


def gate_weights(
    probs_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    renorm: bool,
    straight_through: bool,
    scaling: float = 1.0,
) -> torch.Tensor:
    """The gate of the flat keys, in one call (see the module docstring)."""
    return get(_flag_name(renorm, straight_through))(scaling)(probs_TK, selected_TK)


for _gate in (MapValues, Renorm, StraightThrough):
    register(_gate)
