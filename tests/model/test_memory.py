"""`moelab params --memory` (moelab.model.memory): parameter, gradient and optimizer bytes
against hand-computed numbers for `tiny` and against the parameters of a built model;
FSDP divides the sharded state by N, EP the expert state by e; the activation formula."""

from __future__ import annotations

import json

import pytest
import torch

from moelab import cli
from moelab.model import Transformer, load_preset
from moelab.model.memory import activation_bytes_per_token, estimate, param_split

# tiny by hand: D = 128, 4 heads of 32, 2 kv heads, d_ff = 256, V = 2048, MoE in blocks
# 1 and 3 with E = 8 experts of width 256, top-2.
#   attention 128*4*32*2 (q, o) + 128*2*32*2 (k, v) = 49_152; norms 2*128 = 256
#   dense SwiGLU 3*128*256 = 98_304 = one expert; router 8*128 = 1_024
#   root: 2*2048*128 + 128 (final norm) = 524_416
#   total 524_416 + 4*(49_152 + 256) + 2*98_304 + 2*1_024 + 2*8*98_304 = 2_493_568
TINY_TOTAL = 2_493_568
TINY_EXPERT = 2 * 8 * 98_304  # 1_572_864
TINY_ROOT = 524_416


def rows(result: dict) -> dict[str, dict]:
    return {r["parallel"]: r for r in result["rows"]}


def test_tiny_state_bytes_by_hand() -> None:
    result = estimate(load_preset("tiny"), gpus=4, ep=2)
    single = rows(result)["single"]
    assert result["params"] == TINY_TOTAL and result["expert_params"] == TINY_EXPERT
    assert single["param_bytes"] == 4 * TINY_TOTAL
    assert single["grad_bytes"] == 4 * TINY_TOTAL
    assert single["optimizer_bytes"] == 8 * TINY_TOTAL  # AdamW: two fp32 moments
    assert single["state_bytes"] == 16 * TINY_TOTAL
    bf16 = rows(estimate(load_preset("tiny"), gpus=4, ep=2, param_dtype="bf16"))["single"]
    assert (bf16["param_bytes"], bf16["grad_bytes"]) == (2 * TINY_TOTAL, 2 * TINY_TOTAL)
    assert bf16["optimizer_bytes"] == 12 * TINY_TOTAL  # moments + fp32 master copy


def test_split_matches_built_model() -> None:
    config = load_preset("tiny")
    model = Transformer(config)
    split = param_split(config)
    assert split.total == sum(p.numel() for p in model.parameters()) == TINY_TOTAL
    experts = sum(p.numel() for m in model.moe_layers for p in m.experts.parameters())
    assert split.expert == experts == TINY_EXPERT
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    assert split.root == split.total - sum(blocks) == TINY_ROOT
    assert split.largest_block() == max(blocks)
    dense_blocks = [n for n, b in zip(blocks, model.blocks, strict=True) if not b.is_moe]
    moe_blocks = [n for n, b in zip(blocks, model.blocks, strict=True) if b.is_moe]
    assert set(dense_blocks) == {split.dense_block}
    assert set(moe_blocks) == {split.moe_block + split.block_experts}
    # under EP = 4 an MoE block holds 2 of its 8 experts: the dense block is the largest
    assert split.largest_block(4) == max(split.dense_block, split.moe_block + 2 * 98_304)


def test_fsdp_divides_by_n_and_ep_divides_experts_by_e() -> None:
    config = load_preset("tiny")
    one = rows(estimate(config, gpus=1, ep=1))["single"]
    for n in (2, 4, 8):
        r = rows(estimate(config, gpus=n, ep=1))
        assert r["ddp"]["state_bytes"] == one["state_bytes"]  # DDP replicates
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert r["fsdp"][key] == pytest.approx(one[key] / n, abs=1)
        assert r["ddp"]["buffer_bytes"] == 4 * TINY_TOTAL  # DDP's gradient buckets
    # EP = e over e GPUs: experts split e ways, the rest sharded by FSDP over all e GPUs
    for e in (2, 4, 8):
        ep = rows(estimate(config, gpus=e, ep=e))["ep_fsdp"]
        assert ep["expert_params_per_gpu"] == TINY_EXPERT // e
        assert ep["params_per_gpu"] == pytest.approx(
            (TINY_TOTAL - TINY_EXPERT) / e + TINY_EXPERT / e, abs=1
        )
    # EP = 2 x FSDP = 4 on 8 GPUs: experts / 2 / 4; the gathered block holds E / 2 experts
    r = rows(estimate(config, gpus=8, ep=2))
    assert r["ep_fsdp"]["expert_params_per_gpu"] == TINY_EXPERT // 8
    assert r["ep_fsdp"]["buffer_bytes"] < r["fsdp"]["buffer_bytes"]
    assert r["single"]["activation_bytes"] == r["ep_fsdp"]["activation_bytes"]


def test_activation_formula_by_hand() -> None:
    # D = 128, H = 4, F = F_e = 256, K = 2, E = 8, V = 2048, b = 2:
    # norms 2*8*128 = 2_048; attention 2*7*128 + 4*4 = 1_808
    # dense FF 2 (128 + 4*256) = 2_304 -> dense block 6_160
    # MoE FF 2 (128 + 2 (2*128 + 4*256)) + 8*8 = 5_440 -> MoE block 9_296
    # head 8*128 + 2*128 + 6*2048 = 13_568
    act = activation_bytes_per_token(load_preset("tiny"))
    assert act == {"blocks": 2 * 6_160 + 2 * 9_296, "head": 13_568, "total": 44_480}
    ckpt = activation_bytes_per_token(load_preset("tiny"), checkpoint_activations=True)
    assert ckpt["blocks"] == 4 * 4 * 128 + 9_296  # fp32 block inputs + one block recomputed
    r = rows(estimate(load_preset("tiny"), gpus=1, batch_tokens=1000))["single"]
    assert r["activation_bytes"] == 44_480 * 1000


def test_activation_formula_against_saved_tensors() -> None:
    """The bytes autograd saves for tiny (bf16 autocast on the CPU, 1024 tokens, weight
    copies left out) against the formula, less the bf16 logits (held by the model's
    output, not saved): within 15%."""
    config = load_preset("tiny")
    torch.manual_seed(0)
    model = Transformer(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()}
    shapes |= {tuple(p.shape[1:]) for p in model.parameters() if p.dim() == 3}
    shapes |= {s[::-1] for s in shapes if len(s) == 2}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and tuple(t.shape) not in shapes:
            saved[key] = storage.nbytes()
        return t

    B, S = 8, 128
    idx = torch.randint(0, config.vocab_size, (B, S + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            model(idx[:, :-1], idx[:, 1:], collect=False)
    measured = sum(saved.values()) / (B * S)
    formula = activation_bytes_per_token(config)["total"] - 2 * config.vocab_size
    assert measured == pytest.approx(formula, rel=0.15)


def test_errors_say_what_to_change() -> None:
    config = load_preset("tiny")
    with pytest.raises(ValueError, match="common divisor"):
        estimate(config, gpus=8, ep=3)
    with pytest.raises(ValueError, match="param_dtype"):
        estimate(config, param_dtype="fp8")
    with pytest.raises(ValueError, match="needs MoE layers"):
        estimate(load_preset("dense-283m"), gpus=8, ep=2)
    assert [r["parallel"] for r in estimate(load_preset("paper-1b"), gpus=8)["rows"]] == [
        "single",
        "ddp",
        "fsdp",
    ]  # E = 27: no EP group divides 8 GPUs and 27 experts


def test_cli_params_memory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["params", "--preset", "tiny", "--memory", "--gpus", "4", "--ep", "2", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == TINY_TOTAL
    assert [r["label"] for r in out["memory"]["rows"]] == [
        "1 GPU",
        "DDP x 4",
        "FSDP x 4",
        "EP 2 x FSDP 2",
    ]
    assert cli.main(["params", "--preset", "paper-300m", "--memory"]) == 0
    text = capsys.readouterr().out
    assert "| FSDP x 8 |" in text and "EP 2 x FSDP 4" in text and "activations per token" in text
    assert cli.main(["params", "--preset", "tiny", "--memory", "--ep", "3"]) == 2
