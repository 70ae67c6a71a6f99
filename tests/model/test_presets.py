"""Presets load from their data files and reproduce the published parameter counts; the
analytic count agrees with the parameters of built models."""

from __future__ import annotations

import pytest
import torch

from moelab.model import ModelConfig, Transformer, available_presets, load_preset, param_counts

SMALL = dict(n_layers=4, d_model=32, d_ff=48, vocab_size=50, max_seq_len=8, n_experts=5)


def built_counts(model: Transformer) -> dict[str, int]:
    """Counts from the parameters of a built model."""
    total = sum(p.numel() for p in model.parameters())
    router = sum(m.router.weight.numel() for m in model.moe_layers)
    unused, unused_at_cap, truncating = 0.0, 0, False
    for moe in model.moe_layers:
        experts, rc = moe.experts, moe.config.router
        per_expert = sum(p.numel() for p in experts.parameters()) // experts.n_experts
        unused_at_cap += (experts.n_experts - rc.slots) * per_expert
        if rc.selection == "threshold":  # active: at the nominal k, not at the cap
            truncating = True
            k = rc.lapsum_k if rc.lapsum_k is not None else rc.top_k
            unused += (experts.n_experts - k) * per_expert
        else:
            unused += (experts.n_experts - rc.slots) * per_expert
    counts = {"total": total, "active": total - round(unused), "router": router}
    if truncating:
        counts["active_at_cap"] = total - unused_at_cap
    return counts


@pytest.mark.parametrize(
    "overrides",
    [
        dict(moe_layers="none", n_heads=4, n_kv_heads=4),  # dense, multi-head
        dict(moe_layers="every_second", n_heads=4, n_kv_heads=2, router={"top_k": 2}),
        dict(moe_layers="all", n_heads=2, n_kv_heads=1, router={"top_k": 1}),  # GQA 2:1
        dict(moe_layers=[0, 3], n_heads=8, n_kv_heads=2, expert_d_ff=24, router={"top_k": 3}),
        dict(
            moe_layers="all",
            n_heads=4,
            n_kv_heads=1,
            router={"map": "lapsum", "lapsum_k": 2, "selection": "threshold", "cap_factor": 1.5},
        ),
    ],
)
def test_analytic_count_matches_built_model(overrides: dict) -> None:
    config = ModelConfig(**{**SMALL, **overrides})
    model = Transformer(config)
    assert param_counts(config) == built_counts(model)
    # buffers (rotary tables, router biases) are not parameters
    assert not any(name.endswith(("cos_SC", "sin_SC")) for name, _ in model.named_parameters())


def test_available_presets() -> None:
    names = available_presets()
    expected = {"paper-300m", "paper-1b", "dense-283m", "dense-1b", "softmoe-1.6b"}
    assert expected | {"switch-125m", "tiny"} <= set(names)
    assert names == sorted(names)
    for name in names:
        assert isinstance(load_preset(name), ModelConfig)


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="paper-300m"):
        load_preset("paper-3m")


@pytest.mark.parametrize(
    ("name", "total", "active", "router_k"),
    [
        # (preset, total, active, router in thousands); millions (M) or billions to 2 d.p.
        ("paper-300m", "297M", "108M", 33),
        ("paper-1b", "1.01B", "302M", 83),
        ("dense-283m", "283M", "283M", 0),
        ("dense-1b", "1.01B", "1.01B", 0),
        ("softmoe-1.6b", "1.63B", None, None),
        ("switch-125m", None, "125M", None),
    ],
)
def test_published_counts(
    name: str, total: str | None, active: str | None, router_k: int | None
) -> None:
    counts = param_counts(load_preset(name))

    def rounded(n: int, spec: str) -> str:
        return f"{round(n / 1e9, 2)}B" if spec.endswith("B") else f"{round(n / 1e6)}M"

    if total is not None:
        assert rounded(counts["total"], total) == total
    if active is not None:
        assert rounded(counts["active"], active) == active
    if router_k is not None:
        assert round(counts["router"] / 1e3) == router_k


def test_preset_shapes() -> None:
    c = load_preset("paper-300m")
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff) == (8, 320, 8, 2, 2048)
    assert c.moe_indices == [1, 3, 5, 7] and c.n_experts == 26 and c.router_config().top_k == 2
    assert load_preset("paper-1b").moe_indices == [1, 3, 5, 7]
    assert load_preset("dense-283m").moe_indices == []
    soft = load_preset("softmoe-1.6b").router_config()
    assert (soft.map, soft.lapsum_k, soft.selection) == ("lapsum", 2, "threshold")
    assert len(load_preset("softmoe-1.6b").moe_indices) == 10
    switch = load_preset("switch-125m")
    assert switch.moe_indices == [1, 3, 5, 7, 9, 11] and switch.router_config().top_k == 1


def test_tiny_preset_builds_and_runs() -> None:
    torch.manual_seed(0)
    config = load_preset("tiny")
    assert config.n_layers == 4 and config.vocab_size == 2048 and config.max_seq_len == 128
    model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == param_counts(config)["total"]
    idx_BS = torch.randint(0, config.vocab_size, (2, 32))
    out = model(idx_BS, targets_BS=idx_BS)
    assert out.logits_BSV.shape == (2, 32, 2048) and len(out.router_outputs) == 2
    assert out.loss is not None and abs(out.loss.item() - torch.log(torch.tensor(2048.0))) < 0.5
