"""A torchtitan MoE model, moelab routers and all, as a Hugging Face folder that moelab's
diagnostics read (``moelab stats --hf``, ``moelab eval --hf --top-k``, ``moelab analyze
--hf``).

:func:`export_hf` goes the engine's own way out and then moelab's:

1. the model's state dict in Hugging Face names through torchtitan's own
   ``Qwen3StateDictAdapter`` / ``DeepSeekV3StateDictAdapter.to_hf`` (what torchtitan's
   checkpointer writes with ``last_save_in_hf``: the grouped experts split per expert,
   the gate as ``mlp.gate.weight``, DeepSeek-V3's ``expert_bias_E`` as
   ``e_score_correction_bias``), with a ``Qwen3MoeConfig`` / ``DeepseekV3Config`` made
   from the model's config (:func:`hf_config`);
2. transformers loads that (its loader fuses the per-expert weights into its own
   layout);
3. :func:`moelab.integrations.hf.swap.swap_with_layer_keys` swaps its routers with each
   layer's RouterConfig, and the Router state of the torchtitan layer is loaded into
   it: the gate weight (with the null experts' rows), the selection bias (the engine's
   ``expert_bias_E`` as it is now), the temperature's state, ``top_k`` and the cut;
4. :func:`moelab.integrations.hf.saved.save_swapped` writes the folder (a plain
   ``qwen3_moe`` / ``deepseek_v3`` folder plus ``moelab_routers.json`` / ``.safetensors``, which
   :func:`~moelab.integrations.hf.saved.load_swapped` and the CLI read), and the
   tokenizer, if given, goes beside it.

A model whose routers were not swapped is exported with the moelab Routers that
reproduce the engine's routing (``swap_routers`` with no keys on a copy).

What it takes: torchtitan's Qwen3 models (``torchtitan.models.qwen3``: MoE layers with
or without dense ones, separate or fused QKV) and DeepSeek-V3 models
(``torchtitan.models.deepseek_v3``: MLA with or without a q LoRA, shared experts, the
dense layers first, groups, YaRN RoPE as the ``debugmodel`` has it), with one RoPE
setting and one RMSNorm epsilon. Refused, in one line each: another model, a RoPE scaling
other than DeepSeek-V3's YaRN, multi-token prediction layers, a learned per-layer k
(``k_total``: the folder format holds one Router per layer, not the allocator), Qwen3
shared experts. The attention of the folder is transformers' causal attention over the
whole window: the same as torchtitan's block-causal masks for one document per
sequence.

Shape suffixes: E (moelab.shapes).
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from moelab.integrations.torchtitan.router import MoelabRouter, swap_routers

__all__ = ["export_hf", "hf_config", "load_checkpoint"]


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _family(model: nn.Module) -> tuple[str, Any]:
    """``(transformers model_type, the model's config)``; ValueError in one line for what
    export_hf cannot write."""
    config = getattr(model, "config", None)
    if isinstance(config, Qwen3Model.Config):
        family = "qwen3_moe"
    elif isinstance(config, DeepSeekV3Model.Config):
        family = "deepseek_v3"
    else:
        raise ValueError(
            "export_hf writes torchtitan's Qwen3 and DeepSeek-V3 models (as transformers' "
            f"qwen3_moe / deepseek_v3); this model is {type(model).__name__}"
        )
    if not _moe_layers(model):
        raise ValueError("this model has no MoE layer: export it with torchtitan's own "
                         "state dict adapter")  # fmt: skip
    ropes = {_rope_key(layer.attention.rope) for layer in config.layers}
    if len(ropes) != 1:
        raise ValueError("the layers' RoPE settings differ; transformers' configs hold one")
    scaling = config.layers[0].attention.rope.scaling
    allowed = ("none", "yarn") if family == "deepseek_v3" else ("none",)
    if scaling not in allowed:
        raise ValueError(
            f"RoPE scaling {scaling!r} has no mapping to {family}'s config here; "
            f"export a model with RoPE scaling {' or '.join(map(repr, allowed))}"
        )
    if family == "qwen3_moe":
        for i, layer in enumerate(config.layers):
            if layer.attention.qk_norm is None:
                raise ValueError(f"layer {i} has no q/k norm, which every qwen3_moe layer has")
            if layer.moe is not None and layer.moe.shared_experts is not None:
                raise ValueError(f"layer {i} has shared experts, which qwen3_moe has not")
    else:
        if config.mtp_layers:
            raise ValueError("multi-token prediction layers are not exported (transformers' "
                             "deepseek_v3 drops them); export a model without them")  # fmt: skip
        kinds = [layer.moe is not None for layer in config.layers]
        if kinds != sorted(kinds):
            raise ValueError("deepseek_v3 has its dense layers first (first_k_dense_replace); "
                             "this model's dense and MoE layers interleave")  # fmt: skip
    return family, config


def _rope_key(rope: Any) -> tuple:
    return tuple(
        (f.name, getattr(rope, f.name)) for f in dataclasses.fields(rope) if f.name != "param_init"
    )


def _v3_rope(attn: Any) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of a DeepSeek-V3 attention config: YaRN as
    torchtitan computes it (the frequencies' ramp between ``beta_fast`` and ``beta_slow``,
    floored / ceiled when ``truncate``; the rotation unscaled, ``attention_factor`` 1; the
    softmax scale times ``(0.1 mscale log(factor) + 1)^2``, ``mscale_all_dim``)."""
    rope = attn.rope
    if rope.scaling != "yarn" or rope.rope_factor <= 1.0:
        return {"rope_theta": rope.theta, "rope_type": "default"}
    return {
        "rope_theta": rope.theta,
        "rope_type": "yarn",
        "factor": float(rope.rope_factor),
        "original_max_position_embeddings": int(rope.original_seq_len),
        "beta_fast": float(rope.beta_fast),
        "beta_slow": float(rope.beta_slow),
        "truncate": bool(rope.truncate),
        "attention_factor": 1.0,
        "mscale_all_dim": float(attn.mscale),
    }


def _norm_eps(config: Any) -> float:
    """The one RMSNorm epsilon of the model (transformers' configs have one)."""
    found = {
        float(c.eps) for c in _configs_of(config) if type(c).__name__ == "Config" and
        hasattr(c, "normalized_shape") and hasattr(c, "eps")
    }  # fmt: skip
    if len(found) != 1:
        raise ValueError(f"the model's RMSNorms use several epsilons {sorted(found)}; "
                         "transformers' configs hold one")  # fmt: skip
    return found.pop()


def _configs_of(config: Any) -> list[Any]:
    """Every nested config dataclass of ``config`` (itself included)."""
    out, todo = [], [config]
    while todo:
        c = todo.pop()
        out.append(c)
        for f in dataclasses.fields(c):
            v = getattr(c, f.name, None)
            items = v if isinstance(v, list) else [v]
            todo.extend(x for x in items if dataclasses.is_dataclass(x))
    return out


def hf_config(config: Any) -> Any:
    """The transformers config (``Qwen3MoeConfig`` or ``DeepseekV3Config``) of a torchtitan
    ``Qwen3Model.Config`` or ``DeepSeekV3Model.Config``, routing fields from the engine's
    router (its score function aside: qwen3_moe is softmax and deepseek_v3 sigmoid, the
    moelab Routers beside the folder carry the map)."""
    import transformers as tf

    layers = config.layers
    moe_ids = [i for i, layer in enumerate(layers) if layer.moe is not None]
    dense_ids = [i for i, layer in enumerate(layers) if layer.moe is None]
    first = layers[moe_ids[0]]
    moe, attn = first.moe, first.attention
    experts = moe.routed_experts.inner_experts
    router = moe.router
    dense_width = layers[dense_ids[0]].feed_forward.w1.out_features if dense_ids else 4 * config.dim
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=len(layers),
        num_attention_heads=attn.n_heads,
        intermediate_size=dense_width,
        moe_intermediate_size=experts.hidden_dim,
        num_experts_per_tok=router.top_k,
        norm_topk_prob=bool(router.route_norm),
        rms_norm_eps=_norm_eps(config),
        max_position_embeddings=attn.rope.max_seq_len,
        tie_word_embeddings=bool(config.enable_weight_tying),
        attention_bias=False,
    )
    if isinstance(config, Qwen3Model.Config):
        return tf.Qwen3MoeConfig(
            **common,
            num_key_value_heads=attn.n_kv_heads or attn.n_heads,
            head_dim=attn.head_dim or config.dim // attn.n_heads,
            num_experts=moe.num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=dense_ids,
            rope_theta=attn.rope.theta,
        )
    shared = moe.shared_experts
    n_shared = shared.w1.out_features // experts.hidden_dim if shared is not None else 0
    if shared is not None and n_shared * experts.hidden_dim != shared.w1.out_features:
        raise ValueError("the shared experts' width is not a multiple of the experts' width, "
                         "which deepseek_v3's n_shared_experts needs")  # fmt: skip
    groups = router.num_expert_groups
    return tf.DeepseekV3Config(
        **common,
        num_key_value_heads=attn.n_heads,
        n_routed_experts=moe.num_experts,
        n_shared_experts=n_shared,
        first_k_dense_replace=len(dense_ids),
        routed_scaling_factor=float(router.route_scale),
        n_group=groups or 1,
        topk_group=router.num_limited_groups or 1,
        q_lora_rank=attn.q_lora_rank or None,
        kv_lora_rank=attn.kv_lora_rank,
        qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim,
        v_head_dim=attn.v_head_dim,
        rope_interleave=True,
        rope_parameters=_v3_rope(attn),
    )


def _plain_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with whole plain tensors (DTensors gathered) on the CPU
    (non-tensor entries, a module's extra state, as they are)."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return out


def _engine_state(model: nn.Module) -> dict[str, Any]:
    """The state dict torchtitan's adapter expects: the model's, with each swapped
    router's moelab-only entries left out (the gate keeps the engine's key)."""
    state = _plain_state(model)
    for name, module in model.named_modules():
        if isinstance(module, MoelabRouter):
            for key in list(state):
                if key.startswith(f"{name}.router."):
                    del state[key]
    return state


def _router_state(moe: MoE, titan: MoelabRouter, like: dict[str, Any]) -> dict[str, Any]:
    """The state dict of an HF swapped layer's moelab Router (names as in ``like``) from a
    torchtitan layer: the gate weight with the null rows, the scorer bias, the engine's
    current expert bias as the selection bias, every other entry by its name."""
    router = titan.router
    mine = router.state_dict()
    out: dict[str, Any] = {}
    for key in like:
        if key == "weight":
            out[key] = router.weight
        elif key == "scorer_bias":
            out[key] = router.scorer_bias
        elif key in mine:
            out[key] = mine[key]
        else:
            raise ValueError(f"the exported Router needs {key!r}, which the torchtitan "
                             "router's state lacks")  # fmt: skip
        if isinstance(out[key], DTensor):
            out[key] = out[key].full_tensor()
    bias_E = getattr(moe, "expert_bias_E", None)
    if bias_E is not None:  # the engine's bias, as the next forward would copy it in
        bias = out["bias"].detach().clone()
        full = bias_E.full_tensor() if isinstance(bias_E, DTensor) else bias_E
        bias[: full.shape[0]] = full.detach().to(bias.dtype)
        out["bias"] = bias
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def load_checkpoint(model: nn.Module, checkpoint: str | Path) -> nn.Module:
    """Load the model weights of a torchtitan checkpoint folder (``.../checkpoint/step-N``,
    torchtitan's distributed checkpoint: the model's state dict at the top level beside
    the optimizer's, the data loader's ...) into ``model``, built as for that training
    (the same config, :func:`~moelab.integrations.torchtitan.swap_routers` with the same
    keys); in one process unless a process group is running. Returns ``model``.

    Raises:
        FileNotFoundError: no such folder.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint folder (torchtitan writes "
                                "checkpoint/step-N)")  # fmt: skip
    state = model.state_dict()
    running = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(path), no_dist=not running)
    model.load_state_dict(state)
    return model


def export_hf(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the torchtitan Qwen3 MoE or DeepSeek-V3 ``model`` (its routers swapped by
    :func:`~moelab.integrations.torchtitan.swap_routers`, or the engine's own) into the
    folder ``path`` as a transformers ``qwen3_moe`` / ``deepseek_v3`` model with the
    moelab routers beside it (module docstring); ``tokenizer`` (a transformers
    tokenizer) is saved there too. Returns the path.

    Raises:
        ValueError: a model this cannot write (module docstring), in one line.
        FileExistsError: ``path`` holds files a previous save did not write.
    """
    from safetensors.torch import save_file

    from moelab.integrations.hf.families import import_transformers
    from moelab.integrations.hf.saved import save_swapped
    from moelab.integrations.hf.swap import swap_with_layer_keys

    family, config = _family(model)
    if any(isinstance(m, TokenChoiceTopKRouter) for m in model.modules()):
        model = copy.deepcopy(model)  # the engine's routers: the Routers that reproduce them
        swap_routers(model)
    titans = [m for m in model.modules() if isinstance(m, MoelabRouter)]
    if any(t.__dict__.get("_allocator") is not None for t in titans):
        raise ValueError("a learned per-layer k (k_total) is not exported: the folder holds "
                         "one Router per layer, not the allocator")  # fmt: skip
    adapter = Qwen3StateDictAdapter if family == "qwen3_moe" else DeepSeekV3StateDictAdapter
    hf_state = adapter(config, None).to_hf(_engine_state(model))
    with tempfile.TemporaryDirectory(prefix="moelab-export-") as tmp:
        hf_config(config).save_pretrained(tmp)
        save_file(
            {k: v.to(dtype).contiguous() for k, v in hf_state.items()},
            f"{tmp}/model.safetensors",
            metadata={"format": "pt"},
        )
        tf = import_transformers()
        tf.utils.logging.disable_progress_bar()  # as moelab's own loads do
        hf = tf.AutoModelForCausalLM.from_pretrained(
            tmp, local_files_only=True, dtype=dtype, use_safetensors=True
        )
    keys = [
        {k: v for k, v in dataclasses.asdict(t.router.config).items()
         if k not in ("d_model", "n_experts")}
        for t in titans
    ]  # fmt: skip
    swapped = swap_with_layer_keys(hf, {}, keys)
    moes = _moe_layers(model)
    with torch.no_grad():
        for moe, titan, new in zip(moes, titans, swapped, strict=True):
            state = _router_state(moe, titan, new.router.state_dict())
            new.router.load_state_dict(state, strict=True)
            new.router.top_k = titan.router.top_k
            new.router.truncation = titan.router.truncation
    hf.eval()
    out = save_swapped(hf, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
