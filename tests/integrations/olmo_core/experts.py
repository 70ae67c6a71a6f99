"""A CPU stand-in for OLMo-core's expert dispatch, for the tests.

OLMo-core's ``ParallelMLP`` / ``ParallelDroplessMLP`` permute the tokens with Triton
kernels (``olmo_core.kernels.moe``), which cannot run without a GPU driver. The MoE
block's forward (router, aux-loss attachment, shared MLP, combine) is OLMo-core's own;
only ``block.experts`` is replaced by :class:`LoopExperts`: the same call and the same
``MoEMLP`` weights (OLMo-core's SwiGLU expert), computed by a loop over experts.

Shape suffixes: T, D, K (moelab.shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoopExperts(nn.Module):
    """``forward(x, expert_weights, expert_indices, batch_size_per_expert)`` as
    OLMo-core's ParallelMLP: sum over the K slots of weight times the slot's expert,
    ``silu(x W1_e) * (x W3_e) W2_e``, on the block's own ``MoEMLP`` weights."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        expert_weights: torch.Tensor,
        expert_indices: torch.Tensor,
        batch_size_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        m = self.mlp
        E, D, H = m.num_experts, m.d_model, m.hidden_size
        w1, w2, w3 = m.w1.view(E, D, H), m.w2.view(E, H, D), m.w3.view(E, D, H)
        x_TD = x.reshape(-1, D)
        T = x_TD.shape[0]
        weights_TK, ids_TK = expert_weights.reshape(T, -1), expert_indices.reshape(T, -1)
        y_TD = torch.zeros_like(x_TD)
        for e in range(E):
            t, k = (ids_TK == e).nonzero(as_tuple=True)
            h = (F.silu(x_TD[t] @ w1[e]) * (x_TD[t] @ w3[e])) @ w2[e]
            y_TD = y_TD.index_add(0, t, h * weights_TK[t, k, None].to(h.dtype))
        return y_TD.view(x.shape)


def loop_experts(model: nn.Module) -> nn.Module:
    """``model`` with every MoE block's experts replaced by :class:`LoopExperts`."""
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if experts is not None and hasattr(experts, "mlp") and not isinstance(experts, LoopExperts):
            m.experts = LoopExperts(experts.mlp)
    return model
