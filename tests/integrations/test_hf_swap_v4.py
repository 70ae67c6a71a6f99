"""The router swap on DeepSeek-V4 (transformers' ``deepseek_v4``): a tiny random model
whose first MoE layer chooses its experts by token id (``DeepseekV4HashRouter``, a
fixed ``tid2eid`` table) and whose second chooses by sqrt(softplus) scores + a choice
bias (``DeepseekV4TopKRouter``); both renormalise their weights (with + 1e-20) and
scale them by ``routed_scaling_factor``.

The swap with no keys leaves the logits as they were; the hash layer's Router routes by
the model's table and weighs as a float64 rewrite of the V4 rule does; gradients reach
the Routers; other keys (per layer) run; a swap that routes otherwise is refused by the
probe check; save / load, statistics and record / replay work on the swapped model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf

from moelab.diagnostics.replay import record, replay
from moelab.integrations.hf.families import moe_routers
from moelab.integrations.hf.replay import record_hf
from moelab.integrations.hf.saved import ROUTERS_JSON, load_swapped
from moelab.integrations.hf.stats import hf_stats
from moelab.integrations.hf.swap import (
    collect_router_outputs,
    moelab_aux_loss,
    swap_routers,
    swap_with_layer_keys,
    swapped_routers,
)
from moelab.integrations.hf.swap_rules import check_swap
from tests.integrations import VOCAB, D, E, tiny_text, tiny_tokenizer

SCALE = 1.5  # DeepseekV4Config's routed_scaling_factor


def _v4(seed: int = 1, table: bool = True) -> Any:
    """The tiny V4 of tests/integrations/test_hf_applied.py (one hash layer, then one
    learned layer; ``table``: a random table of 2 distinct experts per token id, else
    the table of initialisation, all zeros), with a random choice bias (zero at init
    would hide it)."""
    if not hasattr(tf, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepSeek-V4")
    cfg = tf.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, num_experts_per_tok=2, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=False,
        moe_intermediate_size=32, num_key_value_heads=1, head_dim=16,
        q_lora_rank=32, n_routed_experts=E, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=8, sliding_window=16, hc_mult=2, hc_sinkhorn_iters=3,
        mlp_layer_types=["hash_moe", "moe"],
        layer_types=["sliding_attention", "sliding_attention"],
    )  # fmt: skip
    assert cfg.scoring_func == "sqrtsoftplus" and cfg.routed_scaling_factor == SCALE
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g)[:2] for _ in range(VOCAB)]
    with torch.no_grad():
        if table:
            model.model.layers[0].mlp.gate.tid2eid.copy_(torch.stack(rows))
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def _v4_weights(x_TD: torch.Tensor, w_ED: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's gate weights at the experts ``ids_TK``, in float64: sqrt(softplus)
    of the logits, gathered, / (sum + 1e-20), x the routed scaling factor."""
    s = torch.nn.functional.softplus(x_TD.double() @ w_ED.double().T).sqrt()
    w = s.gather(1, ids_TK)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * SCALE


def test_default_swap_keeps_the_logits() -> None:
    model = _v4()
    ids = _ids()
    ref = _logits(model, ids)
    swapped = copy.deepcopy(model)
    hash_layer, learned = swap_routers(swapped)
    assert hash_layer.by_token_id and not learned.by_token_id
    h, c = hash_layer.router.config, learned.router.config
    assert (h.selection, h.map, h.renorm, h.routed_scaling) == ("hash", "sqrtsoftplus", True, SCALE)
    assert (c.selection, c.map, c.renorm, c.routed_scaling) == ("topk", "sqrtsoftplus", True, SCALE)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(hash_layer.router.selection.table_VK, table)
    assert torch.equal(learned.router.bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
    with collect_router_outputs(swapped) as outs:
        got = _logits(swapped, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # the hash layer routed each token to its table row
    assert torch.equal(outs[0].ids_TK, table[ids.reshape(-1)])


def test_hash_layer_weights_match_the_v4_rule_in_float64() -> None:
    model = _v4()
    (hash_layer, _) = swap_routers(copy.deepcopy(model))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, D, generator=gen) * 4  # logits spread over several units
    ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
    _, weights_TK, ids_TK = hash_layer(x, ids)  # as the block calls it: (hidden, input_ids)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(ids_TK, table[ids.reshape(-1)])
    want = _v4_weights(x.reshape(-1, D), hash_layer.router.weight.detach(), ids_TK)
    torch.testing.assert_close(weights_TK.double(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="routes by token id"):
        hash_layer(x)  # no input ids: the hash rule cannot route


def test_learned_layer_weights_match_the_v4_rule_in_float64() -> None:
    model = _v4()
    (_, learned) = swap_routers(copy.deepcopy(model))
    x = torch.randn(50, D, generator=torch.Generator().manual_seed(4)) * 4
    _, weights_TK, ids_TK = learned(x)
    gate = model.model.layers[1].mlp.gate
    s = torch.nn.functional.softplus(x.double() @ gate.weight.double().T).sqrt()
    want_ids = (s + gate.e_score_correction_bias.double()).topk(2, dim=-1).indices
    assert torch.equal(ids_TK.sort(-1).values, want_ids.sort(-1).values)
    want = _v4_weights(x, gate.weight, ids_TK)
    torch.testing.assert_close(weights_TK.double(), want, rtol=1e-6, atol=1e-7)


def test_backward_reaches_both_routers() -> None:
    swapped = _v4()
    routers = swap_routers(swapped)
    ids = _ids()
    out = swapped(input_ids=ids, labels=ids, use_cache=False)
    (out.loss + moelab_aux_loss(swapped)).backward()
    for r in routers:  # the hash layer's weights come from its scores too
        assert r.router.weight.grad is not None and bool(r.router.weight.grad.abs().sum() > 0)


def test_other_keys_run_per_layer_and_for_all() -> None:
    model = _v4()
    ids = _ids()
    ref = _logits(model, ids)
    per_layer = copy.deepcopy(model)
    hash_layer, learned = swap_with_layer_keys(per_layer, {}, [{}, {"map": "sparsemax"}])
    assert hash_layer.router.config.map == "sqrtsoftplus"
    assert learned.router.config.map == "sparsemax"
    got = _logits(per_layer, ids)
    assert torch.isfinite(got).all() and not torch.allclose(got, ref, atol=1e-4)
    both = copy.deepcopy(model)
    routers = swap_routers(both, map="sparsemax")
    assert [r.router.config.map for r in routers] == ["sparsemax", "sparsemax"]
    assert routers[0].router.config.selection == "hash"
    assert torch.isfinite(_logits(both, ids)).all()
    with pytest.raises(ValueError, match="routes by token id"):  # the learned layer: no ids
        learned_hash = {"selection": "hash", "vocab_size": VOCAB}
        swap_with_layer_keys(copy.deepcopy(model), {}, [{}, learned_hash])


def test_probe_check_refuses_a_hash_router_with_another_table() -> None:
    model = _v4(seed=1)
    other = _v4(seed=2)  # same weights, another table
    site = moe_routers(model)[0]
    assert site.by_token_id
    (hash_layer, _) = swap_routers(copy.deepcopy(other))
    with pytest.raises(ValueError, match="differ from the model's on probe"):
        check_swap(model, site, hash_layer)
    (own, _) = swap_routers(copy.deepcopy(model))
    check_swap(model, site, own)  # its own table passes


def test_a_table_with_an_expert_twice_is_refused() -> None:
    """The table of initialisation sends every token to expert 0 twice; moelab's hash
    rule takes K distinct experts per token id, so the swap says which layer and why."""
    model = _v4(table=False)
    with pytest.raises(
        ValueError, match=r"MoE layer 0 \(model.layers.0.mlp.gate\).*tid2eid.*twice"
    ):
        swap_routers(model)
    assert not swapped_routers(model)  # nothing was swapped


def test_save_and_load_swapped(tmp_path: Path) -> None:
    model = _v4()
    ids = _ids()
    swapped = copy.deepcopy(model)
    swap_with_layer_keys(swapped, {}, [{}, {"map": "sparsemax"}])
    want = _logits(swapped, ids)
    with pytest.warns(UserWarning, match="route otherwise"):
        swapped.save_pretrained(tmp_path / "v4")
    assert json.loads((tmp_path / "v4" / ROUTERS_JSON).read_text())["family"] == "deepseek_v4"
    loaded = load_swapped(tmp_path / "v4")
    hash_layer, learned = swapped_routers(loaded)
    assert hash_layer.by_token_id and learned.router.config.map == "sparsemax"
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=1e-5, atol=1e-6)
    # a plain load has the model's own table and routing
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "v4").float().eval()
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(plain.model.layers[0].mlp.gate.tid2eid, table)


def test_save_of_the_default_swap_does_not_warn(tmp_path: Path) -> None:
    import warnings

    swapped = _v4()
    swap_routers(swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swapped.save_pretrained(tmp_path / "v4")


def test_stats_of_the_swapped_model_mark_the_hash_layer(tmp_path: Path) -> None:
    swapped = _v4()
    swap_routers(swapped)
    data = tmp_path / "text.txt"
    data.write_text(tiny_text(), encoding="utf-8")
    res = hf_stats("tiny", data, loaded=(swapped, tiny_tokenizer()), seq_len=16, batch_size=2)
    assert [lay["routed_by"] for lay in res["layers"]] == ["token_id", "scores"]
    assert res["rule"].endswith("selection hash / topk")


def test_record_and_replay_of_the_swap() -> None:
    swapped = _v4()
    swap_routers(swapped)
    ids = _ids()
    with record(swapped) as rec:
        want = _logits(swapped, ids)
    table = swapped.model.layers[0].mlp.gate.router.selection.table_VK
    assert torch.equal(rec.ids_TK[0], table[ids.reshape(-1)])
    with replay(swapped, rec):
        got = _logits(swapped, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    native = _v4()
    with pytest.raises(ValueError, match="token id"), record_hf(native):
        pass
