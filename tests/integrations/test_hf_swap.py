"""Router swap (moelab.integrations.hf.swap): the swapped model reproduces each family's
logits, variable-k routing runs NaN-free with every expert implementation, the rules the
swap cannot run are refused, and a swapped model fine-tunes with moelab's aux loss."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integrations import FAMILIES, tiny_model

pytest.importorskip("transformers")

from moelab.integrations.hf.families import moe_routers
from moelab.integrations.hf.swap import (
    DeepseekV2Groups,
    collect_router_outputs,
    moelab_aux_loss,
    step_swapped,
    swap_routers,
    swapped_routers,
)

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""The expert implementations transformers offers that run on any device
(``ExpertsInterface``: deepgemm and sonicmoe need their GPU kernels)."""


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 12)) -> torch.Tensor:
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


CASES = [(f, {}) for f in FAMILIES] + [
    ("deepseek_v2", {"topk_method": "greedy"}),  # DeepSeek-V2-Lite's routing
    ("deepseek_v3", {"n_group": 1, "topk_group": 1}),  # one group: choice by a + b
    ("qwen3_moe", {"num_experts_per_tok": 1}),  # renorm over one expert: weight 1
]


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=lambda c: str(c))
def test_swap_reproduces_the_logits(family: str, overrides: dict) -> None:
    model = tiny_model(family, **overrides)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    n_sites = len(moe_routers(model))
    swapped = copy.deepcopy(model)
    routers = swap_routers(swapped)
    assert len(routers) == n_sites == len(swapped_routers(swapped)) == 2
    with torch.no_grad():
        out = swapped(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # the swapped routers did the routing: another budget changes the logits
    for r in routers:
        r.top_k = 3
    with torch.no_grad():
        other = swapped(ids).logits
    assert (other - ref).abs().max() > 1e-4


def test_initialisation_from_the_hf_router() -> None:
    gpt = tiny_model("gpt_oss")
    hf = gpt.model.layers[0].mlp.router
    (r, _) = swap_routers(gpt)
    assert torch.equal(r.router.weight.detach(), hf.weight.detach())
    assert torch.equal(r.router.scorer_bias.detach(), hf.bias.detach())
    v3 = tiny_model("deepseek_v3")
    hf = v3.model.layers[0].mlp.gate
    (r, _) = swap_routers(v3)
    cfg = r.router.config
    assert torch.equal(r.router.bias, hf.e_score_correction_bias)
    assert (cfg.map, cfg.n_groups, cfg.topk_groups, cfg.routed_scaling) == ("sigmoid", 4, 2, 2.5)
    # DeepSeek-V2's group-limited greedy: V2's group score (its best expert), not V3's
    (r, _) = swap_routers(tiny_model("deepseek_v2"))
    assert isinstance(r.router.selection, DeepseekV2Groups)
    assert (r.router.config.n_groups, r.router.config.topk_groups) == (4, 2)
    (r, _) = swap_routers(tiny_model("deepseek_v2", topk_method="greedy"))
    assert not isinstance(r.router.selection, DeepseekV2Groups)


SHARP = dict(temperature=0.05)  # the tiny models' logits are small: sharpen the maps
VARIABLE = {
    "threshold": dict(selection="threshold", truncation=0.2, **SHARP),
    "top_p": dict(selection="top_p", top_p=0.5, top_k=4, **SHARP),
    "null_zero": dict(n_null_experts=2, n_groups=None, topk_groups=None),
    "capacity": dict(capacity_factor=0.5),
    "expert_choice": dict(selection="expert_choice"),
    "entmax_threshold": dict(map="entmax", selection="threshold", top_k=4, **SHARP),
}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("rule", list(VARIABLE))
def test_variable_k_is_nan_free_with_every_expert_implementation(family: str, rule: str) -> None:
    model = tiny_model(family)
    routers = swap_routers(model, **VARIABLE[rule])
    ids = _ids(1)
    logits = {}
    for impl in IMPLEMENTATIONS:
        model.set_experts_implementation(impl)
        assert model.model.layers[0].mlp.experts.config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids).logits
        assert torch.isfinite(logits[impl]).all(), impl
    # some slots were not computed (the variable-k case happened): weight 0, valid index
    with torch.no_grad():
        _, weights_TK, ids_TK = routers[0](torch.randn(24, 64))
    assert (weights_TK == 0).any()
    assert ((ids_TK >= 0) & (ids_TK < 8)).all()
    # the three implementations compute the same model
    for impl in IMPLEMENTATIONS[1:]:
        torch.testing.assert_close(logits[impl], logits["eager"], atol=1e-5, rtol=1e-5)


def test_refusals(tmp_path) -> None:
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="token id"):
        swap_routers(copy.deepcopy(model), selection="hash", vocab_size=320)
    with pytest.raises(ValueError, match="identity"):
        swap_routers(copy.deepcopy(model), n_null_experts=2, null_expert="identity")
    with pytest.raises(ValueError, match="comes from the Hugging Face model"):
        swap_routers(copy.deepcopy(model), n_experts=4)
    with pytest.raises(ValueError, match="top_k"):
        swap_routers(copy.deepcopy(model), top_k=9)
    swap_routers(model)
    with pytest.raises(ValueError, match="swapped already"):
        swap_routers(model)
    with pytest.raises(ValueError, match="moelab_aux_loss"):
        model(_ids(), output_router_logits=True)
    model.save_pretrained(tmp_path / "saved")  # save_swapped: tests/integrations/test_hf_saved.py
    assert (tmp_path / "saved" / "moelab_routers.json").is_file()


def test_refuses_an_unsupported_model() -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="mixtral"):
        swap_routers(tf.LlamaForCausalLM(cfg))


def test_aux_loss_is_the_routers_own() -> None:
    model = tiny_model("deepseek_v3")
    swap_routers(model, aux_weight=0.1, aux_probs="normalized")
    with collect_router_outputs(model) as outs:
        model(_ids())
    assert len(outs) == 2
    total = moelab_aux_loss(model)
    torch.testing.assert_close(total, outs[0].aux_loss + outs[1].aux_loss)
    # an independent check of one layer: alpha * E * sum_i f_i P_i, f the share of the
    # K * T slots per expert, P the mean of a / sum(a) (DeepSeek-V3's normalised scores)
    out = outs[0]
    E, (T, K) = 8, out.ids_TK.shape
    f = torch.bincount(out.ids_TK.flatten(), minlength=E).float() / (T * K)
    P = (out.probs_TE / out.probs_TE.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(out.aux_loss, 0.1 * E * (f * P).sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "keys"),
    [
        ("mixtral", dict(aux_weight=0.01)),
        ("mixtral", dict(map="entmax", renorm=False, aux_weight=0.01)),
        ("deepseek_v3", dict(aux_weight=0.01, aux_probs="normalized")),
    ],
    ids=["mixtral", "mixtral-entmax", "deepseek_v3"],
)
def test_fine_tune_lowers_the_loss(family: str, keys: dict) -> None:
    model = tiny_model(family)
    routers = swap_routers(model, **keys)
    model.train()
    start = routers[0].router.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids(2, (2, 16))
    losses = []
    for _ in range(6):
        out = model(ids, labels=ids)
        aux = moelab_aux_loss(model)
        assert aux > 0
        loss = out.loss + aux
        opt.zero_grad()
        loss.backward()
        assert routers[0].router.weight.grad is not None
        assert routers[0].router.weight.grad.abs().sum() > 0
        opt.step()
        step_swapped(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert not torch.equal(routers[0].router.weight.detach(), start)  # the router trained


def test_swapped_state_dict_round_trip(tmp_path) -> None:
    keys = dict(map="entmax", temperature=0.5)
    model = tiny_model("gpt_oss")
    (r, _) = swap_routers(model, **keys)
    with torch.no_grad():
        r.router.scorer_bias.add_(torch.linspace(-1, 1, 8))
        r.router.top_k = 3  # the inference budget travels in the router's extra state
    torch.save(model.state_dict(), tmp_path / "swapped.pt")
    fresh = tiny_model("gpt_oss", seed=1)
    swap_routers(fresh, **keys)
    fresh.load_state_dict(torch.load(tmp_path / "swapped.pt"))
    assert swapped_routers(fresh)[0].top_k == 3
    with torch.no_grad():
        torch.testing.assert_close(fresh(_ids()).logits, model(_ids()).logits)


def test_step_moves_the_loss_free_bias() -> None:
    model = tiny_model("deepseek_v3")
    (r, _) = swap_routers(model, bias_rate=0.01)
    before = r.router.bias.clone()
    model(_ids())
    step_swapped(model)
    assert not torch.equal(r.router.bias, before)
