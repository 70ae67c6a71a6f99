"""How far a token can move before its top-1 expert changes.

For a linear router with weight ``W`` (E, D) and temperature ``tau``, the softmax gate
``g(x) = softmax(W x / tau)`` is Lipschitz in ``x``::

    ||g(x) - g(y)||_2 <= ||W||_2 / (2 tau) * ||x - y||_2

because the softmax Jacobian ``J(z) = diag(p) - p p^T`` is symmetric positive
semi-definite with every Gershgorin disc inside ``[0, 2 p_i (1 - p_i)] ⊆ [0, 1/2]``, so
``||J||_2 <= 1/2``; the chain rule adds the factor ``||W||_2 / tau``.

If ``m(x)`` is the gap between the two largest gate values at ``x``, then for any
expert pair the gap can shrink by at most ``sqrt(2) ||g(y) - g(x)||_2``, so every ``y``
with::

    ||x - y||_2 < sqrt(2) * tau * m(x) / ||W||_2

keeps the top-1 expert of ``x``.  This is a worst-case certificate: most tokens can move
further.

Paper: *Stable Token Routing in Sparse MoE Models via Temperature-Controlled Gating*
(Theorem on the Lipschitz gate, Corollary on the certified radius).

Shape suffixes: T, D, E (moelab.shapes).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moelab.maps import compute_dtype
from moelab.routing.measures import top2_gap


def _as_float(t: Tensor) -> Tensor:
    """Half-precision inputs are computed in float32; float32/float64 as they are."""
    return t.to(compute_dtype(t.dtype))


def spectral_norm(weight_ED: Tensor) -> Tensor:
    """Exact spectral norm ``||W||_2`` (largest singular value) of the router weight.

    Uses ``torch.linalg.matrix_norm(W, ord=2)`` (an SVD); the Lipschitz temperature
    schedule tracks the same quantity cheaply by power iteration.
    """
    return torch.linalg.matrix_norm(_as_float(weight_ED), ord=2)


def gate_lipschitz(weight_ED: Tensor, tau: float | Tensor) -> Tensor:
    """Lipschitz constant ``||W||_2 / (2 tau)`` of ``x -> softmax(W x / tau)`` (2-norms)."""
    return spectral_norm(weight_ED) / (2 * tau)


def top1_margin(gates_TE: Tensor) -> Tensor:
    """``m_T``: largest minus second-largest gate value of each token (>= 0), the
    :func:`~moelab.routing.measures.top2_gap` of the gates.

    A tie for the top place gives 0 (and so a certified radius of 0).
    """
    return top2_gap(gates_TE)


def margin_radius(m_T: Tensor, tau: float | Tensor, weight_norm: float | Tensor) -> Tensor:
    """``r_T = sqrt(2) * tau * m_T / ||W||_2`` from the gate margins ``m_T``
    (:func:`top1_margin`) and the spectral norm ``||W||_2`` (:func:`spectral_norm`).

    Returns 0 where ``m = 0`` (tied top gate values) or ``||W||_2 = 0`` (a constant gate,
    whose top-1 never changes, reported as radius 0 rather than infinity), without dividing
    by zero. Computed in the dtype of ``m_T``.
    """
    norm = torch.as_tensor(weight_norm, dtype=m_T.dtype, device=m_T.device)
    radius_T = math.sqrt(2.0) * tau * m_T / norm.clamp_min(torch.finfo(m_T.dtype).tiny)
    return torch.where((m_T > 0) & (norm > 0), radius_T, torch.zeros_like(radius_T))


def certified_radius(x_TD: Tensor, weight_ED: Tensor, tau: float | Tensor) -> Tensor:
    """``r_T = sqrt(2) * tau * m(x) / ||W||_2``: top-1 is constant on the open ball ``B(x, r)``.

    ``m`` is :func:`top1_margin` of ``g(x) = softmax(x W^T / tau)``, computed in float32 (or
    float64 for float64 inputs).  Tokens whose top gate value is tied get radius 0, which
    also covers ``W = 0`` (uniform gates) (:func:`margin_radius`).
    """
    x_TD, weight_ED = _as_float(x_TD), _as_float(weight_ED)
    gates_TE = torch.softmax(x_TD @ weight_ED.t() / tau, dim=-1)
    return margin_radius(top1_margin(gates_TE), tau, spectral_norm(weight_ED))
