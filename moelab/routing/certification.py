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

Shape legend:
    T  tokens (batch and sequence flattened)
    D  model width
    E  experts
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _as_float(t: Tensor) -> Tensor:
    """Half-precision inputs are computed in float32; float32/float64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


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
    """``m_T``: largest minus second-largest gate value of each token (>= 0).

    A tie for the top place gives 0 (and so a certified radius of 0).
    """
    if gates_TE.shape[-1] < 2:
        raise ValueError(
            f"the top-1 margin needs at least 2 experts, got {gates_TE.shape[-1]}; "
            "with one expert the routing can never change"
        )
    top2_T2 = torch.topk(gates_TE, 2, dim=-1).values
    return top2_T2[..., 0] - top2_T2[..., 1]


def certified_radius(x_TD: Tensor, weight_ED: Tensor, tau: float | Tensor) -> Tensor:
    """``r_T = sqrt(2) * tau * m(x) / ||W||_2``: top-1 is constant on the open ball ``B(x, r)``.

    ``m`` is :func:`top1_margin` of ``g(x) = softmax(x W^T / tau)``, computed in float32 (or
    float64 for float64 inputs).  Tokens whose top gate value is tied get radius 0, which
    also covers ``W = 0`` (uniform gates) without dividing by zero.
    """
    x_TD, weight_ED = _as_float(x_TD), _as_float(weight_ED)
    gates_TE = torch.softmax(x_TD @ weight_ED.t() / tau, dim=-1)
    m_T = top1_margin(gates_TE)
    sigma = spectral_norm(weight_ED)
    # m > 0 implies W != 0, so the division is only used where it is finite.
    radius_T = math.sqrt(2.0) * tau * m_T / sigma.clamp_min(torch.finfo(sigma.dtype).tiny)
    return torch.where(m_T > 0, radius_T, torch.zeros_like(radius_T))
