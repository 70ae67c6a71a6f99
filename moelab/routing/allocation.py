"""Learned allocation of active experts across MoE layers, and the truncation threshold.

A LapSum router keeps, per token, the experts whose soft top-k weight exceeds a threshold,
so its budget ``k`` is a mean, not a count.  One :class:`LayerAllocator` shared by all
MoE layers spreads a global budget ``K`` over the ``L`` layers::

    pi  = softmax(eta)                     eta in R^L, learned, zeros at init
    k_l = pi_l * (K - L) + 1               => sum_l k_l = K  and  k_l >= 1

The map is differentiable in ``eta`` and LapSum is differentiable in ``k``, so the
language-model loss itself moves budget between layers.  Each layer also caps the
experts it keeps per token at ``ceil(k_l * alpha)`` (:func:`cap`), and the truncation
threshold is set from the first batches so that about ``k`` experts are active
(:class:`ThresholdCalibrator`).

Paper: *SoftMoE: Soft Differentiable Routing for Mixture-of-Experts in LLMs* (learned
expert allocation across layers; implementation details).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_CAP_TOL = 1e-4
"""``cap`` ignores this much excess over an integer (float32 noise in ``k_l * alpha``)."""


def to_float(k: float | Tensor) -> float:
    """A Python float from a number or a 0-d tensor (detached: no autograd warning)."""
    return float(k.detach()) if isinstance(k, Tensor) else float(k)


def cap(k: float | Tensor, cap_factor: float) -> int:
    """Most experts a truncating layer keeps per token: ``ceil(k * cap_factor)`` (>= 1).

    ``k`` may be a 0-d tensor (e.g. one entry of :meth:`LayerAllocator.forward`); it is read
    as a Python float.  NOTE: ``k * cap_factor`` within ``1e-4`` above an integer rounds
    down to it, so a float32 ``k_l = 2.0000002`` with ``cap_factor = 2`` gives 4, not 5.
    The caller still clips the result to the number of experts.
    """
    if not cap_factor > 0:
        raise ValueError(f"cap_factor must be > 0, got {cap_factor}")
    k_val = to_float(k)
    if not k_val > 0:
        raise ValueError(f"k must be > 0, got {k_val}")
    return max(1, math.ceil(k_val * cap_factor - _CAP_TOL))


class LayerAllocator(nn.Module):
    """Global expert budget ``K`` split over ``L`` layers: ``k_l = softmax(eta)_l (K - L) + 1``.

    Args:
        n_layers: number of MoE layers ``L`` sharing the budget.
        k_total: global budget ``K`` = sum of the layers' mean active experts (e.g. ``2 L``
            for the compute of a top-2 router); must exceed ``L``.
        n_experts: experts per layer ``E``; the largest reachable ``k_l = K - L + 1`` must
            stay below ``E`` because LapSum needs ``k < E``.

    The single parameter ``eta`` (L,) starts at zero: every layer starts at ``k_l = K / L``.
    """

    def __init__(self, n_layers: int, k_total: float, n_experts: int) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        if not k_total > n_layers:
            raise ValueError(
                f"k_total = {k_total} must exceed n_layers = {n_layers}: every layer gets "
                "k_l >= 1 and only k_total - n_layers is left to allocate; raise k_total"
            )
        if not k_total - n_layers + 1 < n_experts:
            raise ValueError(
                f"a layer can reach k_l = k_total - n_layers + 1 = {k_total - n_layers + 1}, "
                f"but LapSum needs k < n_experts = {n_experts}; lower k_total below "
                f"{n_experts + n_layers - 1} or use more experts"
            )
        self.n_layers = n_layers
        self.k_total = float(k_total)
        self.n_experts = n_experts
        self.eta = nn.Parameter(torch.zeros(n_layers))

    def forward(self) -> Tensor:
        """``k_L``: each layer's mean number of active experts (sums to ``K``, each >= 1)."""
        return torch.softmax(self.eta, dim=0) * (self.k_total - self.n_layers) + 1.0

    cap = staticmethod(cap)

    def extra_repr(self) -> str:
        return f"n_layers={self.n_layers}, k_total={self.k_total}, n_experts={self.n_experts}"


class ThresholdCalibrator:
    """Truncation threshold from the map's values on the first batches.

    ``observe(probs_TE)`` stores (detached, on the CPU) the values of the map on every
    token; ``threshold(k)`` returns the ``tau`` for which the rule ``p > tau`` keeps, on the
    observed values, a mean number of experts per token as close to ``k`` as possible::

        s   = all observed values sorted in descending order   (N = T_total * E of them)
        n   = round(k * T_total)                             (clipped to N - 1)
        tau = s[n]

    Without ties exactly ``n`` values exceed ``s[n]``, so the mean is ``n / T_total``,
    within ``1 / (2 T_total)`` of ``k``; any ``tau`` in ``[s[n], s[n-1])`` gives the same
    count and this picks its lower end.  Ties: values equal to ``tau`` are *not* active
    (strict ``>``), so a run of equal values at position ``n`` (e.g. the exact zeros of a
    sparse map, or LapSum weights saturated at 1) makes the mean fall short of ``k``.

    The observed values are kept in memory until :meth:`reset`: use it for a few batches
    only (``ready(n)`` tells when ``n`` batches have been seen).
    """

    def __init__(self) -> None:
        self._values: list[Tensor] = []
        self._n_tokens = 0
        self._n_experts: int | None = None

    @property
    def n_batches(self) -> int:
        """Number of batches observed so far."""
        return len(self._values)

    @property
    def n_tokens(self) -> int:
        """Number of tokens observed so far (``T_total``)."""
        return self._n_tokens

    def ready(self, n_batches: int) -> bool:
        """Whether at least ``n_batches`` batches have been observed."""
        return self.n_batches >= n_batches

    @torch.no_grad()
    def observe(self, probs_TE: Tensor) -> None:
        """Record the map's values of one batch; any leading shape, experts last."""
        n_experts = probs_TE.shape[-1]
        if self._n_experts is not None and n_experts != self._n_experts:
            raise ValueError(
                f"observed {self._n_experts} experts before, now {n_experts}; "
                "use one calibrator per layer"
            )
        probs_TE = probs_TE.detach().reshape(-1, n_experts)
        self._n_experts = n_experts
        self._values.append(probs_TE.to(device="cpu", dtype=torch.float32).flatten())
        self._n_tokens += probs_TE.shape[0]

    def threshold(self, k: float | Tensor) -> float:
        """``tau`` such that about ``k`` experts per token have ``p > tau`` on the data seen.

        ``k`` must lie in ``(0, E)``; a 0-d tensor is read as a Python float.
        """
        if self._n_tokens == 0 or self._n_experts is None:
            raise RuntimeError("observe() at least one non-empty batch before threshold()")
        k_val = to_float(k)
        if not 0 < k_val < self._n_experts:
            raise ValueError(f"k must lie in (0, n_experts={self._n_experts}), got {k_val}")
        sorted_values = torch.cat(self._values).sort(descending=True).values
        n = min(round(k_val * self._n_tokens), sorted_values.numel() - 1)
        return float(sorted_values[n])

    def reset(self) -> None:
        """Forget every observed batch."""
        self._values.clear()
        self._n_tokens = 0
        self._n_experts = None
