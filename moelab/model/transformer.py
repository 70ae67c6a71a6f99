"""The model: a decoder-only transformer whose feed-forward is an MoE layer in some blocks.

Shape suffixes: B, S, D, F, H, Z, C, V, E, L (moelab.shapes).

One block (pre-norm):

    x = x + Attention(RMSNorm(x))        causal, rotary positions, Z key/value heads
    x = x + FF(RMSNorm(x))               SwiGLU, or an MoE layer of SwiGLU experts

then a final RMSNorm and an output projection separate from the input embedding.
RMSNorm: Zhang & Sennrich 2019 (arXiv:1910.07467); RoPE: Su et al. 2021
(arXiv:2104.09864); grouped-query attention: Ainslie et al. 2023 (arXiv:2305.13245);
SwiGLU: Shazeer 2020 (arXiv:2002.05202).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moelab.moe import MoE, SwiGLUExperts
from moelab.moe.null import ConstantExperts
from moelab.moe.shared import SharedExperts
from moelab.routing.allocation import LayerAllocator
from moelab.routing.output import RouterOutput

from .config import ModelConfig


@dataclass
class ModelOutput:
    """What the model returns for a batch of token ids."""

    logits_BSV: torch.Tensor  # next-token logits
    router_outputs: list[RouterOutput] = field(default_factory=list)  # one per MoE layer
    aux_loss: torch.Tensor | None = None  # scalar: sum of the routers' auxiliary losses
    loss: torch.Tensor | None = None  # mean next-token cross-entropy, when targets are given


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(x_BSD.dtype)


def rope_tables(
    seq_len: int, head_dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SC, sin_SC of the rotary embedding (computed in float64, returned in dtype),
    frequencies theta^(-2i/C) for the pairs (i, i + C/2) of a head's channels."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles_SC = torch.cat([angles, angles], dim=-1)
    return angles_SC.cos().to(dtype), angles_SC.sin().to(dtype)


def apply_rope(x_BHSC: torch.Tensor, cos_SC: torch.Tensor, sin_SC: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (i, i + C/2) at position s by the angle s * theta_i.

    A rotation keeps norms, and <R_m q, R_n k> = <q, R_{n-m} k> depends on m - n only.
    """
    # NOTE: at least float32 (also under bf16 autocast): the angles at late positions
    # need the precision; the result goes back to the input dtype.
    dtype = torch.promote_types(x_BHSC.dtype, torch.float32)
    x = x_BHSC.to(dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos_SC.to(dtype) + rotated * sin_SC.to(dtype)).to(x_BHSC.dtype)


_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
"""Whether scaled_dot_product_attention takes ``enable_gqa`` (torch >= 2.5)."""


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, no biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        d = config.d_model
        self.q_proj = nn.Linear(d, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(d, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(d, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, d, bias=False)

    def forward(
        self, x_BSD: torch.Tensor, cos_SC: torch.Tensor, sin_SC: torch.Tensor
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H, Z, C = self.n_heads, self.n_kv_heads, self.head_dim
        q_BHSC = self.q_proj(x_BSD).view(B, S, H, C).transpose(1, 2)
        k_BZSC = self.k_proj(x_BSD).view(B, S, Z, C).transpose(1, 2)
        v_BZSC = self.v_proj(x_BSD).view(B, S, Z, C).transpose(1, 2)
        q_BHSC = apply_rope(q_BHSC, cos_SC, sin_SC)
        k_BZSC = apply_rope(k_BZSC, cos_SC, sin_SC)
        # NOTE: query head h reads key/value head h // (H // Z). SDPA's enable_gqa
        # (torch >= 2.5) does so without copying the key/value heads (about 1.4x faster
        # forward+backward on the CPU at the tiny preset's shapes); older torch repeats.
        gqa = {}
        if Z != H and _SDPA_GQA:
            gqa = {"enable_gqa": True}
        elif Z != H:
            k_BZSC = k_BZSC.repeat_interleave(H // Z, dim=1)
            v_BZSC = v_BZSC.repeat_interleave(H // Z, dim=1)
        y_BHSC = F.scaled_dot_product_attention(q_BHSC, k_BZSC, v_BZSC, is_causal=True, **gqa)
        return self.o_proj(y_BHSC.transpose(1, 2).reshape(B, S, H * C))


class SwiGLU(nn.Module):
    """The dense feed-forward: W_down (silu(W_gate x) * W_up x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BSD)) * self.up_proj(x_BSD))


class Block(nn.Module):
    """Pre-norm attention + feed-forward (dense SwiGLU or MoE) with residuals; an MoE
    block routes with the RouterConfig of MoE layer ``moe_layer`` (its index among the
    MoE layers: ``ModelConfig.router_layers`` may give each its own)."""

    def __init__(self, config: ModelConfig, moe: bool, moe_layer: int | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.ff_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ff: nn.Module
        if moe:
            assert config.expert_d_ff is not None
            self.ff = MoE(config.moe_config(moe_layer))
        else:
            self.ff = SwiGLU(config.d_model, config.d_ff)
        self.is_moe = moe

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_SC: torch.Tensor,
        sin_SC: torch.Tensor,
        lapsum_k: torch.Tensor | None = None,
        idx_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterOutput | None]:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SC, sin_SC)
        h_BSD = self.ff_norm(x_BSD)
        if self.is_moe:
            y_BSD, out = self.ff(h_BSD, lapsum_k=lapsum_k, token_ids=idx_BS)
            return x_BSD + y_BSD, out
        return x_BSD + self.ff(h_BSD), None


class Transformer(nn.Module):
    """Decoder-only language model; ``forward(idx_BS)`` returns a `ModelOutput`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        moe = {block: layer for layer, block in enumerate(config.moe_indices)}
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config, i in moe, moe.get(i)) for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # learned allocation: one allocator shares the budget K over the MoE layers
        self.allocator: LayerAllocator | None = None
        if config.k_total is not None:
            self.allocator = LayerAllocator(
                len(config.moe_indices), config.k_total, config.n_experts
            )
        cos_SC, sin_SC = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        # NOTE: not persistent: the tables follow from the config, checkpoints need not
        # carry them.
        self.register_buffer("cos_SC", cos_SC, persistent=False)
        self.register_buffer("sin_SC", sin_SC, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) everywhere; the projections that write into the residual stream
        (attention output, feed-forward and expert down projections) get
        0.02 / sqrt(2 n_layers) (GPT-2), so the residual does not grow with depth at
        initialisation. Norm weights are 1; routers keep their own init_std."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, SwiGLUExperts):
                nn.init.normal_(module.w_gate_EFD, std=0.02)
                nn.init.normal_(module.w_up_EFD, std=0.02)
                nn.init.normal_(module.w_down_EDF, std=resid_std)
            elif isinstance(module, ConstantExperts):
                module.reset_parameters()
            elif isinstance(module, SharedExperts):
                module.reset_parameters()
                nn.init.normal_(module.w_down_DH, std=resid_std)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, std=resid_std)
            if isinstance(block.ff, SwiGLU):
                nn.init.normal_(block.ff.down_proj.weight, std=resid_std)

    @property
    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in block order."""
        return [b.ff for b in self.blocks if isinstance(b.ff, MoE)]

    def layer_budgets(self) -> torch.Tensor | None:
        """``k_L``: the learned LapSum budget of each MoE layer (sums to ``k_total``), or
        None without learned allocation."""
        return None if self.allocator is None else self.allocator()

    def forward(
        self,
        idx_BS: torch.Tensor,
        targets_BS: torch.Tensor | None = None,
        collect: bool = True,
    ) -> ModelOutput:
        """Args:
            idx_BS: token ids (int64).
            targets_BS: next-token ids for the loss; -100 marks positions to ignore.
            collect: keep each MoE layer's RouterOutput (diagnostics); False drops them
                once their auxiliary loss is added up.

        Returns:
            ModelOutput with logits_BSV, router_outputs (one per MoE layer, in order, when
            collect), aux_loss (their sum, a float32 scalar) and loss (when targets_BS).
        """
        B, S = idx_BS.shape
        if S > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {S} exceeds max_seq_len = {self.config.max_seq_len}; "
                "raise max_seq_len in the config or feed shorter sequences"
            )
        cos_SC, sin_SC = self.cos_SC[:S], self.sin_SC[:S]
        x_BSD = self.embed(idx_BS)
        outs: list[RouterOutput] = []
        aux = torch.zeros((), device=idx_BS.device, dtype=torch.float32)
        k_L = self.layer_budgets()
        i_moe = 0
        for block in self.blocks:
            k = None
            if k_L is not None and block.is_moe:
                k, i_moe = k_L[i_moe], i_moe + 1
            x_BSD, out = block(x_BSD, cos_SC, sin_SC, k, idx_BS)
            if out is not None:
                aux = aux + out.aux_loss
                if collect:
                    outs.append(out)
        logits_BSV = self.lm_head(self.norm(x_BSD))
        loss = None
        if targets_BS is not None:
            loss = F.cross_entropy(
                logits_BSV.reshape(B * S, -1).float(), targets_BS.reshape(B * S), ignore_index=-100
            )
        return ModelOutput(logits_BSV=logits_BSV, router_outputs=outs, aux_loss=aux, loss=loss)
