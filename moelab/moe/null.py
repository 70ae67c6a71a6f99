"""What null experts add to the MoE layer's output (``RouterConfig.n_null_experts`` = M,
ids E .. E + M - 1): no dispatch and no expert FLOPs, a few vector operations per token.

Shape suffixes: T, D, M, K (moelab.shapes); a trailing 2 is a constant expert's two mixing
coefficients (``w_MCD`` keeps its C: moelab.shapes.KEPT_NAMES).

Each null slot (t, k) holding null expert m = ids[t, k] - E adds

    "zero"      nothing (AdaMoE);
    "identity"  w_tk x_t (MoE++'s copy expert; LongCat-Flash's zero-computation expert);
    "constant"  w_tk (a1 x_t + a2 v_m),  [a1, a2] = softmax(W_m x_t)   (MoE++'s constant
                expert: Jin et al., 2024, *MoE++: Accelerating Mixture-of-Experts Methods
                with Zero-Computation Experts*, https://arxiv.org/abs/2410.07348, where
                v_m in R^D and W_m in R^{2 x D} are trained).

With input gating (``MoEConfig.gate_on="input"``, Llama 4) every expert sees w_tk x_t in
place of x_t and its output is not weighed again: the zero and identity experts give the
same as above, a constant expert gives a1 w_tk x_t + a2 v_m with [a1, a2] =
softmax(W_m (w_tk x_t)) = softmax(w_tk W_m x_t).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConstantExperts", "null_output"]


class ConstantExperts(nn.Module):
    """M constant experts of width D (MoE++).

    Parameters:
        v_MD: (M, D) the constant vectors v_m, Normal(0, 0.02) at the start.
        w_MCD: (M, 2, D) the mixing matrices W_m; zero at the start, so a constant
            expert starts as (x + v_m) / 2 and W_m still gets gradient.
    """

    def __init__(self, n_experts: int, d_model: int) -> None:
        super().__init__()
        if min(n_experts, d_model) <= 0:
            raise ValueError(
                f"constant experts need n_experts, d_model > 0; got {n_experts}, {d_model}"
            )
        self.n_experts, self.d_model = n_experts, d_model
        self.v_MD = nn.Parameter(torch.empty(n_experts, d_model))
        self.w_MCD = nn.Parameter(torch.empty(n_experts, 2, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.v_MD, std=0.02)
        nn.init.zeros_(self.w_MCD)

    def forward_expert(self, m: int, x_TD: torch.Tensor) -> torch.Tensor:
        """Constant expert ``m`` alone on x_TD, ungated, (T, D): the plain form the tests
        compare against."""
        a_T2 = torch.softmax(x_TD @ self.w_MCD[m].t(), -1)
        return a_T2[:, :1] * x_TD + a_T2[:, 1:] * self.v_MD[m]

    def forward(
        self,
        x_TD: torch.Tensor,
        m_TK: torch.Tensor,
        null_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        gate_on: str = "output",
    ) -> torch.Tensor:
        """The sum over each token's null slots of their weighted outputs, (T, D).

        Args:
            x_TD: the tokens.
            m_TK: int64, the null expert of each slot (ids - E; any value where not null).
            null_TK: bool, the slots that took a null expert.
            weights_TK: the gate weights.
            gate_on: "output" (w E_m(x)) or "input" (E_m(w x)).
        """
        M = self.n_experts
        m_TK = m_TK.clamp(0, M - 1)
        # W_m x for every token and constant expert, then each slot's own: (T, K, 2)
        logit_TM2 = torch.einsum("td,mcd->tmc", x_TD, self.w_MCD.to(x_TD.dtype))
        T, K = m_TK.shape
        logit_TK2 = logit_TM2.gather(1, m_TK.unsqueeze(-1).expand(T, K, 2))
        w_TK = torch.where(null_TK, weights_TK.to(x_TD.dtype), 0)
        if gate_on == "input":  # the expert sees w x: logits w W x; its output unweighted
            a_TK2 = torch.softmax(w_TK.unsqueeze(-1) * logit_TK2, -1)
            x_coef_TK, v_coef_TK = a_TK2[..., 0] * w_TK, a_TK2[..., 1] * null_TK
        else:
            a_TK2 = torch.softmax(logit_TK2, -1)
            x_coef_TK, v_coef_TK = a_TK2[..., 0] * w_TK, a_TK2[..., 1] * w_TK
        # the v_m terms, summed per token and constant expert: (T, M) @ (M, D)
        v_coef_TM = v_coef_TK.new_zeros(T, M).scatter_add(1, m_TK, v_coef_TK)
        return x_coef_TK.sum(-1, keepdim=True) * x_TD + v_coef_TM @ self.v_MD.to(x_TD.dtype)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, d_model={self.d_model}"


def null_output(
    kind: str,
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    null_TK: torch.Tensor,
    n_experts: int,
    constants: ConstantExperts | None = None,
    gate_on: str = "output",
) -> torch.Tensor | None:
    """What the null slots add to y_TD (the module docstring); None for "zero"."""
    if kind == "zero":
        return None
    if kind == "identity":  # w x under either gating
        null_w_T1 = torch.where(null_TK, weights_TK, 0).sum(-1, keepdim=True)
        return null_w_T1 * x_TD
    if kind == "constant":
        assert constants is not None
        return constants(x_TD, ids_TK - n_experts, null_TK, weights_TK, gate_on)
    raise ValueError(f"unknown null expert {kind!r}")
