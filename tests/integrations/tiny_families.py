"""Tiny random configs of every MoE family of the installed transformers.

:func:`tiny_family_config` starts from a family's default config and shrinks every size
it knows (width 64, 2 layers, 8 experts, top-2, vocabulary 320; the MLA, Mamba and
linear-attention widths; the layer-type lists cut to 2 layers, both MoE), with the few
per-family settings a default does not give. Nothing is fetched."""

from __future__ import annotations

from typing import Any

VOCAB = 320

_SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts_per_tok=2,
    tie_word_embeddings=False,
    # Mamba / linear attention / short convolutions
    mamba_num_heads=4, mamba_head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
    mamba_dt_rank=8, mamba_chunk_size=16, mamba_n_groups=1, mamba_expand=2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_head_dim=16, linear_num_heads=4,
    use_mamba_kernels=False,
)  # fmt: skip
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_NARROW = (
    "shared_expert_intermediate_size", "expert_ffn_hidden_size", "ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_intermediate_size_shared",
)  # fmt: skip
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_SPARSE = {"dense": "sparse", "mlp": "moe"}


def text_type(model_type: str) -> str | None:
    """The model_type of a multimodal family's text model (its ``text_config``), or None
    for a text family."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    sub = getattr(CONFIG_MAPPING[model_type], "sub_configs", {}) or {}
    text = sub.get("text_config")
    if text is None:
        return None
    return getattr(text, "model_type", None)


def _layer_list(values: list[Any], moe_words: dict[str, str]) -> list[Any]:
    """A 2-layer version of a per-layer list: its first two distinct kinds (or the same
    kind twice), with dense feed-forward words turned into their MoE ones."""
    kinds = list(dict.fromkeys(values))
    two = (kinds * 2)[:2] if len(kinds) == 1 else kinds[:2]
    return [moe_words.get(v, v) if isinstance(v, str) else v for v in two]


def tiny_family_config(model_type: str, **overrides: Any) -> Any:
    """A tiny random config of ``model_type`` (a text MoE family of the installed
    transformers); ``overrides`` go to the constructor last."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    kw: dict[str, Any] = {k: v for k, v in _SMALL.items() if k in d}
    for k in _EXPERTS:
        if k in d:
            kw[k] = 8
    for k in _NARROW:
        if d.get(k):
            kw[k] = 32
    if "n_shared_experts" in d and d["n_shared_experts"] is None:
        kw["n_shared_experts"] = 1
    for k in _DENSE_FIRST:
        if k in d and isinstance(d[k], int):
            kw[k] = 0
    if d.get("n_group") not in (None, 1):
        kw.update(n_group=4, topk_group=2)
    if d.get("kv_lora_rank"):  # multi-head latent attention
        kw.update(kv_lora_rank=16, num_key_value_heads=4, head_dim=8)
        for k in ("qk_nope_head_dim", "v_head_dim"):
            if d.get(k):
                kw[k] = 16
        if d.get("qk_rope_head_dim"):
            kw["qk_rope_head_dim"] = 8
        if d.get("q_lora_rank"):
            kw["q_lora_rank"] = 32
    for k in ("layer_types", "mlp_layer_types", "layers_block_type"):
        if isinstance(d.get(k), list) and d[k]:
            kw[k] = _layer_list(d[k], _SPARSE if k != "layer_types" else {})
    if "layers_block_type" in kw:
        kw["layers_block_type"] = ["mamba" if "mamba" in d["layers_block_type"] else
                                   kw["layers_block_type"][0], "moe"]  # fmt: skip
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = d.get(k)
        if isinstance(v, int) and v >= VOCAB:
            kw[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
    if "expert_layer_period" in d:  # Jamba: every layer MoE; no attention layer in 2
        kw.update(expert_layer_period=1, expert_layer_offset=0)
    if "decoder_sparse_step" in d:
        kw["decoder_sparse_step"] = 1
    if "mlp_only_layers" in d:
        kw["mlp_only_layers"] = []
    kw.update(_FAMILY.get(model_type, {}))
    kw.update(overrides)
    return cls(**kw)


_FAMILY: dict[str, dict[str, Any]] = {
    "dbrx": dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=VOCAB,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 8, "moe_top_k": 2},
    ),
    "dots3_note_text": dict(num_key_value_heads=4),
    "bailing_hybrid": dict(num_experts_per_token=2, num_expert_group=4, topk_group=2,
                           num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16),
    "granitemoehybrid": dict(mamba_d_head=32),
    "lfm2_moe": dict(layer_types=["full_attention", "conv"]),
    "nemotron_h": dict(n_groups=1, moe_shared_expert_intermediate_size=32),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=2, heads_per_ngram=2),
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=32, num_key_value_heads=2),
    "zaya": dict(num_experts_per_tok=1),
    "longcat_flash": dict(num_layers=2, moe_topk=2, n_routed_experts=8, zero_expert_num=2,
                          ffn_hidden_size=128, expert_ffn_hidden_size=32),
    "jetmoe": dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=16),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
}  # fmt: skip
"""Settings a family's defaults and the shared shrinking do not give."""


def tiny_family_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 causal LM of ``model_type`` (:func:`tiny_family_config`), in eval
    mode; choice biases and router biases random (they are zero at init, which would hide
    them), and a token id -> experts table (DeepSeek-V4's ``tid2eid``, all zeros at init:
    expert 0 K times) of K distinct random experts per token id, as a checkpoint's."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_family_config(model_type, **overrides))
    model = model.float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buf.copy_(torch.randn_like(buf) * 0.1)
            if name.endswith("tid2eid") and buf.dim() == 2:
                n_experts = model.get_submodule(name.rpartition(".")[0]).weight.shape[0]
                gen = torch.Generator().manual_seed(seed)
                rows = torch.rand(buf.shape[0], n_experts, generator=gen).argsort(dim=1)
                buf.copy_(rows[:, : buf.shape[1]])
        for name, p in model.named_parameters():
            if name.endswith(("router.weight", "gate.weight")) and not p.abs().sum():
                p.normal_(0.0, 0.02)  # routers initialised at zero route by ties
    return model
