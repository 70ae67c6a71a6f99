"""moelab's MoE with a softmax, top-K, renormalised router computes what the
transformers Mixtral block computes with the same weights (the block that
`moelab bench moe` times against)."""

from __future__ import annotations

import pytest
import torch

from moelab import MoE, MoEConfig, RouterConfig
from moelab.bench.moe import _mixtral_block

pytest.importorskip("transformers")


@pytest.mark.parametrize(("n_experts", "top_k"), [(8, 2), (6, 3)])
def test_same_outputs_and_gradients_as_mixtral(n_experts: int, top_k: int) -> None:
    torch.manual_seed(0)
    rc = RouterConfig(d_model=32, n_experts=n_experts, top_k=top_k, renorm=True, init_std=0.5)
    moe = MoE(MoEConfig(d_model=32, d_ff=48, router=rc)).double()
    block = _mixtral_block(moe).double()
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    y, _ = moe(x)
    y_hf = block(x[None])[0]
    # the router computes in float32 by design; everything after it in float64
    torch.testing.assert_close(y, y_hf, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad((y * g).sum(), x)
    (dx_hf,) = torch.autograd.grad((y_hf * g).sum(), x)
    torch.testing.assert_close(dx, dx_hf, atol=1e-6, rtol=1e-5)
