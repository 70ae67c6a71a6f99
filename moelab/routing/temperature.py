"""The temperature stage of the router: ``z_TE = scores_TE / tau``.

The stage takes its own settings, a :class:`TemperatureConfig` (the Router builds it from
``RouterConfig``). Three schedules, chosen by ``schedule`` from a small registry (a schedule is
one :class:`Schedule` subclass registered under its name; the temperature module asks it,
never compares its name):

``"fixed"``
    ``tau = temperature`` for the whole run.

``"lipschitz"``
    Hold the Lipschitz constant of the softmax gate ``g(x) = softmax(W x / tau)``,
    which is ``||W||_2 / (2 tau)`` (see :mod:`moelab.routing.certification`), at a
    target ``L*``.  The spectral norm of the router weight is tracked by one
    power-iteration step per training step, as in spectral normalisation::

        u       = W v / ||W v||
        v      <- W^T u / ||W^T u||          (= W^T W v / ||W^T W v||)
        sigma^  = ||W v||                    (with the updated v)
        tau     = max(tau_min, sigma^ / (2 L*))

    Paper: *Stable Token Routing in Sparse MoE Models via Temperature-Controlled
    Gating*, Section "A temperature schedule".

``"cosine"``
    Anneal from ``temperature`` to ``tau_final`` over ``anneal_steps`` steps, then hold::

        tau_s = tau_final + (temperature - tau_final) * (1 + cos(pi * min(s, S) / S)) / 2

    e.g. 5 -> 1 for the LapSum router of *SoftMoE: Soft Differentiable Routing for
    Mixture-of-Experts in LLMs*.

The state (``tau``, ``step``, and for the Lipschitz schedule ``v`` and ``sigma_hat``)
lives in buffers, so it is saved and restored with the model's state dict and moves with
``.to(device)``.

Shape suffixes: T, D, E (moelab.shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from moelab.routing._registry import Registry

__all__ = [
    "Schedule",
    "Temperature",
    "TemperatureConfig",
    "available",
    "get",
    "register",
    "unregister",
]

_V_SEED = 0
"""Seed of the generator that draws the initial power-iteration vector."""


@dataclass(frozen=True)
class TemperatureConfig:
    """The temperature stage's settings (the ``RouterConfig`` keys of the same names),
    checked on construction."""

    d_model: int
    """D, the width of the router weight's rows (the Lipschitz schedule's vector v)."""
    schedule: str = "fixed"
    """"fixed", "lipschitz" or "cosine", a name of :func:`available`."""
    temperature: float = 1.0
    """Fixed temperature, and the start value of the schedules."""
    lipschitz_target: float = 1.0
    """L*: the gate Lipschitz constant ||W||_2 / (2 tau) that the schedule holds."""
    tau_min: float = 0.05
    """Lower bound of the Lipschitz schedule."""
    tau_final: float = 1.0
    """End value of the cosine anneal (from ``temperature``)."""
    anneal_steps: int = 1000
    """Length of the cosine anneal in training steps."""

    def __post_init__(self) -> None:
        get(self.schedule).check(self)  # an unknown name raises, naming the known ones
        for name in ("temperature", "tau_min", "tau_final", "lipschitz_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.anneal_steps <= 0:
            raise ValueError(f"anneal_steps must be positive, got {self.anneal_steps}")


class Schedule:
    """A temperature schedule: its checks, its extra state and its update rule.

    The state lives in the :class:`Temperature` module's buffers (``tau``, ``step``
    and the schedule's own from :meth:`buffers`), so that the state-dict keys of a
    run do not depend on how the schedule is written.
    """

    name: ClassVar[str] = ""
    """The registry key, the value of ``TemperatureConfig.schedule``."""
    moves: ClassVar[bool] = True
    """tau changes during training (False: ``update`` leaves every buffer alone)."""

    def __init__(self, config: TemperatureConfig) -> None:
        self.config = config

    @classmethod
    def check(cls, config: TemperatureConfig) -> None:
        """Raise ValueError, saying what to change, for settings this schedule cannot use."""

    def buffers(self, config: TemperatureConfig) -> dict[str, Tensor]:
        """The schedule's own state beside ``tau`` and ``step``, by buffer name."""
        return {}

    def update(self, temp: Temperature, weight_ED: Tensor) -> None:
        """One training step: move ``temp.tau`` (``temp.step`` was advanced already)."""

    def describe(self) -> str:
        """One line for ``repr``."""
        return f"schedule={self.name}, temperature={self.config.temperature}"


class Fixed(Schedule):
    """``tau = temperature`` for the whole run."""

    name = "fixed"
    moves = False


class Lipschitz(Schedule):
    """``tau = max(tau_min, sigma^ / (2 L*))`` with sigma^ the power-iteration estimate
    of ``||W||_2``: the gate's Lipschitz constant held at ``L* = lipschitz_target``."""

    name = "lipschitz"

    def buffers(self, config: TemperatureConfig) -> dict[str, Tensor]:
        # NOTE: a fixed seed makes the initial v (and so the whole schedule)
        # reproducible and independent of the global RNG state.
        gen = torch.Generator().manual_seed(_V_SEED)
        v_D = torch.randn(config.d_model, generator=gen, dtype=torch.float32)
        return {"v": v_D / v_D.norm(), "sigma_hat": torch.tensor(0.0, dtype=torch.float32)}

    def update(self, temp: Temperature, weight_ED: Tensor) -> None:
        """One power-iteration step on ``W``, then ``tau = max(tau_min, sigma^ / (2 L*))``."""
        d_model = self.config.d_model
        if weight_ED.dim() != 2 or weight_ED.shape[1] != d_model:
            raise ValueError(
                f"expected the router weight of shape (n_experts, d_model={d_model}), "
                f"got {tuple(weight_ED.shape)}"
            )
        w_ED = weight_ED.detach().to(device=temp.v.device, dtype=torch.float32)
        wv_E = w_ED @ temp.v
        # NOTE: keep the old vector where a norm is exactly zero (W = 0, or v orthogonal
        # to the row space of W) instead of dividing by zero; no host sync needed.
        n_wv = wv_E.norm()
        u_E = torch.where(n_wv > 0, wv_E / n_wv.clamp_min(1e-30), wv_E)
        wtu_D = w_ED.t() @ u_E
        n_wtu = wtu_D.norm()
        temp.v.copy_(torch.where(n_wtu > 0, wtu_D / n_wtu.clamp_min(1e-30), temp.v))
        # NOTE: sigma^ is measured with the *updated* v; ||W v|| <= ||W||_2 for a unit v, so
        # the estimate approaches the spectral norm from below.
        sigma = (w_ED @ temp.v).norm()
        temp.sigma_hat.copy_(sigma)
        tau = sigma / (2.0 * self.config.lipschitz_target)
        temp.tau.copy_(torch.clamp(tau, min=self.config.tau_min))

    def describe(self) -> str:
        c = self.config
        return f"schedule=lipschitz, lipschitz_target={c.lipschitz_target}, tau_min={c.tau_min}"


class Cosine(Schedule):
    """Anneal from ``temperature`` to ``tau_final`` over ``anneal_steps`` steps, then hold."""

    name = "cosine"

    def update(self, temp: Temperature, weight_ED: Tensor) -> None:
        c = self.config
        s = torch.clamp(temp.step, max=c.anneal_steps).to(torch.float32)
        cos = torch.cos(math.pi * s / c.anneal_steps)
        temp.tau.copy_(c.tau_final + (c.temperature - c.tau_final) * 0.5 * (1.0 + cos))

    def describe(self) -> str:
        c = self.config
        return f"schedule=cosine, {c.temperature} -> {c.tau_final} over {c.anneal_steps} steps"


_SCHEDULES: Registry[type[Schedule]] = Registry("schedule")
register = _SCHEDULES.register
unregister = _SCHEDULES.unregister
available = _SCHEDULES.available
get = _SCHEDULES.get


for _schedule in (Fixed, Lipschitz, Cosine):
    register(_schedule)


class Temperature(nn.Module):
    """Router temperature following the configured :class:`Schedule`.

    Buffers (all in the state dict):
        tau        float32 scalar, the current temperature (starts at ``config.temperature``).
        step       int64 scalar, number of ``update()`` calls that advanced a schedule.
        v          float32 (D,), unit vector of the power iteration (``"lipschitz"`` only).
        sigma_hat  float32 scalar, the latest estimate of ``||W||_2`` (``"lipschitz"`` only;
                   0 before the first update).

    Call :meth:`update` once per training step (after the optimiser step, under no_grad);
    ``forward(scores_TE)`` divides the scores by the current ``tau``.
    """

    tau: Tensor
    step: Tensor
    v: Tensor
    sigma_hat: Tensor

    def __init__(self, config: TemperatureConfig) -> None:
        super().__init__()
        self.rule = get(config.schedule)(config)
        self.schedule: str = config.schedule
        self.register_buffer("tau", torch.tensor(float(config.temperature), dtype=torch.float32))
        self.register_buffer("step", torch.tensor(0, dtype=torch.int64))
        for name, value in self.rule.buffers(config).items():
            self.register_buffer(name, value)

    @property
    def value(self) -> float:
        """The current temperature as a Python float (synchronises with the device)."""
        return float(self.tau.item())

    def forward(self, scores_TE: Tensor) -> Tensor:
        """``z_TE = scores_TE / tau``."""
        return scores_TE / self.tau.to(scores_TE.dtype)

    @torch.no_grad()
    def update(self, weight_ED: Tensor) -> None:
        """Advance the schedule by one training step.

        ``weight_ED`` is the router weight ``W`` (E, D) (the scorer computes
        ``scores_TE = x_TD W^T``); only the ``"lipschitz"`` schedule reads it. A schedule
        that does not move (``"fixed"``) leaves every buffer alone; the others add one to
        ``step`` and move ``tau``.
        """
        if not self.rule.moves:
            return
        self.step.add_(1)
        self.rule.update(self, weight_ED)

    def extra_repr(self) -> str:
        return self.rule.describe()
