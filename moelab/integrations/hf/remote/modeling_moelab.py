"""A moelab model as a transformers causal LM (written by ``moelab export --format
remote``; loaded with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``).

The model is moelab's own ``Transformer``, rebuilt from ``config.moelab_model``, so every
router moelab has (sparse maps, LapSum, truncation, null experts, ...) routes exactly as
in training; this needs moelab installed. The weights are moelab's state dict under the
prefix ``model.``.

Shapes: input_ids_BS (B, S) token ids; logits_BSV (B, S, V).

Generation keeps no KV cache: each step recomputes the whole prefix (at most the model's
``max_seq_len`` tokens). ``attention_mask`` may mark right padding only (causal attention
never lets a position see later ones, so right padding changes no logit); left padding is
refused, since moelab's model has no mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moelab import MoelabConfig

try:
    from moelab.model import ModelConfig, Transformer
    from moelab.model.transformer import rope_tables
    from moelab.runs.checkpoints import set_extra_states
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "this model folder was written by `moelab export --format remote`: its code builds "
        "moelab's own Transformer, so moelab must be installed to load it (pip install "
        "moelab, the version config.json names in moelab_version); or export the run with "
        "--format native where its routers allow"
    ) from err


class MoelabForCausalLM(PreTrainedModel, GenerationMixin):
    """moelab's Transformer behind the transformers causal-LM interface:
    ``forward(input_ids_BS, labels=...) -> CausalLMOutputWithPast(logits, loss)``."""

    config_class = MoelabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ("Block",)

    def __init__(self, config: MoelabConfig) -> None:
        super().__init__(config)
        if not config.moelab_model:
            raise ValueError("config.json has no moelab_model: not a moelab export")
        self.model = Transformer(ModelConfig(**config.moelab_model))
        if config.moelab_extra_state:
            set_extra_states(self.model, config.moelab_extra_state)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Only the rotary tables (buffers not in the weights file, which transformers
        leaves empty when it loads); every parameter comes from model.safetensors, and a
        model built without loading keeps moelab's own initialisation."""
        if isinstance(module, Transformer):
            c = module.config
            cos_SC, sin_SC = rope_tables(c.max_seq_len, c.head_dim, c.rope_theta)
            with torch.no_grad():
                module.cos_SC.copy_(cos_SC.to(module.cos_SC.device))
                module.sin_SC.copy_(sin_SC.to(module.sin_SC.device))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The tensors of the state dict: the modules' extra state (the routers' top_k
        and cut, not tensors) travels in config.moelab_extra_state instead."""
        sd = super().state_dict(*args, **kwargs)
        for key in [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
            del sd[key]
        return sd

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """logits_BSV of moelab's model; with ``labels`` (B, S; -100 ignored) the mean
        next-token cross-entropy of logits[:, :-1] against labels[:, 1:] (the transformers
        convention: labels are the input ids, shifted here)."""
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)
            # right padding only: a row's ones come first (cummin of a row is the row)
            if not torch.equal(mask, mask.int().cummin(dim=-1).values.bool()):
                raise ValueError(
                    "moelab's model has no attention mask: left padding (or holes in the "
                    "mask) would change its logits; pad on the right, or run one sequence "
                    "at a time"
                )
        logits_BSV = self.model(input_ids, collect=False).logits_BSV
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]).float(),
                labels[:, 1:].reshape(-1).to(logits_BSV.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits_BSV)

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The whole prefix at every step (no KV cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
