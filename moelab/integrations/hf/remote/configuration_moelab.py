"""Configuration of a moelab model exported for Hugging Face transformers (written by
``moelab export --format remote``; loaded with ``trust_remote_code=True``).

``moelab_model`` is moelab's whole ``ModelConfig`` as a dict (the one the training run
recorded, router included), from which ``modeling_moelab.MoelabForCausalLM`` rebuilds the
model; ``moelab_extra_state`` is the modules' extra state that the weights file cannot
hold (each router's inference ``top_k`` and truncation cut), keyed by module path.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig


class MoelabConfig(PreTrainedConfig):
    """moelab's ModelConfig, carried whole, with the few fields transformers reads
    (vocab_size, hidden_size, num_hidden_layers, max_position_embeddings) derived from it."""

    model_type = "moelab"

    moelab_model: dict[str, Any] | None = None
    moelab_extra_state: dict[str, Any] | None = None
    moelab_version: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
