"""moelab's auxiliary losses and per-step router state in torchtitan's training.

torchtitan's ``MoE.forward`` returns only its output and the trainer's loss is
``loss_fn(pred, labels, global_valid_tokens)``: nothing carries a router's own loss.
Each :class:`~moelab.integrations.torchtitan.router.MoelabRouter` keeps the
RouterOutput of its latest forward (``last``), whose ``aux_loss`` is the weighted sum of
the losses its keys turn on (Switch ``aux_weight``, ``z_loss_weight``, ReLU routing's
L1 with ``l1_target``, ``entropy_loss_weight``):

- :func:`aux_loss` sums them over a model's routers, after its forward;
- :func:`with_aux_loss` wraps the trainer's loss function so that the returned loss
  includes it (scaled as torchtitan scales the cross-entropy: a micro-batch's aux loss
  is weighted by its share of the global batch's valid tokens), and returns it in its
  metrics as ``moelab_aux_loss`` (the 0.3.0 Trainer discards them);
- :func:`step_routers` advances the routers' per-step state (temperature schedules,
  moelab's own ``bias_rate`` bias, ReLU routing's adaptive L1 coefficient) once per
  optimizer step; :func:`register_router_steps` makes it a post-step hook of
  torchtitan's ``OptimizersContainer``, and :func:`with_router_steps` wraps a
  ``ModelSpec.post_optimizer_build_fn`` (the engine's own expert-bias hook) to add it.

Learned per-layer LapSum budgets (``swap_routers(model, k_total=...)``) need no loss of
their own: the allocator's k_l enter LapSum, which is differentiable in k, so the
training loss itself moves budget between layers (moelab's own model does the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from moelab.integrations.torchtitan.router import MoelabRouter, moelab_routers
from moelab.routing.router import step_routers as step_moelab_routers

__all__ = [
    "IGNORE_INDEX",
    "AuxLossWrapper",
    "aux_loss",
    "register_router_steps",
    "step_routers",
    "with_aux_loss",
    "with_router_steps",
]

IGNORE_INDEX = -100
"""The label torchtitan's cross-entropy ignores (its ``IGNORE_INDEX``)."""


def _routers(model: nn.Module) -> list[MoelabRouter]:
    found = [m for _, m in moelab_routers(model)]
    if not found:
        raise ValueError(
            "the model has no moelab router: call swap_routers(model, ...) or build it "
            "with MoelabRouterConverter first"
        )
    return found


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the moelab routers' ``aux_loss`` of the model's latest forward (a
    float32 scalar with the routers' graph; zero when no loss is on).

    Raises:
        ValueError: no moelab router, or a router that has not run a forward.
    """
    routers = _routers(model)
    outs = [r.last for r in routers]
    if any(o is None for o in outs):
        raise ValueError("run a forward of the model before reading its aux loss")
    total = torch.zeros((), dtype=torch.float32, device=routers[0].gate.weight.device)
    for out in outs:
        assert out is not None
        total = total + out.aux_loss
    return total


class AuxLossWrapper:
    """torchtitan's loss function plus the moelab routers' aux loss
    (:func:`with_aux_loss`); other attributes (``set_lm_head`` ...) are the wrapped
    loss's."""

    def __init__(self, loss_fn: Callable[..., Any], models: Iterable[nn.Module]) -> None:
        self.loss_fn = loss_fn
        self.models = list(models)

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.loss_fn(pred, labels, global_valid_tokens, **kwargs)
        aux = sum((aux_loss(m) for m in self.models), torch.zeros((), device=loss.device))
        if global_valid_tokens is not None:
            # NOTE: the engine's loss is this micro-batch's sum over the global batch's
            # valid tokens; a mean-type aux loss takes this micro-batch's share of them
            local = (labels != IGNORE_INDEX).sum()
            aux = aux * (local / global_valid_tokens)
        metrics = dict(metrics or {})
        metrics["moelab_aux_loss"] = aux.detach()
        return loss + aux.to(loss.dtype), metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loss_fn"], name)


def with_aux_loss(
    loss_fn: Callable[..., Any], model: nn.Module | list[nn.Module]
) -> AuxLossWrapper:
    """``loss_fn`` (the trainer's ``self.loss_fn``) returning ``(loss + aux, metrics)``,
    the aux loss of ``model``'s (or each model part's) moelab routers added:
    ``trainer.loss_fn = with_aux_loss(trainer.loss_fn, trainer.model_parts)``."""
    models = model if isinstance(model, list) else [model]
    for m in models:
        _routers(m)
    return AuxLossWrapper(loss_fn, models)


def step_routers(model: nn.Module | list[nn.Module]) -> None:
    """Once per optimizer step: ``Router.step`` of every moelab router that has run a
    forward, with its latest output (moelab.routing.router.step_routers: temperature
    schedule, moelab's own bias, ReLU routing's adaptive L1 over all layers)."""
    models = model if isinstance(model, list) else [model]
    ran = [r for m in models for r in _routers(m) if r.last is not None]
    step_moelab_routers([r.router for r in ran], [r.last for r in ran if r.last is not None])


def register_router_steps(optimizers: Any, model_parts: list[nn.Module]) -> Any:
    """:func:`step_routers` of ``model_parts`` as a step post-hook of torchtitan's
    ``OptimizersContainer`` (any torch Optimizer); returns the hook's handle."""
    return optimizers.register_step_post_hook(lambda *args, **kwargs: step_routers(model_parts))


def with_router_steps(post_optimizer_build_fn: Callable[..., Any] | None) -> Callable[..., Any]:
    """A ``ModelSpec.post_optimizer_build_fn`` that runs ``post_optimizer_build_fn``
    (the engine's, e.g. its expert-bias hook; None: none) and then
    :func:`register_router_steps`:
    ``spec.post_optimizer_build_fn = with_router_steps(spec.post_optimizer_build_fn)``."""

    def build(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
        if post_optimizer_build_fn is not None:
            post_optimizer_build_fn(optimizers, model_parts, parallel_dims)
        register_router_steps(optimizers, model_parts)

    return build
