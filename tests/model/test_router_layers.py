"""Per-layer router configs (ModelConfig.router_layers): the list and rule forms, their
refusals in one line naming the layer and the field, dotted overrides that address one
layer, parameter counts, and a run whose layers differ through checkpoints, stats, the
K sweep and the loss-free bias."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moelab.model import ModelConfig, Transformer, param_counts
from moelab.model.config import layer_overrides
from moelab.train import TrainConfig, apply_overrides

SMALL = dict(
    n_layers=4,
    d_model=16,
    n_heads=2,
    n_kv_heads=1,
    d_ff=32,
    vocab_size=40,
    max_seq_len=16,
    n_experts=6,
    moe_layers="all",
)


def test_list_and_rule_forms_resolve_per_layer() -> None:
    # list: entry i is MoE layer i; a short list leaves the rest shared
    assert layer_overrides([None, {"top_k": 3}], 4) == [{}, {"top_k": 3}, {}, {}]
    assert layer_overrides({"first": 2, "set": {"map": "sigmoid"}}, 4) == [
        {"map": "sigmoid"},
        {"map": "sigmoid"},
        {},
        {},
    ]
    assert layer_overrides({"last": 1, "set": {"top_k": 1}}, 3) == [{}, {}, {"top_k": 1}]
    assert layer_overrides({"layers": [0, 2], "set": {"top_k": 3}}, 3) == [
        {"top_k": 3},
        {},
        {"top_k": 3},
    ]
    # old key names read as the current ones
    assert layer_overrides([{"cap_factor": 2.0}], 1) == [{"token_cap_factor": 2.0}]
    mc = ModelConfig(
        **SMALL, router={"top_k": 2}, router_layers={"first": 1, "set": {"selection": "hash"}}
    )
    assert mc.router_layers == [{"selection": "hash"}, None, None, None]
    assert [rc.selection for rc in mc.router_configs()] == ["hash", "topk", "topk", "topk"]
    assert not mc.uniform_routers
    assert ModelConfig(**SMALL, router_layers=[None, {}]).router_layers is None
    model = Transformer(mc)
    assert [m.router.config.selection for m in model.moe_layers] == ["hash", "topk", "topk", "topk"]


@pytest.mark.parametrize(
    ("router_layers", "message"),
    [
        ([None, {"top_k": 9}], r"router_layers\[1\] \(MoE layer 1, block 1; sets top_k\): top_k"),
        ([{"tpo_k": 3}], r"router_layers\[0\]\.tpo_k is not a router field"),
        ([{"n_experts": 3}], r"router_layers\[0\]\.n_experts is set from the model"),
        ([{}] * 5, r"entry for MoE layer 4 but the model has 4 MoE layers"),
        ([3], r"router_layers\[0\] must be a dict of router overrides or null"),
        ({"first": 5, "set": {}}, r"router_layers\.first must be a whole number in \[0, 4\]"),
        ({"layers": [7], "set": {}}, r"router_layers\.layers \[7\] lie outside"),
        ({"first": 1, "last": 1, "set": {}}, r"as a rule takes one of first, last, layers"),
        ({"first": 1}, r"as a rule takes one of first, last, layers and a dict 'set'"),
        ({"first": 1, "set": {"bias_rate": 0.1, "selection": "hash"}}, r"router_layers\[0\]"),
        ("hash", r"router_layers must be a list"),
    ],
)
def test_bad_overrides_are_refused_in_one_line(router_layers, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig(**SMALL, router_layers=router_layers)
    assert "\n" not in str(err.value)


def test_learned_allocation_refuses_per_layer_routers() -> None:
    with pytest.raises(ValueError, match=r"k_total .* drop router_layers"):
        ModelConfig(
            **SMALL,
            k_total=8.0,
            router={"map": "lapsum", "selection": "threshold"},
            router_layers=[{"top_k": 3}],
        )


def test_dotted_overrides_address_one_layer() -> None:
    base = TrainConfig(model={"moe_layers": "all"})
    config = apply_overrides(
        base,
        [
            "model.router_layers.1.top_k=3",
            "router_layers.1.map=sigmoid",
            "router_layers.0.selection=hash",
            "router_layers.0.cap_factor=none",  # an old name, as the current one
        ],
    )
    assert config.model["router_layers"] == [
        {"selection": "hash", "token_cap_factor": None},
        {"top_k": 3, "map": "sigmoid"},
    ]
    rcs = config.model_config().router_configs()
    assert [(rc.selection, rc.top_k, rc.map) for rc in rcs] == [
        ("hash", 2, "softmax"),
        ("topk", 3, "sigmoid"),
        ("topk", 2, "softmax"),
        ("topk", 2, "softmax"),
    ]
    # config.json's resolved model builds the same routers again
    again = TrainConfig(**{**config.to_dict(), "model": config.resolved_model()})
    assert again.model_config().router_configs() == rcs
    bad = {
        "router_layers.x=3": "router_layers.I.NAME=value",
        "router_layers.0=3": "router_layers.I.NAME=value",
        "router_layers.0.nope=3": "unknown router key",
        "router_layers.0.top_k=two": "router_layers.0.top_k takes an int",
        "router_layers.9.top_k=2": "entry for MoE layer 9 but the model has 4 MoE layers",
        "router_layers.0.top_k=9": r"router_layers\[0\] \(MoE layer 0, block 0; sets top_k\)",
    }
    for item, message in bad.items():
        with pytest.raises(ValueError, match=message):
            apply_overrides(base, [item])
    rule = apply_overrides(base, ['model.router_layers={"first": 1, "set": {"top_k": 3}}'])
    assert rule.model_config().router_layers == [{"top_k": 3}, None, None, None]
    with pytest.raises(ValueError, match="is a rule"):
        apply_overrides(rule, ["router_layers.0.top_k=1"])


def test_router_preset_is_a_model_field_override() -> None:
    config = apply_overrides(TrainConfig(), ["model.router_preset=gpt-oss", "router.renorm=no"])
    rc = config.model_config().router_config()
    assert (rc.scorer_bias, rc.renorm) == (True, False)  # the override wins over the preset
    assert config.router_keys_set()["scorer_bias"] is True


def built_total(model: Transformer) -> int:
    return sum(p.numel() for p in model.parameters())


def test_param_counts_sum_each_layers_own_router() -> None:
    layers = [
        {"n_null_experts": 2, "null_expert": "constant"},  # 3 D per constant expert
        {"scorer_bias": True},  # E more router parameters
        {"top_k": 4},
        {"selection": "threshold", "truncation": 0.1},
    ]
    mc = ModelConfig(**SMALL, router={"top_k": 2}, router_layers=layers)
    model = Transformer(mc)
    counts = param_counts(mc)
    assert counts["total"] == built_total(model)
    d, n_experts = SMALL["d_model"], SMALL["n_experts"]
    assert counts["router"] == (n_experts + 2) * d + 3 * n_experts * d + n_experts
    expert = 3 * d * SMALL["d_ff"]
    uniform = param_counts(ModelConfig(**SMALL, router={"top_k": 2}))
    # active: layer 0 reaches 2 E / (E + M) real experts, layer 2 four, layer 3 (a cut at
    # its nominal k = top_k) two, layer 1 two: beside the uniform model's 4 x 2
    extra = (2 * n_experts / (n_experts + 2) - 2) + (4 - 2)
    # layer 0's two extra router rows and W_m, v_m; layer 1's scorer bias
    shared_extra = 2 * d + 3 * 2 * d + n_experts
    assert counts["active"] == uniform["active"] + round(extra * expert) + shared_extra
    assert "active_at_cap" in counts  # a truncating layer and a null-expert one


def test_routers_of_different_kinds_round_trip_through_the_state_dict() -> None:
    mc = ModelConfig(
        **SMALL,
        router={"top_k": 2, "bias_rate": 0.01},
        router_layers=[{"selection": "hash", "bias_rate": 0.0}, {"scorer_bias": True}],
    )
    torch.manual_seed(0)
    model = Transformer(mc)
    with torch.no_grad():
        model.moe_layers[1].router.scorer_bias.normal_()
        model.moe_layers[2].router.bias.normal_()
    torch.manual_seed(1)
    fresh = Transformer(ModelConfig(**dataclasses.asdict(mc)))
    fresh.load_state_dict(model.state_dict())
    idx_BS = torch.randint(0, SMALL["vocab_size"], (2, 8))
    a, b = model.eval()(idx_BS), fresh.eval()(idx_BS)
    torch.testing.assert_close(a.logits_BSV, b.logits_BSV, rtol=0, atol=0)
    for x, y in zip(a.router_outputs, b.router_outputs, strict=True):
        assert torch.equal(x.ids_TK, y.ids_TK)


def test_a_run_whose_layers_differ(small_corpus: Path, tmp_path: Path) -> None:
    """Layer 0 hashes (no bias), layer 1 chooses top-k with the loss-free bias and K = 3:
    the run trains, its checkpoint loads, the bias moved in layer 1 only, stats name each
    layer's rule and K, and the K sweep runs; a threshold layer makes it refuse."""
    from moelab.diagnostics import evaluate, load_run, stats
    from moelab.train import train
    from tests.train import TINY_MODEL, tiny_config

    model = {
        **TINY_MODEL,
        "moe_layers": "all",
        "router": {"bias_rate": 0.05},
        "router_layers": [{"selection": "hash", "bias_rate": 0.0}, {"top_k": 3}],
    }
    run = tmp_path / "run"
    config = tiny_config(small_corpus, run, steps=4, model=model, checkpoint_every=2)
    train(config, stop_after=2)  # interrupted at step 2, then resumed: the same layers
    assert train(config, resume=True)["steps"] == 4
    other = {**model, "router_layers": [{"selection": "hash", "bias_rate": 0.0}, {"top_k": 2}]}
    with pytest.raises(ValueError, match="router_layers"):  # another model is refused
        train(tiny_config(small_corpus, run, steps=6, model=other), resume=True)
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["router_layers"] == [
        {"selection": "hash", "bias_rate": 0.0},
        {"top_k": 3},
    ]
    loaded = load_run(run)
    routers = [m.router for m in loaded.model.moe_layers]
    assert [r.config.selection for r in routers] == ["hash", "topk"]
    assert not routers[0].bias.any() and routers[1].bias.abs().sum() > 0
    st = stats(loaded, max_batches=1)
    assert not st["uniform_routers"]
    assert [(lay["selection"], lay["top_k"]) for lay in st["layers"]] == [("hash", 2), ("topk", 3)]
    from moelab.cli.stats import format_stats

    assert "routers per layer (router_layers): 0 hash K=2, 1 topk K=3" in format_stats(st)
    for lay in st["layers"]:  # the hash layer's load is counted as the learned one's
        assert sum(lay["load_shares"]) == pytest.approx(1.0)
        assert lay["active_experts"] == pytest.approx(lay["top_k"])
    sweep = evaluate(loaded, [1, 2], max_batches=1)
    assert sweep["trained_top_k_layers"] == [2, 3]
    assert [r["active_experts"] for r in sweep["results"]] == pytest.approx([1.0, 2.0])


def test_the_k_sweep_refuses_naming_the_layer_that_cannot_take_k() -> None:
    from moelab.diagnostics.evaluate import refuse_other_sweeps

    mc = ModelConfig(
        **SMALL, router={"top_k": 2}, router_layers=[None, None, {"selection": "threshold"}]
    )
    model = Transformer(mc)
    with pytest.raises(ValueError, match=r"MoE layer 2 \(block 2\) selects by 'threshold', not"):
        refuse_other_sweeps(model, "top_k", "sweep the threshold instead")
    with pytest.raises(ValueError, match=r"MoE layer 0 \(block 0\) selects by 'topk', not by a"):
        refuse_other_sweeps(model, "threshold_scale", "sweep K instead")
    refuse_other_sweeps(Transformer(ModelConfig(**SMALL)), "top_k", "")  # uniform top-k


def test_a_routing_record_refuses_layers_with_different_maps() -> None:
    from moelab.diagnostics import record

    mc = ModelConfig(**SMALL, router_layers=[{"map": "sigmoid"}])
    with pytest.raises(ValueError, match="differ in their null experts or map"):
        with record(Transformer(mc)):
            pass
