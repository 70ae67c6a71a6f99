"""The model: causality through gradients, shapes, overfitting one batch, grouped-query
attention and RoPE against plain references, bf16 autocast, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.model import ModelConfig, Transformer
from moelab.model.transformer import Attention, apply_rope, rope_tables


def small_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        vocab_size=50,
        max_seq_len=16,
        moe_layers="every_second",
        n_experts=4,
        router={"top_k": 2},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize("moe_layers", ["none", "every_second", "all"])
def test_causal_through_gradients(moe_layers: str) -> None:
    """d output[t] / d embedding[t'] is exactly zero for every t' > t (and not for t' <= t)."""
    torch.manual_seed(0)
    model = Transformer(small_config(moe_layers=moe_layers)).double()
    B, S = 2, 8
    idx_BS = torch.randint(0, 50, (B, S))
    emb_BSD = model.embed(idx_BS).detach().requires_grad_()
    model.embed.register_forward_hook(lambda module, args, out: emb_BSD)
    logits_BSV = model(idx_BS).logits_BSV
    for t in range(S):
        (grad_BSD,) = torch.autograd.grad(logits_BSV[:, t].sum(), emb_BSD, retain_graph=True)
        assert torch.all(grad_BSD[:, t + 1 :] == 0), f"position {t} sees the future"
        assert torch.all(grad_BSD[:, : t + 1].abs().sum(-1) > 0), f"position {t} is cut off"


def test_output_shapes_and_router_outputs() -> None:
    torch.manual_seed(0)
    config = small_config(n_layers=4, router={"top_k": 2, "aux_weight": 0.01})
    assert config.moe_indices == [1, 3]
    model = Transformer(config)
    idx_BS = torch.randint(0, 50, (3, 7))
    out = model(idx_BS, targets_BS=idx_BS)
    assert out.logits_BSV.shape == (3, 7, 50)
    assert len(out.router_outputs) == 2
    for r in out.router_outputs:
        assert r.ids_TK.shape == (21, 2) and r.probs_TE.shape == (21, 4)
    assert out.aux_loss is not None and out.aux_loss.dim() == 0
    torch.testing.assert_close(out.aux_loss, sum(r.aux_loss for r in out.router_outputs))
    assert out.aux_loss > 0
    assert out.loss is not None and out.loss.dim() == 0 and torch.isfinite(out.loss)
    lean = model(idx_BS, collect=False)
    assert lean.router_outputs == [] and lean.loss is None
    torch.testing.assert_close(lean.aux_loss, out.aux_loss)
    torch.testing.assert_close(lean.logits_BSV, out.logits_BSV)


@pytest.mark.parametrize(
    ("moe_layers", "expected"),
    [("none", []), ("every_second", [1, 3]), ("all", [0, 1, 2, 3, 4]), ([4, 0], [0, 4])],
)
def test_moe_layer_placement(moe_layers: object, expected: list[int]) -> None:
    config = small_config(n_layers=5, moe_layers=moe_layers)
    assert config.moe_indices == expected
    model = Transformer(config)
    assert [i for i, b in enumerate(model.blocks) if b.is_moe] == expected
    routers = [m.router for m in model.moe_layers]
    assert len({id(r) for r in routers}) == len(expected)  # one router per MoE layer


def test_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = Transformer(small_config(d_model=64, d_ff=128, vocab_size=64))
    idx_BS = torch.randint(0, 64, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(150):  # the bound on the work (no timed assertion: timings are noisy)
        out = model(idx_BS[:, :-1], targets_BS=idx_BS[:, 1:], collect=False)
        assert out.loss is not None
        first = out.loss.item() if first is None else first
        opt.zero_grad()
        (out.loss + out.aux_loss).backward()
        opt.step()
        if out.loss.item() < 0.2 * first:
            break
    assert out.loss.item() < 0.2 * first, (first, out.loss.item())


def reference_attention(attn: Attention, x_BSD: torch.Tensor, cos_SC, sin_SC) -> torch.Tensor:
    """Plain attention: repeat every kv head for its H // G query heads, explicit causal
    softmax."""
    B, S, _ = x_BSD.shape
    H, G, C = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rope(attn.q_proj(x_BSD).view(B, S, H, C).transpose(1, 2), cos_SC, sin_SC)
    k = apply_rope(attn.k_proj(x_BSD).view(B, S, G, C).transpose(1, 2), cos_SC, sin_SC)
    v = attn.v_proj(x_BSD).view(B, S, G, C).transpose(1, 2)
    k_full = torch.stack([k[:, h // (H // G)] for h in range(H)], dim=1)
    v_full = torch.stack([v[:, h // (H // G)] for h in range(H)], dim=1)
    scores = q @ k_full.transpose(-1, -2) / math.sqrt(C)
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v_full
    return attn.o_proj(y.transpose(1, 2).reshape(B, S, H * C))


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 1), (4, 2), (4, 4), (6, 3)])
def test_gqa_matches_reference(n_heads: int, n_kv_heads: int) -> None:
    torch.manual_seed(0)
    config = small_config(d_model=48, n_heads=n_heads, n_kv_heads=n_kv_heads)
    attn = Attention(config).double()
    cos_SC, sin_SC = rope_tables(9, config.head_dim, dtype=torch.float64)
    x_BSD = torch.randn(2, 9, 48, dtype=torch.float64, requires_grad=True)
    y, y_ref = attn(x_BSD, cos_SC, sin_SC), reference_attention(attn, x_BSD, cos_SC, sin_SC)
    torch.testing.assert_close(y, y_ref)
    # and backward (SDPA's grouped-query path: no repeated key/value heads)
    g = torch.randn_like(y)
    wrt = [x_BSD, *attn.parameters()]
    for a, b in zip(
        torch.autograd.grad(y, wrt, g), torch.autograd.grad(y_ref, wrt, g), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_rope_keeps_norms_and_depends_on_relative_position() -> None:
    torch.manual_seed(0)
    S, C = 12, 16
    cos_SC, sin_SC = rope_tables(S, C, theta=100.0, dtype=torch.float64)
    x = torch.randn(1, 3, S, C, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos_SC, sin_SC).norm(dim=-1), x.norm(dim=-1))
    # the same q and k at every position: <R_m q, R_n k> must depend on m - n only
    q = torch.randn(C, dtype=torch.float64).expand(1, 1, S, C)
    k = torch.randn(C, dtype=torch.float64).expand(1, 1, S, C)
    dots_SS = apply_rope(q, cos_SC, sin_SC)[0, 0] @ apply_rope(k, cos_SC, sin_SC)[0, 0].T
    for delta in range(-S + 1, S):
        diag = torch.diagonal(dots_SS, offset=delta)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag))
    # and it does depend on it (the rotation is not the identity)
    assert not torch.allclose(dots_SS[0, 0], dots_SS[0, 1])


def test_runs_under_bf16_autocast_with_float32_router() -> None:
    torch.manual_seed(0)
    model = Transformer(small_config(router={"top_k": 2, "aux_weight": 0.01}))
    idx_BS = torch.randint(0, 50, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx_BS, targets_BS=idx_BS)
    assert out.logits_BSV.dtype == torch.bfloat16
    assert out.loss is not None and torch.isfinite(out.loss)
    assert out.aux_loss is not None and out.aux_loss.dtype == torch.float32
    for r in out.router_outputs:
        assert r.scores_TE.dtype == torch.float32 and r.probs_TE.dtype == torch.float32
        assert r.weights_TK.dtype == torch.float32 and r.aux_loss.dtype == torch.float32
    (out.loss + out.aux_loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_rejects_too_long_sequences() -> None:
    model = Transformer(small_config(max_seq_len=4))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 30}, "not divisible by n_heads"),
        ({"n_kv_heads": 3}, "divisors of n_heads"),
        ({"d_model": 12, "n_heads": 4}, "must be even"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"moe_layers": "odd"}, "moe_layers must be one of"),
        ({"moe_layers": [0, 2]}, "outside the blocks"),
        ({"moe_layers": [1, 1]}, "twice"),
        ({"router": {"top_k": 9}}, "top_k must lie"),
        ({"router": {"n_experts": 4}}, "set ModelConfig.n_experts"),
        ({"router": {"vocab_size": 99}}, "set ModelConfig.vocab_size"),
        ({"router": {"map": "nope"}}, "unknown map"),
        ({"expert_d_ff": 0}, "expert_d_ff must be positive"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_expert_width_defaults_to_dense_width() -> None:
    assert small_config().expert_d_ff == 48
    assert small_config(expert_d_ff=24).expert_d_ff == 24
    # a dense model does not check the (unused) router overrides against n_experts
    assert small_config(moe_layers="none", router={"top_k": 9}).moe_indices == []
