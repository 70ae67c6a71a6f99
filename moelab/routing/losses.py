"""The auxiliary losses of the balancing stage, as a registry.

The stage takes its own settings, a :class:`BalancingConfig` (the Router builds it from
``RouterConfig``: the keys of the same names), checked on construction.

A loss is one :class:`AuxLoss` subclass registered under its name, the key of
``RouterOutput.losses`` (where it is reported unweighted). It says from the config
whether it is on (:meth:`AuxLoss.on`), computes itself from what the router routed
(:class:`Routed`) and gives its weight; the router adds ``weight * loss`` of every loss
that is on to ``aux_loss``. The computations themselves are the functions of
:mod:`moelab.routing.balancing` and :mod:`moelab.routing.relu_l1`.

=========  ======================  ==================================================
name       on with                 loss
=========  ======================  ==================================================
switch     ``aux_weight`` > 0      Switch E sum_i f_i P_i over ``aux_scope``, P from
                                   ``aux_probs``, f counting ``aux_count``
z          ``z_loss_weight`` > 0   router z-loss mean(logsumexp(logits)^2)
entropy    ``entropy_loss_weight``  mean entropy of the map's values (top-p's dynamic
           > 0                     loss)
l1         ``l1_target`` set       ReMoE's load-balanced L1, weighted by the adaptive
                                   coefficient lambda (``Router.l1_coef``)
=========  ======================  ==================================================

With null experts every loss counts the E + M scored experts (AdaMoE).

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moelab.routing import balancing, relu_l1
from moelab.routing._registry import Registry

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "AUX_COUNTS",
    "AUX_PROBS",
    "AUX_SCOPES",
    "BIAS_UPDATES",
    "AuxLoss",
    "BalancingConfig",
    "Routed",
    "available",
    "get",
    "losses_on",
    "register",
    "unregister",
]

AUX_PROBS = ("map", "softmax", "normalized")
"""The values of ``BalancingConfig.aux_probs``."""
AUX_COUNTS = ("all", "top1")
"""The values of ``BalancingConfig.aux_count``."""
AUX_SCOPES = ("micro_batch", "sequence", "global")
"""The values of ``BalancingConfig.aux_scope``."""
BIAS_UPDATES = ("sign", "quantile")
"""The values of ``BalancingConfig.bias_update``: auxiliary-loss-free balancing's sign
update, quantile balancing."""


@dataclass(frozen=True)
class BalancingConfig:
    """The balancing stage's settings: the auxiliary losses, the capacity limit, the
    selection bias's updates (sign or quantile) and ReLU routing's adaptive L1 (each field is the
    ``RouterConfig`` key of the same name, see there for what it means)."""

    n_experts: int
    """E, the real experts."""
    n_scored: int
    """E + M, the experts scored, null experts included (the losses count them all)."""
    aux_weight: float = 0.01
    aux_probs: str = "map"
    aux_count: str = "all"
    aux_scope: str = "micro_batch"
    z_loss_weight: float = 0.0
    entropy_loss_weight: float = 0.0
    bias_rate: float = 0.0
    bias_update: str = "sign"
    bias_ema: float = 0.0
    capacity_factor: float | None = None
    null_target: float | None = None
    l1_target: float | None = None
    l1_rate: float = 1.2
    l1_init: float = 1e-8

    def __post_init__(self) -> None:
        if self.aux_probs not in AUX_PROBS:
            raise ValueError(f"aux_probs must be one of {AUX_PROBS}, got {self.aux_probs!r}")
        if self.aux_count not in AUX_COUNTS:
            raise ValueError(f"aux_count must be one of {AUX_COUNTS}, got {self.aux_count!r}")
        for name in ("aux_weight", "z_loss_weight", "entropy_loss_weight", "bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        balancing.check_capacity_factor(self.capacity_factor)
        self._check_bias_update()
        if self.aux_scope not in AUX_SCOPES:
            raise ValueError(f"aux_scope must be one of {AUX_SCOPES}, got {self.aux_scope!r}")
        relu_l1.check(self.l1_target, self.l1_rate, self.l1_init, self.n_experts)

    def _check_bias_update(self) -> None:
        if self.bias_update not in BIAS_UPDATES:
            raise ValueError(f"bias_update must be one of {BIAS_UPDATES}, got {self.bias_update!r}")
        if not 0 <= self.bias_ema < 1:
            raise ValueError(
                f"bias_ema (the old bias's weight in quantile balancing) must lie in [0, 1), "
                f"got {self.bias_ema}"
            )
        if self.bias_update == "quantile" and self.bias_rate > 0:
            raise ValueError(
                "bias_update='quantile' sets the selection bias from the scores' quantiles; "
                "bias_rate is the step of the sign update: set bias_rate=0 (or "
                "bias_update='sign' for auxiliary-loss-free balancing)"
            )
        if self.bias_update != "quantile" and self.bias_ema:
            raise ValueError(
                "bias_ema blends quantile balancing's bias: set bias_update='quantile' "
                "or bias_ema=0"
            )

    @property
    def moves_bias(self) -> bool:
        """A balancing rule moves the selection bias: the sign update (``bias_rate`` > 0)
        or quantile balancing."""
        return self.bias_rate > 0 or self.bias_update == "quantile"


@dataclass(frozen=True)
class Routed:
    """What the balancing stage reads of one router call."""

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    ids_TK: torch.Tensor
    chosen_TK: torch.Tensor
    """Every slot the selection chose (null experts' slots too)."""
    weights_TK: torch.Tensor
    seq_len: int | None = None
    """S of the B * S tokens (``Budget.seq_len``), for per-sequence scopes."""


class AuxLoss:
    """An auxiliary loss: ``loss(routed)`` unweighted, ``loss.weight(router)``."""

    name: ClassVar[str] = ""
    """The registry key and the key of ``RouterOutput.losses``."""

    def __init__(self, config: BalancingConfig) -> None:
        self.config = config

    @classmethod
    def on(cls, config: BalancingConfig) -> bool:
        """The loss is part of this config's router."""
        raise NotImplementedError

    def weight(self, router: nn.Module) -> float | torch.Tensor:
        """The factor of the loss in ``aux_loss`` (the router: for state-held weights)."""
        raise NotImplementedError

    def __call__(self, routed: Routed) -> torch.Tensor:
        raise NotImplementedError


class Switch(AuxLoss):
    name = "switch"

    @classmethod
    def on(cls, config: BalancingConfig) -> bool:
        return config.aux_weight > 0

    def weight(self, router: nn.Module) -> float:
        return self.config.aux_weight

    def __call__(self, r: Routed) -> torch.Tensor:
        c = self.config
        source_TE = balancing.aux_source(c.aux_probs, r.logits_TE, r.probs_TE)
        counted_TK = r.chosen_TK
        if c.aux_count == "top1":
            counted_TK = balancing.top1_slots(r.probs_TE, r.ids_TK, r.chosen_TK)
        return balancing.scoped_switch_loss(
            source_TE, r.ids_TK, counted_TK, c.n_scored, c.aux_scope, r.seq_len
        )


class ZLoss(AuxLoss):
    name = "z"

    @classmethod
    def on(cls, config: BalancingConfig) -> bool:
        return config.z_loss_weight > 0

    def weight(self, router: nn.Module) -> float:
        return self.config.z_loss_weight

    def __call__(self, r: Routed) -> torch.Tensor:
        return balancing.z_loss(r.logits_TE)


class Entropy(AuxLoss):
    name = "entropy"

    @classmethod
    def on(cls, config: BalancingConfig) -> bool:
        return config.entropy_loss_weight > 0

    def weight(self, router: nn.Module) -> float:
        return self.config.entropy_loss_weight

    def __call__(self, r: Routed) -> torch.Tensor:
        return balancing.entropy_loss(r.probs_TE)


class ReluL1(AuxLoss):
    name = "l1"

    @classmethod
    def on(cls, config: BalancingConfig) -> bool:
        return config.l1_target is not None

    def weight(self, router: nn.Module) -> torch.Tensor:
        return router.l1_coef  # lambda, moved once per step by the controller

    def __call__(self, r: Routed) -> torch.Tensor:
        assert self.config.l1_target is not None
        active_TK = r.chosen_TK & (r.weights_TK.detach() > 0)
        return relu_l1.l1_loss(r.probs_TE, r.ids_TK, active_TK, self.config.l1_target)


_LOSSES: Registry[type[AuxLoss]] = Registry("auxiliary loss")
register = _LOSSES.register
unregister = _LOSSES.unregister
available = _LOSSES.available
get = _LOSSES.get


def losses_on(config: BalancingConfig) -> list[AuxLoss]:
    """The losses that are on for ``config``, in registry order."""
    return [cls(config) for cls in _LOSSES.classes() if cls.on(config)]


for _loss in (Switch, ZLoss, Entropy, ReluL1):
    register(_loss)
