"""The gate stage: the weights of the selected slots, from the map's values at them.

A gate is one :class:`Gate` subclass registered under its name; the stage's config, a
:class:`GateConfig`, names the configured one (``RouterConfig.gate``, or the one the flat
keys ``renorm`` and ``straight_through`` choose: :func:`flags`):

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

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from moelab.routing._registry import Registry

__all__ = [
    "Gate",
    "GateConfig",
    "available",
    "build",
    "flag_name",
    "flags",
    "gate_weights",
    "get",
    "register",
    "unregister",
]


@dataclass(frozen=True)
class GateConfig:
    """The gate stage's settings, checked on construction."""

    rule: str = "map"
    """The gate rule, a name of :func:`available` (``RouterConfig.gate_rule``)."""
    scaling: float = 1.0
    """The factor on the weights after the rule (``RouterConfig.routed_scaling``)."""

    def __post_init__(self) -> None:
        get(self.rule)  # an unknown name raises, naming the known ones
        if not (self.scaling > 0 and math.isfinite(self.scaling)):
            raise ValueError(f"routed_scaling must be a finite number > 0, got {self.scaling}")


class Gate:
    """A gate rule: ``gate(probs_TK, selected_TK) -> weights_TK``."""

    name: ClassVar[str] = ""
    """The registry key (``GateConfig.rule``)."""
    constant_at_one_slot: ClassVar[bool] = False
    """With one selected slot the rule gives every token the same weight whatever p
    (renorm: 1), so no gradient reaches the router through the gate; the Router's
    wiring refuses it with a selection that learns its choice only through the gate
    (:func:`moelab.routing.pairings.gate_needs_two_slots`)."""

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
    constant_at_one_slot = True

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
unregister = _GATES.unregister
available = _GATES.available
get = _GATES.get


def build(config: GateConfig) -> Gate:
    """The gate of ``config``."""
    return get(config.rule)(config.scaling)


_FLAGS = {"renorm": (True, False), "straight_through": (False, True)}
"""The built-in gates that the flat keys (renorm, straight_through) also choose."""


def flag_name(renorm: bool, straight_through: bool) -> str:
    """The built-in gate the flat keys choose (neither: "map")."""
    if renorm:
        return "renorm"
    return "straight_through" if straight_through else "map"


def flags(gate: str | None, renorm: bool, straight_through: bool) -> tuple[bool, bool]:
    """``(renorm, straight_through)`` as the gate ``gate`` implies them (``gate`` None:
    as given), so that code reading the flat keys sees the gate in use; ValueError for
    an unknown gate, both flags, or flags that disagree with ``gate``."""
    if renorm and straight_through:
        raise ValueError("choose one of renorm and straight_through, not both")
    if gate is None:
        return renorm, straight_through
    get(gate)  # an unknown name raises, naming the known ones
    implied = _FLAGS.get(gate, (False, False))
    given = (renorm, straight_through)
    if any(given) and given != implied:
        raise ValueError(
            f"gate={gate!r} and renorm={renorm}, straight_through="
            f"{straight_through} disagree: give the gate by one of the two ways"
        )
    return implied


def gate_weights(
    probs_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    renorm: bool,
    straight_through: bool,
    scaling: float = 1.0,
) -> torch.Tensor:
    """The gate of the flat keys, in one call (see the module docstring)."""
    return get(flag_name(renorm, straight_through))(scaling)(probs_TK, selected_TK)


for _gate in (MapValues, Renorm, StraightThrough):
    register(_gate)
