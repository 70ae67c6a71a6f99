"""Temperature and certified top-1 radii of a router, streamed over tokens.

For a linear router ``W`` (E, D) at temperature ``tau`` the gate
``g(x) = softmax(W x / tau)`` is ``L = ||W||_2 / (2 tau)``-Lipschitz, and no input
closer to ``x`` than::

    r(x) = sqrt(2) * tau * m(x) / ||W||_2        m(x) = g(x)_(1) - g(x)_(2)

changes its top-1 expert (:mod:`moelab.routing.certification`; paper: *Stable Token
Routing in Sparse MoE Models via Temperature-Controlled Gating*). The top-1 expert of
every map moelab has is the largest logit, the top-1 of this softmax gate, so ``r`` is
a certificate for any map; it ignores a selection bias (loss-free balancing), which can
move the choice without moving the gate.

:class:`CertificationStats` takes the layer's ``tau`` and ``||W||_2`` once and, per batch,
the :class:`~moelab.routing.RouterOutput` (its ``logits_TE = x W^T / tau``) and
optionally the norms ``||x_t||`` of the tokens the router saw, for the *relative*
radius ``r / ||x||`` (how far a token can move as a share of its own length). Fields of
:meth:`CertificationStats.result`:

``tau``, ``weight_norm``, ``lipschitz``
    the temperature, the exact spectral norm ``||W||_2`` and ``||W||_2 / (2 tau)``.
``radius_mean``, ``radius_p10``, ``radius_p50``, ``radius_p90``
    mean and percentiles of ``r`` over the token states.
``radius_rel_mean``, ``radius_rel_p10``, ``radius_rel_p50``, ``radius_rel_p90``
    the same for ``r / ||x||`` (None without token norms).
``radius_zero_frac``
    share of states whose two largest gate values tie (``r = 0``).

Percentiles: the radii span decades, so the histogram bins ``log10 r`` with width
``RADIUS_BIN = 0.001`` (:class:`~moelab.diagnostics.quantiles.BinnedQuantiles`); each
order statistic is within a factor ``10 ** (RADIUS_BIN / 2)`` (0.12 %) of the exact
one, exact zeros are counted apart, and an interpolated percentile stays within 0.12 %
of ``numpy.percentile``.

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moelab.diagnostics.quantiles import BinnedQuantiles, interpolated_percentile
from moelab.routing.certification import margin_radius, top1_margin
from moelab.routing.output import RouterOutput

__all__ = ["RADIUS_BIN", "CertificationStats"]

RADIUS_BIN = 0.001
"""Width of the bins of log10(radius): order statistics within a factor 10**0.0005."""
_LOG_LO, _LOG_HI = -15.0, 6.0
"""Binned range of log10(radius); radii outside it are kept exactly."""


class _LogQuantiles:
    """Percentiles of non-negative values: zeros counted, positives binned in log10."""

    def __init__(self) -> None:
        self.n_zero = 0
        self.logs = BinnedQuantiles(_LOG_LO, RADIUS_BIN, _LOG_HI)
        self.total = 0.0

    @property
    def n(self) -> int:
        return self.n_zero + self.logs.n

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[~np.isnan(values)]
        if (values < 0).any():
            raise ValueError("radii are >= 0")
        zero = values == 0
        self.n_zero += int(zero.sum())
        self.logs.add(np.log10(values[~zero]))
        self.total += float(values.sum())

    def merge(self, other: _LogQuantiles) -> None:
        self.n_zero += other.n_zero
        self.logs.merge(other.logs)
        self.total += other.total

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def order_stats(self, ranks: np.ndarray) -> np.ndarray:
        """Order statistics: the zeros first, then the binned positive values."""
        values = np.zeros(len(ranks))
        positive = ranks >= self.n_zero
        if positive.any():
            values[positive] = 10.0 ** self.logs.order_stats(ranks[positive] - self.n_zero)
        return values

    def percentile(self, q: float) -> float | None:
        return interpolated_percentile(self.n, q, self.order_stats)


class CertificationStats:
    """Streaming certified top-1 radii of one MoE layer (see the module docstring).

    Args:
        tau: the router's temperature when the outputs were made.
        weight_norm: ``||W||_2`` of the router weight (e.g.
            :func:`moelab.routing.certification.spectral_norm`).
    """

    def __init__(self, tau: float, weight_norm: float) -> None:
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        if not weight_norm >= 0:
            raise ValueError(f"weight_norm must be >= 0, got {weight_norm}")
        self.tau = float(tau)
        self.weight_norm = float(weight_norm)
        self.radius = _LogQuantiles()
        self.radius_rel = _LogQuantiles()

    @property
    def n_states(self) -> int:
        """Token states seen."""
        return self.radius.n

    def radii(self, out: RouterOutput) -> torch.Tensor:
        """``r_T`` of the tokens in ``out`` (float64; 0 where the top gate value ties)."""
        logits_TE = out.logits_TE.detach().to(torch.float64)
        m_T = top1_margin(torch.softmax(logits_TE, dim=-1))
        return margin_radius(m_T, self.tau, self.weight_norm)

    @torch.no_grad()
    def update(self, out: RouterOutput, x_norm_T: torch.Tensor | None = None) -> CertificationStats:
        """Add the tokens of ``out``; ``x_norm_T`` are the norms of the router's inputs
        (for the relative radii). Returns self."""
        r_T = self.radii(out)
        return self.add(r_T, None if x_norm_T is None else self.relative(r_T, x_norm_T))

    @staticmethod
    def relative(r_T: torch.Tensor, x_norm_T: torch.Tensor) -> torch.Tensor:
        """``r / ||x||`` per token (0 for a zero token)."""
        x_norm_T = x_norm_T.detach().to(torch.float64).reshape(-1)
        if x_norm_T.shape != r_T.shape:
            raise ValueError(f"x_norm_T has {x_norm_T.numel()} entries for {r_T.numel()} tokens")
        return torch.where(x_norm_T > 0, r_T / x_norm_T.clamp_min(1e-300), 0.0)

    def add(self, r_T: torch.Tensor, rel_T: torch.Tensor | None = None) -> CertificationStats:
        """Add radii already computed (:meth:`radii`, :meth:`relative`). Returns self."""
        self.radius.add(r_T.cpu().numpy())
        if rel_T is not None:
            self.radius_rel.add(rel_T.cpu().numpy())
        return self

    def merge(self, other: CertificationStats) -> CertificationStats:
        """Add another accumulator of the same router state (other chunks or ranks)."""
        if (other.tau, other.weight_norm) != (self.tau, self.weight_norm):
            raise ValueError("cannot merge radii of routers with different tau or ||W||_2")
        self.radius.merge(other.radius)
        self.radius_rel.merge(other.radius_rel)
        return self

    def result(self) -> dict[str, Any]:
        """The fields of the module docstring as a JSON-ready dict."""
        n = self.radius.n
        res: dict[str, Any] = {
            "tau": self.tau,
            "weight_norm": self.weight_norm,
            "lipschitz": self.weight_norm / (2.0 * self.tau),
            "radius_mean": self.radius.mean(),
            "radius_zero_frac": self.radius.n_zero / n if n else None,
        }
        for q in (10, 50, 90):
            res[f"radius_p{q}"] = self.radius.percentile(q)
        res["radius_rel_mean"] = self.radius_rel.mean()
        for q in (10, 50, 90):
            res[f"radius_rel_p{q}"] = self.radius_rel.percentile(q)
        return res


CERT_FIELDS = (
    "tau",
    "weight_norm",
    "lipschitz",
    "radius_mean",
    "radius_zero_frac",
    "radius_p10",
    "radius_p50",
    "radius_p90",
    "radius_rel_mean",
    "radius_rel_p10",
    "radius_rel_p50",
    "radius_rel_p90",
)
"""Scalar fields of :meth:`CertificationStats.result`."""
