"""The ``native`` format of ``moelab export`` (:mod:`moelab.integrations.hf.export`):
transformers' own ``qwen2_moe`` (``Qwen2MoeForCausalLM``), no custom code. Exact
only when every router is a plain softmax top-k (with or without renormalisation):
:func:`native_obstacle` checks every RouterConfig field and the routers' state and
names the first one that prevents it. The mapping, per block (shapes as in
:mod:`moelab.model.transformer`; E experts, F expert width, N shared experts):

- attention: q/k/v/o as they are, with qwen2_moe's q/k/v biases set to exactly 0
  (``qkv_bias=True``, the layout every qwen2_moe reader expects); RMSNorms
  (float32, eps = norm_eps);
  RoPE with half-rotation pairs (i, i + C/2), theta = rope_theta. The one
  inexactness: transformers computes the cos/sin tables in float32, moelab in
  float64, so they differ by about 3e-7 at position 16, 9e-6 at 256, 7e-5 at 2048
  and 1.5e-4 at 4096 (head width 64, theta 1e4); the check covers positions up to
  :data:`~moelab.integrations.hf.export.CHECK_LEN`;
- a dense block: ``mlp.{gate,up,down}_proj`` = the SwiGLU's;
- an MoE block: ``mlp.gate.weight`` (E, D) = the router's weight; the experts'
  fused ``gate_up_proj`` (E, 2F, D) = [w_gate_EFD ; w_up_EFD] along F (transformers
  chunks the product into gate, then up), ``down_proj`` (E, D, F) = w_down_EDF;
  ``norm_topk_prob`` = renorm, ``num_experts_per_tok`` = the routers' top_k;
- shared experts: N SwiGLUs of width F are one of width N F (their hidden units
  never mix), so ``shared_expert.{gate,up,down}_proj`` are moelab's stacked (N F, D),
  (N F, D), (D, N F) matrices and ``shared_expert_intermediate_size`` = N F. qwen2_moe
  always multiplies them by sigmoid(x . w): moelab's shared gate gives w; without
  one, w = 0 (sigmoid(0) = 1/2) and the down projection is doubled, 1/2 (2 W h) = W h
  exactly in floating point. No shared experts: width 0 (an empty matrix product,
  exactly 0);
- which blocks are MoE: ``decoder_sparse_step`` = 2 for "every_second" (blocks
  1, 3, 5, ...), else 1 with the dense blocks in ``mlp_only_layers``.

Shape suffixes: D, F, E (moelab.shapes).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["native_obstacle", "write_native"]


# RouterConfig fields that do not change the forward pass of a model in eval mode
# (initialisation, exploration noise, auxiliary losses and their scopes, the update
# rates of training-time state; that state itself, the selection bias and the
# temperature, is checked on the routers).
_TRAINING_ONLY = frozenset(
    {
        "init_std",
        "noise_std",
        "jitter",
        "sample_extra",
        "aux_weight",
        "aux_probs",
        "aux_count",
        "z_loss_weight",
        "entropy_loss_weight",
        "aux_scope",
        "bias_rate",
        "bias_update",
        "bias_ema",
        "l1_rate",
        "l1_init",
    }
)

# fields the native format expresses (checked one by one below) or the model sets
_MAPPED = frozenset({"d_model", "n_experts", "vocab_size", "top_k", "renorm", "gate"})


def native_obstacle(model: Any) -> str | None:
    """Why the moelab Transformer ``model`` cannot be exported exactly as qwen2_moe, in
    words naming the setting ("router.map = 'sparsemax' (qwen2_moe routes with a
    softmax)"); None when it can. Strict: every RouterConfig field that changes routing
    in eval mode must be at its default, except top_k, renorm and the gate (renorm or
    the map's values), which qwen2_moe expresses; and the routers' state must be
    neutral (temperature 1, zero selection bias, one top_k for all layers, no cut)."""
    from moelab.routing.config import RouterConfig
    from moelab.routing.selection.topk import TopK

    config = model.config
    moe = model.moe_layers
    if not moe:
        return None
    if config.k_total is not None:
        return f"k_total = {config.k_total} (learned allocation of LapSum budgets)"
    rc = moe[0].config.router
    defaults = RouterConfig(d_model=rc.d_model, n_experts=rc.n_experts)
    if rc.map != "softmax":
        return f"router.map = {rc.map!r} (qwen2_moe routes with a softmax)"
    if rc.selection_rule is not TopK:  # the rule itself, not a subclass of it
        return f"router.selection = {rc.selection!r} (qwen2_moe selects the top-k)"
    if rc.gate_rule not in ("map", "renorm"):
        return f"router.gate = {rc.gate_rule!r} (qwen2_moe weighs by p, renormalised or not)"
    for f in dataclasses.fields(RouterConfig):
        if f.name in _TRAINING_ONLY or f.name in _MAPPED or f.name == "straight_through":
            continue
        value, default = getattr(rc, f.name), getattr(defaults, f.name)
        if value != default:
            return (
                f"router.{f.name} = {value!r} (qwen2_moe routes as with the default, {default!r})"
            )
    top_ks = set()
    for i, layer in enumerate(moe):
        router = layer.router
        if dataclasses.asdict(layer.config.router) != dataclasses.asdict(rc):
            return f"MoE layer {i} has another router config than layer 0"
        tau = float(router.temperature.tau)
        if tau != 1.0:
            return f"router temperature tau = {tau:g} in MoE layer {i} (qwen2_moe has none)"
        if bool((router.bias != 0).any()):
            return (
                f"router.bias_rate = {rc.bias_rate!r}: MoE layer {i} has a non-zero selection "
                "bias (qwen2_moe selects by p alone)"
            )
        if getattr(router, "truncation", 0.0):
            return f"router truncation = {router.truncation!r} in MoE layer {i}"
        top_ks.add(int(router.top_k))
        if layer.expert_dispatch is not None:
            return f"MoE layer {i} runs expert-parallel"
    if len(top_ks) > 1:
        return f"router top_k differs between MoE layers ({sorted(top_ks)})"
    return None


def _qwen2_moe_config(model: Any, tokenizer: Any) -> Any:
    """The Qwen2MoeConfig of ``model`` (see the module docstring for the mapping)."""
    from transformers import Qwen2MoeConfig

    c = model.config
    moe = set(c.moe_indices)
    if c.moe_layers == "every_second":
        step, dense = 2, []
    else:
        step, dense = 1, [i for i in range(c.n_layers) if i not in moe]
    layers = model.moe_layers
    top_k = int(layers[0].router.top_k) if layers else 1
    renorm = bool(layers[0].config.router.gate_rule == "renorm") if layers else False
    eos = int(tokenizer.eos_id)
    return Qwen2MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
        use_sliding_window=False,
        attention_dropout=0.0,
        decoder_sparse_step=step,
        mlp_only_layers=dense,
        num_experts=c.n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=c.expert_d_ff,
        shared_expert_intermediate_size=c.n_shared_experts * c.expert_d_ff,
        norm_topk_prob=renorm,
        qkv_bias=True,  # exactly 0 (_qwen2_moe_state): what every qwen2_moe reader expects
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
        architectures=["Qwen2MoeForCausalLM"],
    )


def _qwen2_moe_state(model: Any) -> dict[str, torch.Tensor]:
    """moelab's weights under qwen2_moe's names (module docstring), float32 copies."""
    from moelab.model.transformer import SwiGLU

    c = model.config
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = block.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = block.ff_norm.weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = getattr(block.attn, name).weight
        for name in ("q_proj", "k_proj", "v_proj"):  # moelab's attention has no biases
            rows = getattr(block.attn, name).weight.shape[0]
            sd[p + f"self_attn.{name}.bias"] = torch.zeros(rows)
        ff = block.ff
        if isinstance(ff, SwiGLU):
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{name}.weight"] = getattr(ff, name).weight
            continue
        sd[p + "mlp.gate.weight"] = ff.router.weight
        # (E, 2F, D): gate rows first, then up rows, as transformers chunks them
        sd[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [ff.experts.w_gate_EFD, ff.experts.w_up_EFD], dim=1
        )
        sd[p + "mlp.experts.down_proj"] = ff.experts.w_down_EDF
        shared = ff.shared
        if shared is None:
            d = c.d_model
            sd[p + "mlp.shared_expert.gate_proj.weight"] = torch.zeros(0, d)
            sd[p + "mlp.shared_expert.up_proj.weight"] = torch.zeros(0, d)
            sd[p + "mlp.shared_expert.down_proj.weight"] = torch.zeros(d, 0)
            sd[p + "mlp.shared_expert_gate.weight"] = torch.zeros(1, d)
            continue
        sd[p + "mlp.shared_expert.gate_proj.weight"] = shared.w_gate_HD
        sd[p + "mlp.shared_expert.up_proj.weight"] = shared.w_up_HD
        if shared.gate_D is not None:
            sd[p + "mlp.shared_expert.down_proj.weight"] = shared.w_down_DH
            sd[p + "mlp.shared_expert_gate.weight"] = shared.gate_D[None, :]
        else:
            # sigmoid(0) = 1/2 times twice the down projection: exact
            sd[p + "mlp.shared_expert.down_proj.weight"] = shared.w_down_DH * 2
            sd[p + "mlp.shared_expert_gate.weight"] = torch.zeros(1, c.d_model)
    return {k: v.detach().float().cpu().clone().contiguous() for k, v in sd.items()}


def write_native(model: Any, tokenizer: Any, folder: Path) -> str:
    from transformers import Qwen2MoeForCausalLM

    config = _qwen2_moe_config(model, tokenizer)
    with warnings.catch_warnings():
        # NOTE: no shared experts: transformers builds width-0 shared matrices
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        hf = Qwen2MoeForCausalLM(config)
    hf.load_state_dict(_qwen2_moe_state(model), strict=True)
    hf.eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return "Qwen2MoeForCausalLM"
