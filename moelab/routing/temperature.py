"""The temperature stage of the router: ``z_TE = scores_TE / tau``.

Three schedules, chosen by ``RouterConfig.schedule``:

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

Shape legend:
    T  tokens (batch and sequence flattened)
    D  model width
    E  experts
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import RouterConfig

_V_SEED = 0
"""Seed of the generator that draws the initial power-iteration vector."""


class Temperature(nn.Module):
    """Router temperature with a fixed, Lipschitz-holding or cosine-annealed schedule.

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

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.schedule: str = config.schedule
        self.d_model: int = config.d_model
        self.temperature: float = float(config.temperature)
        self.lipschitz_target: float = float(config.lipschitz_target)
        self.tau_min: float = float(config.tau_min)
        self.tau_final: float = float(config.tau_final)
        self.anneal_steps: int = int(config.anneal_steps)

        self.register_buffer("tau", torch.tensor(self.temperature, dtype=torch.float32))
        self.register_buffer("step", torch.tensor(0, dtype=torch.int64))
        if self.schedule == "lipschitz":
            # NOTE: a fixed seed makes the initial v (and so the whole schedule)
            # reproducible and independent of the global RNG state.
            gen = torch.Generator().manual_seed(_V_SEED)
            v_D = torch.randn(self.d_model, generator=gen, dtype=torch.float32)
            self.register_buffer("v", v_D / v_D.norm())
            self.register_buffer("sigma_hat", torch.tensor(0.0, dtype=torch.float32))

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
        ``scores_TE = x_TD W^T``); only the ``"lipschitz"`` schedule reads it.
        ``"fixed"`` does nothing; ``"cosine"`` and ``"lipschitz"`` add one to ``step``.
        """
        if self.schedule == "fixed":
            return
        self.step.add_(1)
        if self.schedule == "lipschitz":
            self._power_step(weight_ED)
        elif self.schedule == "cosine":
            s = torch.clamp(self.step, max=self.anneal_steps).to(torch.float32)
            cos = torch.cos(math.pi * s / self.anneal_steps)
            tau = self.tau_final + (self.temperature - self.tau_final) * 0.5 * (1.0 + cos)
            self.tau.copy_(tau)
        else:  # pragma: no cover - RouterConfig rejects other names
            raise ValueError(f"unknown schedule {self.schedule!r}")

    def _power_step(self, weight_ED: Tensor) -> None:
        """One power-iteration step on ``W``, then ``tau = max(tau_min, sigma^ / (2 L*))``."""
        if weight_ED.dim() != 2 or weight_ED.shape[1] != self.d_model:
            raise ValueError(
                f"expected the router weight of shape (n_experts, d_model={self.d_model}), "
                f"got {tuple(weight_ED.shape)}"
            )
        w_ED = weight_ED.detach().to(device=self.v.device, dtype=torch.float32)
        wv_E = w_ED @ self.v
        # NOTE: keep the old vector where a norm is exactly zero (W = 0, or v orthogonal
        # to the row space of W) instead of dividing by zero; no host sync needed.
        n_wv = wv_E.norm()
        u_E = torch.where(n_wv > 0, wv_E / n_wv.clamp_min(1e-30), wv_E)
        wtu_D = w_ED.t() @ u_E
        n_wtu = wtu_D.norm()
        self.v.copy_(torch.where(n_wtu > 0, wtu_D / n_wtu.clamp_min(1e-30), self.v))
        # NOTE: sigma^ is measured with the *updated* v; ||W v|| <= ||W||_2 for a unit v, so
        # the estimate approaches the spectral norm from below.
        sigma = (w_ED @ self.v).norm()
        self.sigma_hat.copy_(sigma)
        self.tau.copy_(torch.clamp(sigma / (2.0 * self.lipschitz_target), min=self.tau_min))

    def extra_repr(self) -> str:
        if self.schedule == "lipschitz":
            return (
                f"schedule=lipschitz, lipschitz_target={self.lipschitz_target}, "
                f"tau_min={self.tau_min}"
            )
        if self.schedule == "cosine":
            return (
                f"schedule=cosine, {self.temperature} -> {self.tau_final} "
                f"over {self.anneal_steps} steps"
            )
        return f"schedule=fixed, temperature={self.temperature}"
