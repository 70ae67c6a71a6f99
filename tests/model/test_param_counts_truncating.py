"""Parameter counts of truncating routers (router.selection = "threshold"): ``active``
at the nominal k experts per MoE layer, ``active_at_cap`` at ceil(k * cap_factor);
top-k routers keep their three counts."""

from __future__ import annotations

import json

import pytest

from moelab import cli
from moelab.model import ModelConfig, Transformer, load_preset, param_counts

# d = 8, head width 4, 2 blocks, both MoE with E = 4 experts of hidden width 4
SMALL = dict(
    n_layers=2,
    d_model=8,
    n_heads=2,
    n_kv_heads=1,
    d_ff=16,
    vocab_size=10,
    max_seq_len=8,
    moe_layers="all",
    n_experts=4,
    expert_d_ff=4,
)
THRESHOLD = {"map": "lapsum", "lapsum_k": 1.5, "selection": "threshold", "cap_factor": 2.0}
# By hand: attention 8*2*4*2 (q, o) + 8*1*4*2 (k, v) = 192, norms 2*8 = 16, per block 208;
# embeddings 2*10*8 + 8 (final norm) = 168; routers 2 layers * 4 * 8 = 64;
# non-expert 168 + 2*208 + 64 = 648; one expert 3*8*4 = 96.
NON_EXPERT, EXPERT = 648, 96


def test_hand_computed_counts_with_threshold_selection() -> None:
    counts = param_counts(ModelConfig(**SMALL, router=THRESHOLD))
    assert counts == {
        "total": NON_EXPERT + 2 * 4 * EXPERT,  # 1416
        "active": NON_EXPERT + 2 * 1.5 * EXPERT,  # k = 1.5 experts per layer: 936
        "router": 64,
        "active_at_cap": NON_EXPERT + 2 * 3 * EXPERT,  # ceil(1.5 * 2) = 3 experts: 1224
    }
    # without a cap a token can reach every expert
    no_cap = {k: v for k, v in THRESHOLD.items() if k != "cap_factor"}
    counts = param_counts(ModelConfig(**SMALL, router=no_cap))
    assert counts["active"] == NON_EXPERT + 2 * 1.5 * EXPERT
    assert counts["active_at_cap"] == counts["total"] == NON_EXPERT + 2 * 4 * EXPERT


def test_counts_agree_with_the_built_model() -> None:
    config = ModelConfig(**SMALL, router=THRESHOLD)
    model = Transformer(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in model.moe_layers for p in m.experts.parameters())
    per_expert = experts // (2 * 4)
    counts = param_counts(config)
    assert (counts["total"], total - experts, per_expert) == (total, NON_EXPERT, EXPERT)
    assert counts["active"] == total - experts + 2 * 1.5 * per_expert


def test_rounding_of_a_fractional_nominal_count() -> None:
    # k = 1.25 on one MoE layer: 1.25 * 96 = 120 exactly; k = 1.3: 124.8 -> 125
    one_layer = {**SMALL, "moe_layers": [1]}
    dense_block = 3 * 8 * 16  # block 0 keeps its dense SwiGLU (d_ff = 16)
    base = NON_EXPERT - 32 + dense_block  # one router fewer, one dense feed-forward more
    for k, experts in ((1.25, 120), (1.3, 125)):
        config = ModelConfig(**one_layer, router={**THRESHOLD, "lapsum_k": k})
        assert param_counts(config)["active"] == base + experts


def test_learned_allocation_counts_the_global_budget() -> None:
    # K = 3 over 2 layers: k_l = 1.5 at the start, and the k_l always sum to K
    config = ModelConfig(
        **SMALL, k_total=3.0, router={"map": "lapsum", "selection": "threshold", "cap_factor": 2}
    )
    counts = param_counts(config)
    allocator = 2  # one eta per MoE layer, counted with the routers
    assert counts["router"] == 64 + allocator
    assert counts["active"] == NON_EXPERT + allocator + 3 * EXPERT
    assert counts["active_at_cap"] == NON_EXPERT + allocator + 2 * 3 * EXPERT


def test_topk_counts_unchanged() -> None:
    counts = param_counts(ModelConfig(**SMALL, router={"top_k": 2}))
    assert counts == {
        "total": NON_EXPERT + 2 * 4 * EXPERT,
        "active": NON_EXPERT + 2 * 2 * EXPERT,
        "router": 64,
    }


def test_cli_params_softmoe_reports_nominal_active(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["params", "--preset", "softmoe-1.6b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = load_preset("softmoe-1.6b")
    expert = 3 * c.d_model * c.d_ff  # 32 experts of the dense width in each of 10 layers
    assert out["total"] == 1_630_426_240
    assert out["active"] == out["total"] - 10 * (32 - 2) * expert  # 155.9M at k = 2
    assert out["active_at_cap"] == out["total"]  # no cap_factor: every expert reachable
    assert (out["k"], out["cap"]) == (2.0, 32)
    assert {"preset", "total", "active", "router"} <= set(out)

    assert cli.main(["params", "--preset", "softmoe-1.6b"]) == 0
    text = capsys.readouterr().out
    assert "155.9M" in text and "at cap" in text and "nominal k = 2" in text
