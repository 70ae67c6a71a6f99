"""Tiny torchtitan models for the bridge's tests: a DeepSeek-V3 model config of the
debugmodel's layout at D = 32 (3 layers, the first dense, E = 8) and a bare MoE."""

from __future__ import annotations

from functools import partial

import torch
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3 import build_mla_moe_layers
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

DIM, VOCAB, E = 32, 64, 8


def _init(std: float) -> dict:
    return {"weight": partial(torch.nn.init.trunc_normal_, std=std), "bias": torch.nn.init.zeros_}


def tiny_dsv3(
    score: str = "softmax",
    norm: bool = False,
    scale: float = 1.0,
    groups: int | None = None,
    limited: int | None = None,
    top_k: int = 2,
) -> DeepSeekV3Model.Config:
    """The debugmodel's layout (MLA attention, FlexAttention, shared expert, first layer
    dense) at D = 32, 3 layers, E = 8, vocabulary 64."""
    rope_dim = 8
    layers = build_mla_moe_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=DIM,
        n_heads=2,
        q_lora_rank=0,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=rope_dim,
        v_head_dim=8,
        mscale=0.7,
        dense_hidden_dim=64,
        moe_hidden_dim=16,
        num_experts=E,
        num_shared_experts=1,
        router_top_k=top_k,
        router_score_func=score,  # type: ignore[arg-type]
        router_num_expert_groups=groups,
        router_num_limited_groups=limited,
        router_route_scale=scale,
        router_route_norm=norm,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=_init(0.3),
        norm_init={"weight": torch.nn.init.ones_},
        depth_init=lambda layer: _init(0.3),
        depth_experts_init=lambda layer: {
            "w1_EFD": partial(torch.nn.init.trunc_normal_, std=0.3),
            "w2_EDF": partial(torch.nn.init.trunc_normal_, std=0.3),
            "w3_EFD": partial(torch.nn.init.trunc_normal_, std=0.3),
        },
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="none"),
    )
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_init(1.0)
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_init(0.2)),
        layers=layers,
        mtp_layers=[],
    )


def moe_config(
    score: str = "softmax",
    norm: bool = False,
    scale: float = 1.0,
    groups: int | None = None,
    limited: int | None = None,
    top_k: int = 2,
    load_balance: float | None = 1e-3,
    dim: int = 16,
) -> MoE.Config:
    """A bare torchtitan MoE config (E = 8, hidden 32, no shared expert)."""
    init = _init(0.5)
    cfg = make_moe_config(
        num_experts=E,
        router=make_router_config(
            dim=dim,
            num_experts=E,
            gate_param_init=init,
            top_k=top_k,
            score_func=score,  # type: ignore[arg-type]
            route_norm=norm,
            route_scale=scale,
            num_expert_groups=groups,
            num_limited_groups=limited,
        ),
        routed_experts=make_routed_experts_config(
            dim=dim,
            hidden_dim=32,
            num_experts=E,
            top_k=top_k,
            param_init={k: init["weight"] for k in ("w1_EFD", "w2_EDF", "w3_EFD")},
            comm_backend="standard",
        ),
    )
    cfg.load_balance_coeff = load_balance
    return cfg


def build(cfg, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Build ``cfg`` on the meta device and initialise it as torchtitan's trainer does
    (``to_empty``, ``init_states``), in ``dtype``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states()
    # NOTE: only a dtype other than the build's: .to() would cast the complex RoPE
    # table of a whole model to real
    return model if dtype == torch.float32 else model.to(dtype)
