"""A moelab router selected in torchtitan's own config system: the converter on the
debugmodel's config, the --override.imports factory through torchtitan's CLI parser,
and a converter that raises the engine's top_k to the router's slots."""

from __future__ import annotations

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.config.override import apply_overrides
from torchtitan.models.common.moe import TokenChoiceTopKRouter
from torchtitan.models.deepseek_v3 import model_registry
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

from moelab.integrations.torchtitan import (
    MoelabRouter,
    MoelabRouterConverter,
    swap_routers,
    with_moelab_state,
)
from moelab.integrations.torchtitan.checkpoint import is_moelab_key
from moelab.integrations.torchtitan.config_registry import (
    ENTMAX,
    MoelabTrainer,
    deepseek_v3_debugmodel_entmax,
    qwen3_moe_debug_entmax,
)
from tests.integrations.torchtitan.tiny import VOCAB, build, tiny_dsv3


def _forward(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    masks = model.get_attention_masks(torch.arange(16).repeat(2, 1))
    with torch.no_grad():
        return model(tokens, attention_masks=masks)


def test_debugmodel_with_converter():
    """torchtitan's own debugmodel (model_registry, as its config_registry calls it) with
    the converter: meta build, verify_module_protocol, to_empty, init_states, forward."""
    spec = model_registry(
        "debugmodel", converters=[MoelabRouterConverter.Config(router_keys=ENTMAX)]
    )
    routers = list(spec.model.traverse(TokenChoiceTopKRouter.Config))
    assert len(routers) == 5 and all(type(c) is MoelabRouter.Config for _, c, _, _ in routers)
    model = build(spec.model)
    model.verify_module_protocol()
    swapped = [m for m in model.modules() if isinstance(m, MoelabRouter)]
    assert len(swapped) == 5 and swapped[0].router.config.alpha == 1.5
    logits = _forward(model, spec.model.vocab_size)
    assert logits.shape == (2, 16, spec.model.vocab_size) and torch.isfinite(logits).all()
    assert all(r.last is not None and r.last.ids_TK.shape[1] == 3 for r in swapped)


def test_override_from_the_command_line():
    """--override.imports with the router keys as JSON, parsed by torchtitan's
    ConfigManager and applied as its trainer applies overrides."""
    target = "moelab.integrations.torchtitan.converter.moelab_router"
    config = ConfigManager().parse_args(
        [
            "--module",
            "deepseek_v3",
            "--config",
            "deepseek_v3_debugmodel",
            "--override.imports",
            target + '={"map": "entmax", "alpha": 1.5}',
        ]
    )
    lines = apply_overrides(config.override, config)
    assert len(lines) == 5
    model_config = config.model_spec.model
    router = model_config.layers[1].moe.router
    assert type(router) is MoelabRouter.Config and router.router_keys == ENTMAX


def test_converter_raises_the_engine_top_k():
    cfg = MoelabRouterConverter.Config(router_keys={"top_k": 4}, fqns=["layers.2.*"])
    converted = cfg.build().convert(tiny_dsv3(top_k=2))
    moe1, moe2 = converted.layers[1].moe, converted.layers[2].moe
    assert type(moe1.router) is TokenChoiceTopKRouter.Config and moe1.router.top_k == 2
    assert moe2.router.top_k == 4 and moe2.routed_experts.token_dispatcher.top_k == 4
    model = build(converted)
    model.verify_module_protocol()
    assert _forward(model, VOCAB).isfinite().all()
    # every token counted at 4 distinct experts by the engine's routing map
    assert model.layers["2"].moe.tokens_per_expert_E.sum() == 2 * 16 * 4


def test_config_registry_for_torchtitans_launcher():
    """--module moelab.integrations.torchtitan --config NAME, as torchtitan's launcher
    parses it: a MoelabTrainer config whose routers are moelab's; the Qwen3 MoE config
    builds on the meta device and keeps the Module protocol."""
    config = ConfigManager().parse_args(
        ["--module", "moelab.integrations.torchtitan", "--config", "deepseek_v3_debugmodel_entmax"]
    )
    assert type(config) is MoelabTrainer.Config and config.loss is not None
    routers = [c for _, c, _, _ in config.model_spec.model.traverse(TokenChoiceTopKRouter.Config)]
    assert len(routers) == 5 and all(c.router_keys == ENTMAX for c in routers)
    qwen = qwen3_moe_debug_entmax().model_spec.model
    with torch.device("meta"):
        model = qwen.build()
    model.verify_module_protocol()
    assert sum(isinstance(m, MoelabRouter) for m in model.modules()) == 8


def test_hf_adapter_leaves_the_moelab_keys_out():
    """The engine's DeepSeek-V3 HF adapter raises KeyError on a swapped model's moelab
    keys; wrapped, it exports the gate weights under the HF names and loads back."""
    cfg = tiny_dsv3()
    model = build(cfg)
    swap_routers(model, map="entmax", alpha=1.5)
    state = model.state_dict()
    with pytest.raises(KeyError):
        DeepSeekV3StateDictAdapter(cfg, None).to_hf(state)
    adapter = with_moelab_state(DeepSeekV3StateDictAdapter)(cfg, None)
    hf = adapter.to_hf(state)
    gate = state["layers.1.moe.router.gate.weight"]
    assert torch.equal(hf["model.layers.1.mlp.gate.weight"], gate)
    back = adapter.from_hf(hf)
    assert not any(is_moelab_key(k) for k in back)
    missing, unexpected = model.load_state_dict(back, strict=False)
    assert not unexpected and missing and all(is_moelab_key(k) for k in missing)
    assert deepseek_v3_debugmodel_entmax().model_spec.state_dict_adapter.__name__ == (
        "MoelabDeepSeekV3StateDictAdapter"
    )


def test_pipeline_parallelism_refuses_routers_whose_aux_loss_it_would_drop() -> None:
    """MoelabTrainer's check: under pipeline parallelism a router with an aux loss on is
    one line (the loss would train without it); with none on, or without pipelining,
    nothing is said."""
    from moelab.integrations.torchtitan.config_registry import check_pipeline
    from tests.integrations.torchtitan.tiny import build, moe_config

    plain, lossy = build(moe_config()), build(moe_config())
    swap_routers(plain, map="entmax", alpha=1.5)
    swap_routers(lossy, map="entmax", alpha=1.5, z_loss_weight=1e-3)
    check_pipeline([plain], pp_enabled=True)
    check_pipeline([lossy], pp_enabled=False)
    with pytest.raises(ValueError, match=r"^the moelab routers' auxiliary losses \(z\)") as e:
        check_pipeline([lossy], pp_enabled=True)
    assert "\n" not in str(e.value)
