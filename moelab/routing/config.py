"""Configuration of the router: one small dataclass, checked on construction
with messages that say what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelab import maps

SELECTIONS = ("topk", "threshold")
GATES = ("map", "renorm", "straight_through")
SCHEDULES = ("fixed", "lipschitz", "cosine")
AUX_PROBS = ("map", "softmax")


@dataclass
class RouterConfig:
    """Router = linear scorer (no bias) -> temperature -> map -> selection -> gate."""

    d_model: int
    """Width of the token representations."""
    n_experts: int
    """Number of experts E."""
    top_k: int = 2
    """Experts selected per token (selection="topk"); changeable at inference."""
    map: str = "softmax"
    """Probability map, a name of moelab.maps.available()."""
    alpha: float | None = None
    """alpha of entmax / normmax (defaults: 1.5 and 2.0)."""
    lapsum_k: float | None = None
    """k of the LapSum map (sum of the soft top-k weights); required for map="lapsum"."""
    renorm: bool = False
    """Renormalise the gate weights over the selected experts."""
    straight_through: bool = False
    """Gate weight 1 forward, gradient of log p backward (excludes renorm)."""
    selection: str = "topk"
    """"topk", or "threshold": keep experts with p > threshold (token-dependent count)."""
    threshold: float = 0.0
    """Truncation threshold on the map's values for selection="threshold"."""
    threshold_relative: bool = False
    """Read `threshold` in units of k / E, the mean LapSum value: the router keeps
    p > threshold * k / E (the SoftMoE paper's effective threshold), so the cut follows
    a learned per-layer k. LapSum only."""
    cap_factor: float | None = None
    """Cap ceil(k * cap_factor) on the experts a truncating router keeps per token."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the router weight."""
    temperature: float = 1.0
    """Fixed temperature, and the start value of the schedules."""
    schedule: str = "fixed"
    """"fixed", "lipschitz" (tau = max(tau_min, sigma / (2 L*))) or "cosine" anneal."""
    lipschitz_target: float = 1.0
    """L*: the gate Lipschitz constant ||W||_2 / (2 tau) that the schedule holds."""
    tau_min: float = 0.05
    """Lower bound of the Lipschitz schedule."""
    tau_final: float = 1.0
    """End value of the cosine anneal (from `temperature`)."""
    anneal_steps: int = 1000
    """Length of the cosine anneal in training steps."""
    noise_std: float = 0.0
    """Exploration: Gaussian noise of this std on the logits (training only)."""
    sample_extra: int = 0
    """Exploration: sample top_k of the top top_k + c experts by probability (training only)."""
    aux_weight: float = 0.0
    """Weight of the Switch balancing loss alpha * E * sum_i f_i P_i."""
    aux_probs: str = "map"
    """P_i of the Switch loss from the router's own map, or from a softmax of the logits."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2)."""
    bias_rate: float = 0.0
    """Auxiliary-loss-free balancing: sign-update rate of the selection bias (0: off)."""
    capacity_factor: float | None = None
    """Switch capacity factor (slots per expert = ceil(cf * T * K / E)); None: dropless."""

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_experts <= 0:
            raise ValueError("d_model and n_experts must be positive")
        if self.map not in maps.available():
            raise ValueError(
                f"unknown map {self.map!r}; choose one of {', '.join(maps.available())}"
            )
        if self.map in ("entmax", "normmax"):
            if self.alpha is None:
                self.alpha = 1.5 if self.map == "entmax" else 2.0
            if not self.alpha > 1:
                raise ValueError(f"alpha must be > 1 for {self.map}, got {self.alpha}")
        elif self.alpha is not None:
            raise ValueError(f"alpha only applies to entmax and normmax, not {self.map}")
        if self.map == "lapsum":
            if self.lapsum_k is None:
                raise ValueError("map='lapsum' needs lapsum_k (the soft top-k budget)")
            if not 0 < self.lapsum_k < self.n_experts:
                raise ValueError(
                    f"lapsum_k must lie in (0, n_experts={self.n_experts}), got {self.lapsum_k}"
                )
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must lie in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.renorm and self.straight_through:
            raise ValueError("choose one of renorm and straight_through, not both")
        if self.renorm and self.selection == "topk" and self.top_k == 1:
            raise ValueError(
                "renorm with top_k=1 makes every gate weight 1: the router gets no gradient. "
                "Use top_k >= 2, renorm=False, or straight_through=True."
            )
        if self.threshold_relative and self.map != "lapsum":
            raise ValueError(
                "threshold_relative reads the threshold in units of k / E, the mean LapSum "
                f"value; it needs map='lapsum', not {self.map!r}"
            )
        if self.cap_factor is not None and not self.cap_factor > 0:
            raise ValueError(f"cap_factor must be > 0, got {self.cap_factor}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("temperature", "tau_min", "tau_final", "lipschitz_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.anneal_steps <= 0:
            raise ValueError(f"anneal_steps must be positive, got {self.anneal_steps}")
        if self.noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {self.noise_std}")
        if self.sample_extra < 0:
            raise ValueError(f"sample_extra (c) must be >= 0, got {self.sample_extra}")
        if self.top_k + self.sample_extra > self.n_experts:
            raise ValueError(
                f"top_k + sample_extra = {self.top_k + self.sample_extra} exceeds "
                f"n_experts = {self.n_experts}"
            )
        if self.aux_probs not in AUX_PROBS:
            raise ValueError(f"aux_probs must be one of {AUX_PROBS}, got {self.aux_probs!r}")
        for name in ("aux_weight", "z_loss_weight", "bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}"
            )

    @property
    def slots(self) -> int:
        """K: selection slots per token."""
        if self.selection == "threshold":
            k = self.lapsum_k if self.lapsum_k is not None else self.top_k
            if self.cap_factor is None:
                return self.n_experts
            return min(self.n_experts, math.ceil(k * self.cap_factor))
        return self.top_k
