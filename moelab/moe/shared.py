"""Shared experts: N always-on SwiGLU experts beside the routed ones (DeepSeekMoE, Dai et
al., 2024, https://arxiv.org/abs/2401.06066), optionally behind a learned sigmoid gate
(Qwen2-MoE, https://qwenlm.github.io/blog/qwen-moe/).

Shape suffixes: T, D, F (moelab.shapes); the parameter names keep H, the N experts'
hidden width N * F (moelab.shapes.KEPT_NAMES).

Every token passes through every shared expert, so the layer adds

    shared(x) = g(x) * sum_{s < N} W_down_s (silu(W_gate_s x) * (W_up_s x)),
    g(x) = sigmoid(x . w) with shared_gate (w a learned (D,) vector), else 1.

N SwiGLU experts of width F summed are one SwiGLU of width N * F: stacking the experts'
gate and up projections along the hidden axis and their down projections along the
input axis gives ``W_down (silu(W_gate x) * (W_up x))`` with (H, D), (H, D) and (D, H)
matrices, since the hidden units never mix. So the N experts run as three matrix
products over all T tokens, with no dispatch and no loop; expert s owns hidden rows
``s * F : (s + 1) * F`` (:meth:`SharedExperts.forward_expert`, the per-expert form the
tests compare against).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """N always-on SwiGLU experts of hidden width F, as one SwiGLU of width N * F.

    Parameters:
        w_gate_HD: (N * F, D) gate projections of the N experts, stacked.
        w_up_HD: (N * F, D) up projections, stacked.
        w_down_DH: (D, N * F) down projections, side by side.
        gate_D: (D,) the sigmoid gate's vector w (only with ``gate=True``).
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, gate: bool = False) -> None:
        super().__init__()
        if min(n_experts, d_model, d_ff) <= 0:
            raise ValueError(
                f"shared experts need n_experts, d_model, d_ff > 0; got {n_experts}, "
                f"{d_model}, {d_ff}"
            )
        self.n_experts, self.d_model, self.d_ff = n_experts, d_model, d_ff
        hidden = n_experts * d_ff
        self.w_gate_HD = nn.Parameter(torch.empty(hidden, d_model))
        self.w_up_HD = nn.Parameter(torch.empty(hidden, d_model))
        self.w_down_DH = nn.Parameter(torch.empty(d_model, hidden))
        self.gate_D = nn.Parameter(torch.empty(d_model)) if gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As the routed experts (`SwiGLUExperts.reset_parameters`): Normal(0, 0.02) for the
        input projections and the gate vector, 0.02/sqrt(2) for the down projection (the
        transformer rescales it with its depth, as for every residual-writing projection)."""
        nn.init.normal_(self.w_gate_HD, std=0.02)
        nn.init.normal_(self.w_up_HD, std=0.02)
        nn.init.normal_(self.w_down_DH, std=0.02 / math.sqrt(2))
        if self.gate_D is not None:
            nn.init.normal_(self.gate_D, std=0.02)

    def gate(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """g(x) = sigmoid(x . w), shape (T, 1); None without a gate."""
        if self.gate_D is None:
            return None
        return torch.sigmoid(x_TD @ self.gate_D.unsqueeze(-1))

    def forward_expert(self, s: int, x_TD: torch.Tensor) -> torch.Tensor:
        """Shared expert ``s`` alone on x_TD, ungated, (T, D): the plain per-expert form
        (hidden rows ``s * F : (s + 1) * F``); tests sum it over s as the reference."""
        rows = slice(s * self.d_ff, (s + 1) * self.d_ff)
        h_TF = F.silu(F.linear(x_TD, self.w_gate_HD[rows])) * F.linear(x_TD, self.w_up_HD[rows])
        return F.linear(h_TF, self.w_down_DH[:, rows])

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``g(x) * sum_s expert_s(x)``, (T, D), as one SwiGLU of width N * F."""
        hidden = F.silu(F.linear(x_TD, self.w_gate_HD)) * F.linear(x_TD, self.w_up_HD)  # (T, N * F)
        y_TD = F.linear(hidden, self.w_down_DH)
        g_T1 = self.gate(x_TD)
        return y_TD if g_T1 is None else g_T1 * y_TD

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"gate={self.gate_D is not None}"
        )
