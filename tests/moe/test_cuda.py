"""The router and the MoE layer on CUDA: float64 agreement with the CPU and bf16
autocast with the router in float32. Skipped where no GPU is present (CI)."""

from __future__ import annotations

import pytest
import torch

from moelab import MoE, MoEConfig, Router, RouterConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "kw",
    [
        dict(map="softmax"),
        dict(map="entmax", alpha=1.5),
        dict(map="sparsemax"),
        dict(map="normmax", alpha=2.0, renorm=True),
    ],
    ids=lambda kw: kw["map"],
)
def test_moe_under_bf16_autocast_on_gpu(kw: dict) -> None:
    torch.manual_seed(0)
    rc = RouterConfig(d_model=64, n_experts=8, top_k=2, **kw)
    moe = MoE(MoEConfig(d_model=64, d_ff=128, router=rc)).to(CUDA)
    x = torch.randn(4, 32, 64, device=CUDA)
    with torch.autocast("cuda", torch.bfloat16):
        y, out = moe(x)
    # the router computes in float32 inside autocast
    assert out.probs_TE.dtype == torch.float32
    assert bool(torch.isfinite(y.float()).all())
    (y.float().square().mean() + out.aux_loss).backward()
    grads = [p.grad for p in moe.parameters() if p.requires_grad]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    # float32 forward agrees with the autocast one to bf16 accuracy
    y32, _ = moe(x)
    torch.testing.assert_close(y.float(), y32, atol=5e-2, rtol=5e-2)


def test_router_on_gpu_matches_cpu() -> None:
    torch.manual_seed(1)
    rc = RouterConfig(d_model=32, n_experts=8, top_k=2, map="entmax", alpha=1.5)
    router = Router(rc).double()
    x = torch.randn(96, 32, dtype=torch.float64)
    ref = router(x)
    out = router.to(CUDA)(x.to(CUDA))
    torch.testing.assert_close(out.probs_TE.cpu(), ref.probs_TE)
    torch.testing.assert_close(out.weights_TK.cpu(), ref.weights_TK)
    assert torch.equal(out.ids_TK.cpu(), ref.ids_TK)
