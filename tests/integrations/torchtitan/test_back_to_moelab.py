"""Issue 41, item 4: a model trained in torchtitan with moelab routers comes back to
moelab's diagnostics through the engine's own ways out (its Hugging Face adapter, its
distributed checkpoint): ``export_hf`` writes a qwen3_moe folder with the moelab Routers
beside it, which gives the torchtitan model's logits and expert choices, and which
``moelab stats --hf``, ``moelab eval --hf --top-k`` and ``moelab analyze --hf`` read with
the Routers' own routing (1.5-entmax, the engine's expert bias)."""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moelab import cli
from moelab.integrations.hf.saved import load_swapped
from moelab.integrations.hf.swap import swapped_routers
from moelab.integrations.torchtitan import moelab_routers, swap_routers
from moelab.integrations.torchtitan.export import export_hf
from tests.integrations import VOCAB, tiny_text, tiny_tokenizer

D, E, K, LAYERS = 32, 8, 2, 2
KEYS = {"map": "entmax", "alpha": 1.5}


def tiny_qwen3_moe():
    """A torchtitan Qwen3 MoE model config: 2 layers, width 32, E = 8, top-2 softmax with
    renorm (as torchtitan's Qwen3 MoE), causal SDPA attention (which has a backward on
    the CPU, FlexAttention has not), vocabulary of the tiny tokenizer."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    def norm(n: int):
        return RMSNorm.Config(normalized_shape=n, eps=1e-6)

    init = {"weight": lambda t: torch.nn.init.normal_(t, std=0.1)}
    experts = dict.fromkeys(("w1_EFD", "w2_EDF", "w3_EFD"), init["weight"])
    gate = {"weight": lambda t: torch.nn.init.normal_(t, std=1.0)}  # entmax: sparse
    rope = CosSinRoPE.Config(dim=8, max_seq_len=1024, theta=1e6)
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(D), ffn_norm=norm(D),
            attention=make_gqa_config(
                dim=D, n_heads=4, n_kv_heads=2, head_dim=8, wqkv_param_init=init,
                wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True, rope=rope, qk_norm=norm(8),
            ),
            moe=make_moe_config(
                num_experts=E,
                router=make_router_config(dim=D, num_experts=E, gate_param_init=gate,
                                          top_k=K, score_func="softmax", route_norm=True),
                routed_experts=make_routed_experts_config(
                    dim=D, hidden_dim=16, num_experts=E, top_k=K, param_init=experts,
                    comm_backend="standard",
                ),
            ),
        )
        for _ in range(LAYERS)
    ]  # fmt: skip
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=D, norm=norm(D), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=D, param_init=init),
        lm_head=Linear.Config(in_features=D, out_features=VOCAB, param_init=init),
    )  # fmt: skip


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tiny_qwen3_moe().build()
    model.init_states()
    return model


def float32_experts(model: torch.nn.Module) -> None:
    """torchtitan's grouped experts multiply in bfloat16 (``GroupedExperts.forward``
    casts); the same grouped products in float32, for a float32 comparison."""

    def forward(self, x_RD, num_tokens_per_expert_E):
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

        def mm(a, w):
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

        h = F.silu(mm(x_RD, self.w1_EFD)) * mm(x_RD, self.w3_EFD)
        return mm(h, self.w2_EDF)

    for name, module in model.named_modules():
        if name.endswith("inner_experts"):
            module.forward = types.MethodType(forward, module)


def _token_ids(tok) -> list[int]:
    return [*tok(tiny_text(), add_special_tokens=False).input_ids, tok.eos_token_id]


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return float(-logp.gather(1, ids[0, 1:, None]).mean())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A torchtitan model with 1.5-entmax routers and a non-zero expert bias, trained 6
    AdamW steps in torchtitan (bf16 experts, as the engine runs), then exported."""
    tmp = tmp_path_factory.mktemp("titan")
    tok = tiny_tokenizer()
    ids = torch.tensor([_token_ids(tok)])
    model = build()
    for moe in (m for m in model.modules() if type(m).__name__ == "MoE"):
        moe.expert_bias_E.copy_(torch.linspace(-0.05, 0.05, E))
    swap_routers(model, **KEYS)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    windows = ids[0, : 4 * 64].view(4, 64)
    losses = []
    for _ in range(6):
        logits = model(windows)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), windows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    folder = tmp / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # save_swapped: a plain load routes otherwise
        export_hf(model, folder, tokenizer=tok)
    text = tmp / "t.txt"
    text.write_text(tiny_text())
    return model, folder, text, ids, losses


def test_trained_in_torchtitan(trained) -> None:
    *_, losses = trained
    assert losses[-1] < losses[0] - 0.3, losses


def test_the_export_gives_the_torchtitan_logits_and_choices(trained) -> None:
    """float32 (torchtitan's experts in float32 too): the logits within 1e-5, the same
    expert ids and gate weights in every layer; the engine as it runs (bf16 experts)
    differs by bf16's rounding (on average; a near tie may flip an expert choice)."""
    model, folder, _, ids, _ = trained
    hf = load_swapped(folder)
    with torch.no_grad():
        bf16 = model(ids)
        float32_experts(model)
        titan = model(ids)
        ours = hf(input_ids=ids, use_cache=False).logits
    print(
        f"max |logit diff|: float32 {(titan - ours).abs().max():.3g}, "
        f"bf16 experts {(bf16 - ours).abs().max():.3g} (mean {(bf16 - ours).abs().mean():.3g})"
    )
    assert (titan - ours).abs().max() <= 1e-5
    assert (bf16 - ours).abs().mean() <= 1e-2
    tt_outs = [r.last for _, r in moelab_routers(model)]
    hf_outs = [r.last for r in swapped_routers(hf)]
    for a, b in zip(tt_outs, hf_outs, strict=True):
        assert torch.equal(a.ids_TK, b.ids_TK)
        torch.testing.assert_close(a.weights_TK, b.weights_TK, rtol=0, atol=1e-6)
    assert hf_outs[0].weights_TK.eq(0).any()  # entmax: some tokens use one expert


def test_stats_eval_and_analyze_read_the_moelab_routers(trained, tmp_path, capsys) -> None:
    model, folder, text, ids, _ = trained
    float32_experts(model)
    with torch.no_grad():
        nll2 = _nll(model(ids), ids)
        used = [(r.last.weights_TK > 0).sum(-1).double().mean().item()
                for _, r in moelab_routers(model)]  # fmt: skip
        for _, r in moelab_routers(model):
            r.router.top_k = 1
        nll1 = _nll(model(ids), ids)
        for _, r in moelab_routers(model):
            r.router.top_k = K
    capsys.readouterr()
    assert cli.main(["stats", "--hf", str(folder), "--data", str(text), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["map"], st["alpha"], st["top_k"], st["n_experts"]) == ("entmax", 1.5, K, E)
    assert st["tokens"] == ids.shape[1]
    assert st["nll"] == pytest.approx(nll2, rel=1e-5)
    assert [x["active_experts"] for x in st["layers"]] == pytest.approx(used, abs=1e-12)
    assert min(used) < K  # 1.5-entmax gave some tokens a single expert

    argv = ["eval", "--hf", str(folder), "--data", str(text), "--top-k", "1", "2", "--json"]
    assert cli.main(argv) == 0
    ev = json.loads(capsys.readouterr().out)
    assert (ev["map"], ev["trained_top_k"]) == ("entmax", K)
    nll = {r["top_k"]: r["nll"] for r in ev["results"]}
    assert nll[2] == pytest.approx(nll2, rel=1e-5)
    assert nll[1] == pytest.approx(nll1, rel=1e-5)

    argv = ["analyze", "coactivation", "--hf", str(folder), "--data", str(text)]
    assert cli.main([*argv, "--out", str(tmp_path / "a"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["map"], doc["alpha"], doc["n_layers"], doc["family"]) == (
        "entmax", 1.5, LAYERS, "qwen3_moe",
    )  # fmt: skip


def test_from_a_distributed_checkpoint(trained, tmp_path) -> None:
    """torchtitan's own checkpoint format (DCP, the model's state dict at the top level
    beside other states, as its checkpointer writes step-N), loaded into a freshly built
    model swapped with the same keys (load_checkpoint), exports the same routing."""
    import torch.distributed.checkpoint as dcp

    from moelab.integrations.torchtitan.export import load_checkpoint

    model, folder, _, ids, _ = trained
    state = {**model.state_dict(), "train_state": {"step": torch.tensor(6)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-6"), no_dist=True)
    fresh = build(seed=1)
    swap_routers(fresh, **KEYS)
    load_checkpoint(fresh, tmp_path / "step-6")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = export_hf(fresh.eval(), tmp_path / "hf")
    a, b = load_swapped(folder), load_swapped(again)
    with torch.no_grad():
        torch.testing.assert_close(
            a(input_ids=ids, use_cache=False).logits,
            b(input_ids=ids, use_cache=False).logits, rtol=0, atol=0,
        )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="step-N"):
        load_checkpoint(fresh, tmp_path / "step-7")


def test_refusals_in_one_line(tmp_path) -> None:
    from torchtitan.models.common.moe import MoE

    model = build()
    swap_routers(model, map="lapsum", selection="threshold", token_cap_factor=1.0, k_total=3.0)
    with pytest.raises(ValueError, match="k_total"):
        export_hf(model, tmp_path / "a")
    moe = next(m for m in build().modules() if isinstance(m, MoE))
    with pytest.raises(ValueError, match="Qwen3 and DeepSeek-V3 models"):
        export_hf(moe, tmp_path / "b")
    assert not Path(tmp_path / "a").exists()


@pytest.mark.parametrize(
    "engine,keys,yarn",
    [
        (dict(), KEYS, True),  # softmax top-2 swapped to 1.5-entmax; YaRN RoPE
        (dict(score="sigmoid", norm=True, scale=2.5, groups=4, limited=2), {}, False),
    ],
    ids=["entmax-yarn", "engine-sigmoid-groups"],
)
def test_a_deepseek_v3_model_exports_as_deepseek_v3(
    tmp_path, engine, keys, yarn, monkeypatch
) -> None:
    """torchtitan's DeepSeek-V3 (MLA attention, a shared expert, the first layer dense,
    a non-zero expert bias; YaRN RoPE as the debugmodel's, factor 40, the softmax scale's
    mscale) through DeepSeekV3StateDictAdapter.to_hf: the folder's logits within 1e-4 of
    the torchtitan model's in float32 (its activations reach ~30: 4e-6 relative in the
    first, dense layer already), the same expert ids in every layer."""
    import dataclasses

    # NOTE: flex_attention eager, not compiled as torchtitan runs it: torch 2.13's
    # compiled flex_attention on the CPU returned wrong values on an AVX2-only AMD EPYC
    # (1.8 off the eager one, which matches SDPA to 5e-7, with a causal BlockMask at
    # S = 40; NaN in this model), and what is compared here is the export
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    from tests.integrations.torchtitan.tiny import VOCAB as V3_VOCAB
    from tests.integrations.torchtitan.tiny import build as build_titan
    from tests.integrations.torchtitan.tiny import tiny_dsv3

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)
    cfg = tiny_dsv3(**engine)
    if yarn:  # 40 positions past an original length of 16
        for layer in cfg.layers:
            layer.attention.rope = dataclasses.replace(
                layer.attention.rope, scaling="yarn", rope_factor=40.0, original_seq_len=16
            )
    model = build_titan(cfg)
    for i, moe in enumerate(m for m in model.modules() if type(m).__name__ == "MoE"):
        moe.expert_bias_E.copy_(torch.linspace(-0.1, 0.1, E).roll(i))
    swap_routers(model, **keys)
    model.eval()
    float32_experts(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = export_hf(model, tmp_path / "v3")
    hf = load_swapped(folder)
    assert hf.config.model_type == "deepseek_v3" and hf.config.first_k_dense_replace == 1
    assert hf.config.rope_parameters["rope_type"] == ("yarn" if yarn else "default")
    x = torch.randint(0, V3_VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masks = model.get_attention_masks(torch.arange(40).repeat(2, 1))
        titan = model(x, attention_masks=masks)
        ours = hf(input_ids=x, use_cache=False).logits
    assert (titan - ours).abs().max() <= 1e-4
    for (_, a), b in zip(moelab_routers(model), swapped_routers(hf), strict=True):
        assert torch.equal(a.last.ids_TK, b.last.ids_TK)
