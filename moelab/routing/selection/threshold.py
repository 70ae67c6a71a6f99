"""Truncation: each token keeps the experts whose map value p exceeds a cut, so the
number of experts varies per token (``selection="threshold"``, the SoftMoE paper's
``z * 1[z > tau]``).

The cut is ``Router.truncation`` (``RouterConfig.truncation`` at construction, then the
value calibrated on the first training batches); with ``truncation_relative`` (LapSum
only) it is read in units of k / E, the mean LapSum value, so the cut p > tau * k / E
follows a learned per-layer k. ``token_cap_factor`` caps the kept experts per token at
``ceil(k * token_cap_factor)`` (at most E); without it a token may keep every expert.
With ReLU routing's ``l1_target`` (:mod:`moelab.routing.relu_l1`, ReMoE: map="relu",
cut 0) k is that target and the cut is not calibrated: every positive gate is kept.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import math

import torch

from moelab.routing.allocation import cap, to_float
from moelab.routing.selection.base import Budget, Selected, Selection, SelectionConfig


def _nominal_k(config: SelectionConfig) -> float:
    """The configured k: ReLU routing's ``l1_target``, else LapSum's budget, else top_k."""
    if config.l1_target is not None:
        return float(config.l1_target)
    return float(config.lapsum_k if config.lapsum_k is not None else config.top_k)


class Threshold(Selection):
    """Experts with p > the cut, ranked by the ranking scores, at most K of them."""

    name = "threshold"
    truncates = True
    sweep = "threshold_scale"
    calibrates = True

    def __init__(self, config: SelectionConfig) -> None:
        super().__init__(config)
        # NOTE: under ReLU routing's adaptive L1 (l1_target) the L1 coefficient sets how
        # many experts pass, and the cut stays as configured (0: every positive gate)
        self.calibrates = config.l1_target is None  # type: ignore[misc]

    @classmethod
    def slots(cls, config: SelectionConfig, lapsum_k: float | torch.Tensor | None = None) -> int:
        """The cap ``min(E, ceil(k * token_cap_factor))``, k the call's ``lapsum_k`` (a
        learned per-layer k moves the cap with it) or the configured one; E without a
        cap."""
        factor, n_experts = config.token_cap_factor, config.n_experts
        if factor is None:
            return n_experts
        if lapsum_k is not None:
            return min(n_experts, cap(lapsum_k, factor))
        return min(n_experts, math.ceil(_nominal_k(config) * factor))

    @classmethod
    def expected_experts(cls, config: SelectionConfig) -> float:
        """The nominal k (``l1_target``, else ``lapsum_k``, else ``top_k``): the mean
        number of experts a calibrated cut, or ReLU routing's adaptive L1, aims at."""
        return _nominal_k(config)

    def cut(
        self, truncation: float, lapsum_k: float | torch.Tensor | None = None
    ) -> float | torch.Tensor:
        """``truncation``, or with ``truncation_relative`` ``truncation * k / E`` for the
        call's ``lapsum_k`` (else the configured one). A tensor k (a learned k_l) gives a
        detached 0-d tensor, so the forward pass needs no host sync for it."""
        config = self.config
        if not config.truncation_relative:
            return truncation
        k = config.lapsum_k if lapsum_k is None else lapsum_k
        assert k is not None  # RouterConfig: truncation_relative needs lapsum (and its k)
        if isinstance(k, torch.Tensor):
            return truncation * k.detach() / config.n_experts
        return truncation * float(k) / config.n_experts

    def stored(self, cut: float, lapsum_k: float | torch.Tensor) -> float:
        if self.config.truncation_relative:
            return cut * self.config.n_experts / to_float(lapsum_k)
        return cut

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        ids_TK = rank_TE.topk(self.slots(self.config, budget.lapsum_k), dim=-1).indices
        cut = self.cut(budget.truncation, budget.lapsum_k)
        return Selected(ids_TK, probs_TE.detach().gather(-1, ids_TK) > cut)
