"""Scopes of the Switch balance loss (RouterConfig.aux_scope, moelab.routing.balancing.
scoped_switch_loss): per micro-batch, per sequence (DeepSeek-V3), global (Qiu et al. 2025;
its two-rank test is tests/train/test_distributed_aux_scope.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moelab.moe import MoE, MoEConfig
from moelab.routing import Router, RouterConfig, balancing


def _v3_sequence_loss(
    a_TE: torch.Tensor, ids_TK: torch.Tensor, n_seqs: int, n_experts: int
) -> torch.Tensor:
    """Slow: DeepSeek-V3's formula, a loop over sequences and experts: f_e = E / (K S) *
    (count of e in the sequence's top-K), P_e = mean over the sequence of a / sum_e a."""
    seq_len, top_k = a_TE.shape[0] // n_seqs, ids_TK.shape[1]
    total = a_TE.new_zeros(())
    for b in range(n_seqs):
        rows = range(b * seq_len, (b + 1) * seq_len)
        for e in range(n_experts):
            count = sum(int(ids_TK[t, k]) == e for t in rows for k in range(top_k))
            f = n_experts / (top_k * seq_len) * count
            P = sum(a_TE[t, e] / a_TE[t].sum() for t in rows) / seq_len
            total = total + f * P
    return total / n_seqs


def _switch_per_sequence(
    p_TE: torch.Tensor, ids_TK: torch.Tensor, sel_TK: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Slow: the Switch formula on each sequence alone (f = share of its selected
    slots), averaged over the sequences."""
    n_experts = p_TE.shape[1]
    losses = []
    for start in range(0, p_TE.shape[0], seq_len):
        counts = [0] * n_experts
        for t in range(start, start + seq_len):
            for k in range(ids_TK.shape[1]):
                if sel_TK[t, k]:
                    counts[int(ids_TK[t, k])] += 1
        total = max(sum(counts), 1)
        P = p_TE[start : start + seq_len].mean(0)
        losses.append(n_experts * sum(counts[e] / total * P[e] for e in range(n_experts)))
    return torch.stack(losses).mean()


def _router(**kw: Any) -> Router:
    base: dict[str, Any] = dict(d_model=6, n_experts=8, top_k=2, aux_weight=0.1)
    base.update(kw)
    torch.manual_seed(0)
    router = Router(RouterConfig(**base))
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    return router


def test_sequence_scope_is_deepseek_v3s_loss() -> None:
    router = _router(
        map="sigmoid", n_groups=4, topk_groups=2, renorm=True, top_k=3,
        aux_scope="sequence", aux_probs="normalized",
    )  # fmt: skip
    n_seqs, seq_len = 3, 7
    x_TD = torch.randn(n_seqs * seq_len, 6)
    out = router(x_TD, seq_len=seq_len)
    a_TE = torch.sigmoid(x_TD @ router.weight.t())
    expected = _v3_sequence_loss(a_TE, out.ids_TK, n_seqs, 8)
    torch.testing.assert_close(out.losses["switch"], expected)
    torch.testing.assert_close(out.aux_loss, 0.1 * expected)
    # the sequences differ: the micro-batch loss is another number
    batch = balancing.scoped_switch_loss(
        balancing.aux_source("normalized", out.logits_TE, out.probs_TE),
        out.ids_TK, out.selected_TK, 8, "micro_batch",
    )  # fmt: skip
    assert abs(float(batch.detach()) - float(expected.detach())) > 1e-4


@pytest.mark.parametrize("aux_probs", ["map", "softmax", "normalized"])
def test_sequence_scope_matches_a_loop_with_truncation(aux_probs: str) -> None:
    # a truncating rule: f counts the selected slots of each sequence
    router = _router(
        map="sparsemax", selection="threshold", truncation=0.05, aux_scope="sequence",
        aux_probs=aux_probs,
    )  # fmt: skip
    x_TD = torch.randn(4 * 5, 6)
    out = router(x_TD, seq_len=5)
    assert not out.selected_TK.all()
    source = {
        "map": out.probs_TE,
        "softmax": torch.softmax(out.logits_TE, -1),
        "normalized": out.probs_TE / out.probs_TE.sum(-1, keepdim=True),
    }[aux_probs]
    expected = _switch_per_sequence(source, out.ids_TK, out.selected_TK, 5)
    torch.testing.assert_close(out.losses["switch"], expected)


def test_sequence_scope_through_the_moe_layer() -> None:
    rc = RouterConfig(d_model=6, n_experts=4, top_k=2, aux_weight=0.1, aux_scope="sequence")
    torch.manual_seed(1)
    moe = MoE(MoEConfig(d_model=6, d_ff=8, router=rc))
    x_BSD = torch.randn(3, 5, 6)
    _, out = moe(x_BSD)  # (B, S, D): the layer passes S = 5
    expected = _switch_per_sequence(out.probs_TE, out.ids_TK, out.selected_TK, 5)
    torch.testing.assert_close(out.losses["switch"], expected)
    # (T, D): no sequence structure known, the call is one sequence = the micro-batch loss
    _, flat = moe(x_BSD.reshape(15, 6))
    whole = balancing.switch_loss(flat.probs_TE, flat.ids_TK, flat.selected_TK, 4)
    torch.testing.assert_close(flat.losses["switch"], whole)
    assert abs(float(whole.detach()) - float(expected.detach())) > 1e-6


def test_gradient_of_the_sequence_loss() -> None:
    torch.manual_seed(2)
    ids_TK = torch.randint(0, 5, (12, 2))
    selected_TK = torch.rand(12, 2) > 0.2
    p_TE = torch.rand(12, 5, dtype=torch.float64, requires_grad=True)

    def loss(p: torch.Tensor) -> torch.Tensor:
        return balancing.scoped_switch_loss(p, ids_TK, selected_TK, 5, "sequence", 4)

    assert torch.autograd.gradcheck(loss, (p_TE,))
    (grad,) = torch.autograd.grad(loss(p_TE), p_TE)
    q_TE = p_TE.detach().clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(_switch_per_sequence(q_TE, ids_TK, selected_TK, 4), q_TE)
    torch.testing.assert_close(grad, ref)


def test_micro_batch_and_one_process_global_equal_the_switch_loss() -> None:
    x_TD = torch.randn(14, 6)
    losses, grads = [], []
    for scope in ("micro_batch", "global"):
        router = _router(aux_scope=scope)
        out = router(x_TD, seq_len=7)  # seq_len is ignored by these scopes
        out.aux_loss.backward()
        losses.append(out.losses["switch"])
        grads.append(router.weight.grad)
        switch = balancing.switch_loss(out.probs_TE, out.ids_TK, out.selected_TK, 8)
        assert torch.equal(out.losses["switch"], switch)
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])


def test_normalized_probs() -> None:
    logits = torch.randn(5, 4)
    probs = torch.sigmoid(logits)
    got = balancing.aux_source("normalized", logits, probs)
    torch.testing.assert_close(got, probs / probs.sum(-1, keepdim=True))
    soft = torch.softmax(logits, -1)
    torch.testing.assert_close(balancing.aux_source("normalized", logits, soft), soft)
    # a row of no mass (relu of negative scores) gives 0, not NaN
    zero = balancing.aux_source("normalized", logits, torch.zeros(2, 4))
    assert torch.equal(zero, torch.zeros(2, 4))


def test_refusals() -> None:
    with pytest.raises(ValueError, match="aux_scope must be one of"):
        RouterConfig(d_model=4, n_experts=4, aux_scope="batch")
    with pytest.raises(ValueError, match="aux_probs must be one of"):
        RouterConfig(d_model=4, n_experts=4, aux_probs="sum")
    p_TE, ids_TK = torch.rand(6, 4), torch.zeros(6, 1, dtype=torch.long)
    selected_TK = torch.ones(6, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="must be positive and divide T = 6"):
        balancing.scoped_switch_loss(p_TE, ids_TK, selected_TK, 4, "sequence", 4)
    with pytest.raises(ValueError, match="scope must be"):
        balancing.scoped_switch_loss(p_TE, ids_TK, selected_TK, 4, "batch")
