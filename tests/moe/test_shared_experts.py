"""Shared experts (DeepSeekMoE), optionally behind Qwen2-MoE's sigmoid gate: the wide
SwiGLU against a loop over N separate experts, the MoE layer against routed + shared,
gradients, config refusals, parameter counts and a tiny training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moelab import cli
from moelab.model import ModelConfig, Transformer, load_preset, param_counts
from moelab.moe import MoE, MoEConfig
from moelab.moe.shared import SharedExperts
from moelab.routing import RouterConfig
from moelab.train import apply_overrides


def _loop_reference(shared: SharedExperts, x_TD: torch.Tensor) -> torch.Tensor:
    """sum over s of N separate SwiGLU experts (weights cut out of the stacked ones),
    token by token, times sigmoid(x . w) with a gate."""
    F_ = shared.d_ff
    rows = []
    for t in range(x_TD.shape[0]):
        x = x_TD[t]
        y = torch.zeros_like(x)
        for s in range(shared.n_experts):
            w_gate = shared.w_gate_HD[s * F_ : (s + 1) * F_]  # (F, D)
            w_up = shared.w_up_HD[s * F_ : (s + 1) * F_]
            w_down = shared.w_down_DH[:, s * F_ : (s + 1) * F_]  # (D, F)
            y = y + w_down @ (F.silu(w_gate @ x) * (w_up @ x))
        if shared.gate_D is not None:
            y = torch.sigmoid(x @ shared.gate_D) * y
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("gate", [False, True])
def test_one_wide_swiglu_equals_a_loop_over_the_shared_experts(gate: bool) -> None:
    torch.manual_seed(0)
    shared = SharedExperts(3, 8, 5, gate=gate).double()
    with torch.no_grad():  # larger weights than the init, so that every term matters
        for p in shared.parameters():
            p.normal_()
    x_TD = torch.randn(7, 8, dtype=torch.float64)
    torch.testing.assert_close(shared(x_TD), _loop_reference(shared, x_TD))
    summed = sum(shared.forward_expert(s, x_TD) for s in range(3))
    if gate:
        summed = torch.sigmoid(x_TD @ shared.gate_D.unsqueeze(-1)) * summed
    torch.testing.assert_close(shared(x_TD), summed)


@pytest.mark.parametrize("gate", [False, True])
def test_the_layer_adds_the_shared_experts_to_the_routed_output(gate: bool) -> None:
    torch.manual_seed(1)
    rc = RouterConfig(d_model=8, n_experts=4, top_k=2)
    moe = MoE(MoEConfig(8, 6, rc, n_shared_experts=2, shared_gate=gate)).double()
    routed = MoE(MoEConfig(8, 6, rc)).double()
    missing, unexpected = routed.load_state_dict(moe.state_dict(), strict=False)
    assert not missing and all(k.startswith("shared.") for k in unexpected)
    x_BSD = torch.randn(2, 5, 8, dtype=torch.float64)
    y, out = moe(x_BSD)
    y_routed, out_routed = routed(x_BSD)
    assert torch.equal(out.ids_TK, out_routed.ids_TK)
    assert moe.shared is not None
    expected = y_routed + _loop_reference(moe.shared, x_BSD.reshape(-1, 8)).reshape(2, 5, 8)
    torch.testing.assert_close(y, expected)
    assert y.shape == x_BSD.shape


def test_shared_experts_gradcheck_with_the_gate() -> None:
    torch.manual_seed(2)
    shared = SharedExperts(2, 4, 3, gate=True).double()
    x_TD = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    params = [shared.w_gate_HD, shared.w_up_HD, shared.w_down_DH, shared.gate_D]

    def fn(x, w_gate, w_up, w_down, gate):
        h = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
        return torch.sigmoid(x @ gate.unsqueeze(-1)) * F.linear(h, w_down)

    # the module's forward is the function checked
    torch.testing.assert_close(shared(x_TD), fn(x_TD, *params))
    leaves = [x_TD] + [p.detach().clone().requires_grad_(True) for p in params]
    assert torch.autograd.gradcheck(fn, leaves)


def test_layer_gradients_match_the_loop_reference() -> None:
    torch.manual_seed(3)
    rc = RouterConfig(d_model=6, n_experts=4, top_k=2)
    moe = MoE(MoEConfig(6, 4, rc, n_shared_experts=2, shared_gate=True)).double()
    assert moe.shared is not None
    x_TD = torch.randn(5, 6, dtype=torch.float64)
    target = torch.randn(5, 6, dtype=torch.float64)
    y, _ = moe(x_TD)
    (y * target).sum().backward()
    got = [p.grad.clone() for p in moe.shared.parameters()]
    for p in moe.shared.parameters():
        p.grad = None
    (_loop_reference(moe.shared, x_TD) * target).sum().backward()
    for g, p in zip(got, moe.shared.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
        assert g.abs().sum() > 0


def test_config_refusals_and_defaults() -> None:
    rc = RouterConfig(d_model=8, n_experts=4)
    assert (MoEConfig(8, 16, rc).n_shared_experts, MoEConfig(8, 16, rc).shared_gate) == (0, False)
    assert MoE(MoEConfig(8, 16, rc)).shared is None
    with pytest.raises(ValueError, match="n_shared_experts must be >= 0"):
        MoEConfig(8, 16, rc, n_shared_experts=-1)
    with pytest.raises(ValueError, match="n_shared_experts >= 1"):
        MoEConfig(8, 16, rc, shared_gate=True)
    base = dict(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=10)
    with pytest.raises(ValueError, match="n_shared_experts >= 1"):
        ModelConfig(**base, max_seq_len=8, shared_gate=True)
    # --set reaches ModelConfig, and the value is typed
    cfg = apply_overrides({"preset": "tiny"}, ["model.n_shared_experts=2", "shared_gate=yes"])
    mc = cfg.model_config()
    assert (mc.n_shared_experts, mc.shared_gate) == (2, True)
    with pytest.raises(ValueError, match="n_shared_experts"):
        apply_overrides({"preset": "tiny"}, ["model.n_shared_experts=1.5"])


def test_params_count_the_shared_experts_as_total_and_active(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # tiny: D = 128, expert width 256, MoE in blocks 1 and 3 (2 layers), E = 8, K = 2
    base = param_counts(load_preset("tiny"))
    expert = 3 * 128 * 256  # one SwiGLU expert: gate, up, down
    command = ["params", "--preset", "tiny", "--set", "model.n_shared_experts=1", "--json"]
    assert cli.main(command) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == base["total"] + 2 * expert == 2_690_176
    assert out["active"] == base["active"] + 2 * expert == 1_510_528
    assert out["router"] == base["router"] == 2 * 8 * 128
    gated = ["params", "--preset", "tiny", "--set", "model.n_shared_experts=2"]
    assert cli.main([*gated, "--set", "model.shared_gate=true", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == base["total"] + 2 * (2 * expert + 128)  # + the gate vectors
    assert out["active"] == base["active"] + 2 * (2 * expert + 128)
    # the count is what the built model holds
    small = ModelConfig(
        n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=50,
        max_seq_len=8, n_experts=4, n_shared_experts=3, shared_gate=True,
    )  # fmt: skip
    model = Transformer(small)
    assert param_counts(small)["total"] == sum(p.numel() for p in model.parameters())
    assert cli.main(["params", "--preset", "tiny", "--set", "model.n_shared_experts=-1"]) == 2
    assert "n_shared_experts must be >= 0" in capsys.readouterr().err


def test_a_tiny_model_learns_with_a_gated_shared_expert(tmp_path: Path) -> None:
    from moelab.diagnostics import load_run, stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "n_shared_experts": 1, "shared_gate": True}
    train_learns(corpus, run, model=model)
    loaded = load_run(run)
    layer = loaded.model.moe_layers[0]
    assert layer.shared is not None and layer.shared.gate_D is not None
    assert loaded.model.config.n_shared_experts == 1
    # measured parameters per token (top-2, no drops) = the count of `moelab params`
    st = stats(loaded, max_batches=1)
    assert st["active_params"] == param_counts(loaded.model.config)["active"]
