"""Router presets reproduce the routing rule of the model family each one names, on the
same logits, as moelab's written-out rules of those families
(moelab.integrations.hf.rules.apply_rule, the reference that moelab's Hugging Face
statistics check against the transformers routers); each preset trains a few steps of a
tiny model without a NaN."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moelab import maps
from moelab.integrations.hf.rules import Rule, apply_rule
from moelab.model import ModelConfig
from moelab.model.router_presets import available_router_presets, router_preset
from moelab.routing.router import Router

SMALL = dict(
    n_layers=4,
    d_model=16,
    n_heads=2,
    n_kv_heads=1,
    d_ff=32,
    vocab_size=40,
    max_seq_len=16,
    n_experts=8,
    moe_layers="all",
)

HF_RULES = {
    # transformers' DeepseekV3TopkRouter (n_group = 1 as Kimi K2): sigmoid, choice on
    # a + e_score_correction_bias, renormalised (+1e-20), x routed_scaling_factor
    "deepseek-v3": Rule("sigmoid", renorm=True, renorm_eps=1e-20, scale=2.5, choice_bias=True),
    "kimi-k2": Rule("sigmoid", renorm=True, renorm_eps=1e-20, scale=2.827, choice_bias=True),
    # GptOssTopKRouter: top-k of the logits (with the router's bias), softmax over the k
    "gpt-oss": Rule("softmax_over_k"),
    # DeepSeek-V4's learned layers: sqrt(softplus), choice + bias, renormalised, x 1.5
    "deepseek-v4": Rule("sqrtsoftplus", renorm=True, scale=1.5, choice_bias=True),
}

NEEDS_SQRTSOFTPLUS = pytest.mark.skipif(
    "sqrtsoftplus" not in maps.available(),
    reason="the deepseek-v4 preset routes with the map 'sqrtsoftplus', which moelab.maps "
    "does not register yet (issue 45, item 1)",
)


def _presets() -> list:
    return [
        pytest.param(name, marks=NEEDS_SQRTSOFTPLUS) if name == "deepseek-v4" else name
        for name in available_router_presets()
    ]


def test_every_preset_is_checked_here() -> None:
    assert set(available_router_presets()) == set(HF_RULES)
    for name in available_router_presets():
        assert router_preset(name).about


def _routers(name: str, top_k: int = 2) -> list[Router]:
    torch.manual_seed(0)
    mc = ModelConfig(**SMALL, router_preset=name, router={"top_k": top_k})
    routers = []
    for rc in mc.router_configs():
        router = Router(rc).double()
        with torch.no_grad():
            router.weight.normal_(0, 1.0)
            if router.scorer_bias is not None:
                router.scorer_bias.normal_(0, 0.5)
            if rc.bias_rate > 0:  # a selection bias that moves the choice
                router.bias.normal_(0, 0.3)
        routers.append(router)
    return routers


def _same_routing(ids_a, w_a, ids_b, w_b) -> None:
    """Equal expert sets per token, and equal weights expert by expert (float64)."""
    order_a, order_b = ids_a.argsort(-1), ids_b.argsort(-1)
    assert torch.equal(ids_a.gather(-1, order_a), ids_b.gather(-1, order_b))
    torch.testing.assert_close(
        w_a.gather(-1, order_a).double(), w_b.gather(-1, order_b).double(), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("name", _presets())
@pytest.mark.parametrize("top_k", [2, 3])  # renorm refuses K = 1 (no gradient)
def test_preset_routes_as_the_family_rule_on_the_same_logits(name: str, top_k: int) -> None:
    routers = _routers(name, top_k)
    rule = HF_RULES[name]
    x_TD = torch.randn(64, SMALL["d_model"], dtype=torch.float64)
    ids_T = torch.randint(0, SMALL["vocab_size"], (64,))
    learned = 0
    for layer, router in enumerate(routers):
        out = router.eval()(x_TD, token_ids_T=ids_T)
        z_TE = out.scores_TE  # x W^T (+ the scorer bias): the family router's logits
        if router.config.selection == "hash":  # DeepSeek-V4's first layers: the table
            want_ids = router.selection.table_VK[ids_T]
            s_TE = torch.nn.functional.softplus(z_TE).sqrt()
            w = s_TE.gather(-1, want_ids)
            want_w = w / w.sum(-1, keepdim=True) * rule.scale
            _same_routing(out.ids_TK, out.weights_TK, want_ids, want_w)
            continue
        learned += 1
        # float32 in the reference, as transformers computes; the choice must agree
        want_ids, want_w = apply_rule(rule, z_TE, top_k, bias_E=router.bias)
        got_w = out.weights_TK
        order_a, order_b = out.ids_TK.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(out.ids_TK.gather(-1, order_a), want_ids.gather(-1, order_b)), layer
        torch.testing.assert_close(
            got_w.gather(-1, order_a).float(), want_w.gather(-1, order_b), rtol=1e-5, atol=1e-6
        )
    assert learned >= 1


@pytest.mark.parametrize("name", [p for p in _presets() if p != "gpt-oss"])  # no choice bias
def test_the_bias_steers_the_choice_only(name: str) -> None:
    """The family rules weight the chosen experts by their scores, never by the
    selection bias: with a large bias on one expert, it is chosen and weighted as
    without it."""
    router = _routers(name)[-1]  # a learned layer in every preset
    assert router.config.bias_rate > 0
    x_TD = torch.randn(32, SMALL["d_model"], dtype=torch.float64)
    with torch.no_grad():
        router.bias.zero_()
        router.bias[3] = 100.0
    out = router.eval()(x_TD)
    assert bool((out.ids_TK == 3).any(-1).all())
    rule = HF_RULES[name]
    _, want_w = apply_rule(rule, out.scores_TE, 2, bias_E=router.bias)
    torch.testing.assert_close(
        out.weights_TK.sort(-1).values.float(), want_w.sort(-1).values, rtol=1e-5, atol=1e-6
    )


def test_deepseek_v4_layers_and_its_refusal_on_too_few_moe_layers() -> None:
    data = router_preset("deepseek-v4")
    hash_layers = {"selection": "hash", "bias_rate": 0.0, "aux_weight": 0.0}
    assert data.router_layers == {"first": 3, "set": hash_layers}
    # two MoE layers cannot hold "the first 3": refused in one line that says so
    small = {**SMALL, "moe_layers": "every_second"}
    with pytest.raises(ValueError, match=r"router_layers.first must be .* \[0, 2\]"):
        ModelConfig(**small, router_preset="deepseek-v4", router={"map": "sigmoid"})


def test_config_keys_win_over_the_preset_key_by_key() -> None:
    mc = ModelConfig(
        **SMALL,
        router_preset="deepseek-v3",
        router={"routed_scaling": 1.0},
        router_layers=[{"top_k": 3}],
    )
    rcs = mc.router_configs()
    assert rcs[0].routed_scaling == 1.0 and rcs[0].map == "sigmoid" and rcs[0].top_k == 3
    assert [rc.top_k for rc in rcs[1:]] == [2, 2, 2]
    # building again from the resolved fields gives the same routers (config.json)
    import dataclasses

    again = ModelConfig(**dataclasses.asdict(mc))
    assert again.router_configs() == rcs
    with pytest.raises(ValueError, match="unknown router_preset 'nope'; choose one of"):
        ModelConfig(**SMALL, router_preset="nope")


@pytest.mark.parametrize("name", _presets())
def test_each_preset_trains_a_tiny_model_without_nan(
    name: str, small_corpus: Path, tmp_path: Path
) -> None:
    from moelab.train import train
    from tests.train import TINY_MODEL, logged_losses, tiny_config

    model = {**TINY_MODEL, "n_layers": 4, "moe_layers": "all", "router_preset": name}
    run = tmp_path / "run"
    summary = train(tiny_config(small_corpus, run, steps=6, model=model))
    losses = logged_losses(run)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(summary["train_loss"])
