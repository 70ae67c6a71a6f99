"""The gate-norm study's loss oracle (moelab.studies.gate_norm.run): each expert's loss on
a token, against a brute force over the experts on a tiny model (a full forward per token
and expert, the expert's SwiGLU and the cross-entropy written out here in float64), and
the agreement measures against hand computations and scipy."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import spearmanr

from moelab.model import ModelConfig, Transformer
from moelab.studies.gate_norm import oracle_agreement
from moelab.studies.gate_norm.findings import ORACLE_CLAIM, checks, findings
from moelab.studies.gate_norm.grid import ARMS
from moelab.studies.gate_norm.run import expert_losses


def _tiny() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        n_layers=3, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=40,
        max_seq_len=12, n_experts=4, moe_layers=[0, 2], router={"top_k": 2},
    )  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():  # larger expert weights, so that the experts' losses differ
        for layer in model.moe_layers:
            for p in layer.experts.parameters():
                p.mul_(20)
    return model


def _brute_force(model, x_BS, y_BS, b, t, e, layer):
    """The loss at (b, t) with MoE layer ``layer``'s output there replaced by expert e's,
    from one full forward of the whole batch."""
    moe = model.moe_layers[layer]
    ex = moe.experts

    def replace(module, args, output):
        y_BSD, out = output
        x_D = args[0][b, t].double()
        h_F = torch.nn.functional.silu(ex.w_gate_EFD[e].double() @ x_D)
        h_F = h_F * (ex.w_up_EFD[e].double() @ x_D)
        y_BSD = y_BSD.clone()
        y_BSD[b, t] = (ex.w_down_EDF[e].double() @ h_F).to(y_BSD.dtype)
        return y_BSD, out

    handle = moe.register_forward_hook(replace)
    try:
        with torch.no_grad():
            logits_V = model(x_BS, collect=False).logits_BSV[b, t].double()
    finally:
        handle.remove()
    return float(-(logits_V[y_BS[b, t]] - torch.logsumexp(logits_V, -1)))


@pytest.mark.parametrize("layer", [0, -1])
def test_expert_losses_against_a_brute_force_over_the_experts(layer):
    model = _tiny()
    g = torch.Generator().manual_seed(1)
    x_BS = torch.randint(0, 40, (2, 12), generator=g)
    y_BS = torch.randint(0, 40, (2, 12), generator=g)
    positions = torch.tensor([[0, 0], [0, 5], [1, 11], [1, 3]])
    losses_WE, scores_WE = expert_losses(model, x_BS, y_BS, positions, layer)
    assert losses_WE.shape == scores_WE.shape == (4, 4) and losses_WE.dtype == torch.float64
    with torch.no_grad():
        out = model(x_BS)  # the router's map values at the tokens, from a plain forward
    probs_BSE = out.router_outputs[layer].probs_TE.reshape(2, 12, 4)
    for w, (b, t) in enumerate(positions.tolist()):
        for e in range(4):
            want = _brute_force(model, x_BS, y_BS, b, t, e, layer)
            assert float(losses_WE[w, e]) == pytest.approx(want, rel=1e-5), (b, t, e)
        assert scores_WE[w].tolist() == pytest.approx(probs_BSE[b, t].tolist(), abs=1e-7)
    # the experts' losses differ, so the oracle ranks something
    assert float((losses_WE.max(-1).values - losses_WE.min(-1).values).min()) > 1e-3


def test_agreement_against_a_hand_computation_and_scipy():
    """Four tokens, three experts:
    t0: scores rank as -losses (rho 1), top-1 agrees, regret 0;
    t1: ranks [3, 2, 1] against [2, 3, 1]: rho 0.5; top-1 (loss 2) misses the least (1):
        regret 1;
    t2: tied losses, average ranks [2.5, 2.5, 1] against [3, 2, 1]: rho sqrt(0.75);
        top-1 (loss 1) is a least-loss expert;
    t3: all scores equal: no rho (left out); top-1 the first expert, loss 1 = least."""
    losses = torch.tensor([[1.0, 2.0, 3.0], [2.0, 1.0, 3.0], [1.0, 1.0, 2.0], [1.0, 1.0, 2.0]])
    scores = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.1, 0.1]])
    got = oracle_agreement(losses, scores)
    rho = (1.0 + 0.5 + math.sqrt(0.75)) / 3
    assert got["top1"] == pytest.approx(3 / 4)
    assert got["spearman"] == pytest.approx(rho, abs=1e-12)
    assert got["regret"] == pytest.approx(1 / 4)
    assert (got["chance"], got["tokens"]) == (pytest.approx(1 / 3), 4)
    scipy_rho = [spearmanr(scores[w], -losses[w]).statistic for w in range(3)]
    assert got["spearman"] == pytest.approx(sum(scipy_rho) / 3, abs=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        oracle_agreement(losses, scores[:, :2])
    none = oracle_agreement(losses[3:], scores[3:])
    assert none["spearman"] is None and none["top1"] == 1.0


def _main(active_relu: float) -> dict:
    names = [name for name, _, _ in ARMS]
    main = {n: {"val_loss": [5.0, 5.1, 5.2], "load_cv": [0.2, 0.3, 0.25]} for n in names}
    main["relu"]["active_experts"] = [active_relu] * 3
    return main


def test_oracle_finding_each_way_and_the_relu_target():
    k1 = [{"renorm": 1e-12, "map": 1e-3}] * 3
    main = _main(1.54)
    ranks = {"softmax-topk": [0.31, 0.27, 0.35]}
    got = {f.key: f for f in findings(main, k1, oracle=ranks)}
    assert got[ORACLE_CLAIM].verdict == "holds"
    assert got[ORACLE_CLAIM].effect.values == pytest.approx((0.31, 0.27, 0.35))
    ranks = {"softmax-topk": [-0.2, -0.25, -0.3]}  # ranks against the losses
    assert {f.key: f for f in findings(main, k1, oracle=ranks)}[
        ORACLE_CLAIM
    ].verdict == "contradicted"
    assert {f.key: f for f in findings(main, k1)}[ORACLE_CLAIM].verdict == "not measured"
    # the ReLU arm's 1.54 experts against its target 2: a warning; 1.95: met
    explored = {"sample": [0.3], "noisy": [0.2]}
    (line,) = [x for x in checks(main, explored, k1) if "ReLU" in x]
    assert line.startswith("warning: the ReLU arm computes 1.54 experts per token")
    (line,) = [x for x in checks(_main(1.95), explored, k1) if "ReLU" in x]
    assert line.startswith("the ReLU arm computes 1.95 experts per token: its target 2 met")
