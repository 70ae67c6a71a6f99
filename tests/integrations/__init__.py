"""Shared helpers of the Hugging Face integration tests: tiny random MoE models of each
supported family (2 layers, E = 8, width 64), saved with a small byte-level BPE tokenizer
in ``save_pretrained`` layout. Nothing is fetched."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)
"""model_type of every family the tiny builder knows."""

VOCAB = 320
E, D, LAYERS = 8, 64, 2

TEXT = (
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes each token "
    "to a few experts; the router scores every expert and keeps the best ones. Sparse maps "
    "give exact zeros, softmax never does. Load balance matters when experts are many.\n"
)
"""A short English paragraph: the tokenizer's training text and the tests' data."""


def tiny_text(repeats: int = 4) -> str:
    """Deterministic test text (a few hundred tokens for repeats=4)."""
    return "".join(f"{i}: {TEXT}" for i in range(repeats))


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (<= VOCAB ids) trained on TEXT, as a
    PreTrainedTokenizerFast with <|endoftext|> as bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny random config of ``family`` (a model_type of FAMILIES): 2 layers, both MoE,
    E = 8 experts, width 64, top-2 (overrides go to the config)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=E)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **common,
            num_experts=E,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            num_experts=E,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=E, norm_topk_prob=False)
    elif family in ("deepseek_v2", "deepseek_v3"):
        ds: dict[str, Any] = dict(
            n_routed_experts=E,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        )
        if family == "deepseek_v2":
            ds.update(topk_method="group_limited_greedy", norm_topk_prob=False)
            cfg = tf.DeepseekV2Config(**{**common, "num_key_value_heads": 4, "head_dim": 8}, **ds)
        else:
            ds.update(norm_topk_prob=True)
            cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4, "head_dim": 8}, **ds)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(
            **{**common, "intermediate_size": 32},
            num_local_experts=E,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 causal LM of ``family`` (see tiny_config), in eval mode. The
    DeepSeek-V3 correction bias is set to random values so that it matters."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model = model.float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith("router.bias"):  # GPT-OSS router bias (zeros at init)
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def save_tiny(family: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random model of ``family`` and save it with the tiny tokenizer to
    ``path`` (save_pretrained layout: config, safetensors, tokenizer); returns the path."""
    path = Path(path)
    model = tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
