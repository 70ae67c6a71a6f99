"""Hash routing (moelab/routing/selection/hash.py): a fixed token id -> experts table, random
or balanced by the training data's token frequencies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moelab.model import ModelConfig
from moelab.routing import Router, RouterConfig
from moelab.routing.selection.hash import Hash, balanced_table


def _config(**kw) -> RouterConfig:
    base = dict(d_model=8, n_experts=4, top_k=2, selection="hash", vocab_size=10)
    return RouterConfig(**{**base, **kw})


def _reference_balanced(counts: list[int], n_experts: int, top_k: int) -> list[list[int]]:
    """Slow: column by column, the ids by count, descending (ties: lower id), each to the
    expert of least load (ties: lower expert) not yet in its row; unseen ids
    round-robin in id order."""
    loads = [0] * n_experts
    table: list[list[int]] = [[] for _ in counts]
    seen = sorted((v for v in range(len(counts)) if counts[v] > 0), key=lambda v: -counts[v])
    for _ in range(top_k):
        for v in seen:
            free = [e for e in range(n_experts) if e not in table[v]]
            e = min(free, key=lambda e: (loads[e], e))
            table[v].append(e)
            loads[e] += counts[v]
    unseen = [v for v in range(len(counts)) if counts[v] == 0]
    for j, v in enumerate(unseen):
        table[v] = [(j * top_k + i) % n_experts for i in range(top_k)]
    return table


def _loads(table_VK: torch.Tensor, counts_V: torch.Tensor, n_experts: int) -> list[int]:
    loads = [0] * n_experts
    for v, row in enumerate(table_VK.tolist()):
        for e in row:
            loads[e] += int(counts_V[v])
    return loads


def test_routing_is_a_lookup_of_the_table() -> None:
    torch.manual_seed(0)
    router = Router(_config(vocab_size=50))
    table = router.selection.table_VK
    ids_T = torch.randint(0, 50, (37,))
    out = router(torch.randn(37, 8), token_ids_T=ids_T)
    for t in range(37):
        assert out.ids_TK[t].tolist() == table[int(ids_T[t])].tolist()
    assert out.selected_TK.all()
    # the gates are the map's values at the table's experts
    for t in range(37):
        for j in range(2):
            assert out.weights_TK[t, j] == out.probs_TE[t, out.ids_TK[t, j]]
    # a smaller K at inference takes the first columns; a larger one leaves the extra
    # slots unused
    one = router(torch.randn(37, 8), top_k=1, token_ids_T=ids_T)
    assert one.ids_TK[:, 0].tolist() == [int(table[int(v), 0]) for v in ids_T]
    four = router(torch.randn(37, 8), top_k=4, token_ids_T=ids_T)
    assert torch.equal(four.ids_TK[:, :2], out.ids_TK)
    assert four.selected_TK.tolist() == [[True, True, False, False]] * 37
    assert (four.weights_TK[:, 2:] == 0).all() and not four.computed_TK[:, 2:].any()


def test_random_table_is_distinct_per_token_and_follows_the_seed() -> None:
    torch.manual_seed(1)
    table = Router(_config(vocab_size=200, n_experts=8, top_k=3)).selection.table_VK
    assert table.shape == (200, 3) and table.dtype == torch.int64
    assert all(len(set(row)) == 3 for row in table.tolist())
    assert int(table.min()) >= 0 and int(table.max()) < 8
    assert len(set(table.flatten().tolist())) == 8  # every expert is drawn
    torch.manual_seed(1)
    again = Router(_config(vocab_size=200, n_experts=8, top_k=3)).selection.table_VK
    torch.manual_seed(2)
    other = Router(_config(vocab_size=200, n_experts=8, top_k=3)).selection.table_VK
    assert torch.equal(table, again) and not torch.equal(table, other)


def test_balanced_table_hand_computed() -> None:
    # K = 1, E = 2, counts (10, 1, 7, 3, 0, 4): 0 -> e0 (10), 2 -> e1 (7), 5 -> e1 (11),
    # 3 -> e0 (13), 1 -> e1 (12); id 4 never occurs: round-robin, e0
    counts = torch.tensor([10, 1, 7, 3, 0, 4])
    table = balanced_table(counts, 2, 1)
    assert table.flatten().tolist() == [0, 1, 1, 0, 0, 1]
    assert _loads(table, counts, 2) == [13, 12]
    assert _loads(torch.arange(6).remainder(2)[:, None], counts, 2) == [17, 8]  # id mod E
    # K = 2, E = 3, counts (6, 5, 4, 3, 2, 1). Column 0: 0 -> e0, 1 -> e1, 2 -> e2,
    # 3 -> e2, 4 -> e1, 5 -> e0: loads 7, 7, 7. Column 1, skipping the row's expert:
    # 0 -> e1 (7 = 7, lower index), 1 -> e0, 2 -> e0 (12 < 13), 3 -> e1 (13 < 16),
    # 4 -> e2, 5 -> e2: loads 16, 16, 10
    counts = torch.tensor([6, 5, 4, 3, 2, 1])
    table = balanced_table(counts, 3, 2)
    assert table.tolist() == [[0, 1], [1, 0], [2, 0], [2, 1], [1, 2], [0, 2]]
    assert _loads(table[:, :1], counts, 3) == [7, 7, 7]
    assert _loads(table, counts, 3) == [16, 16, 10]


def test_balanced_table_matches_the_loop_and_evens_a_skewed_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    V, E, K = 300, 8, 2
    zipf = (10_000 / torch.arange(1, V + 1).double()).long()  # most frequent: id 0
    counts_V = zipf[torch.randperm(V, generator=gen)]
    counts_V[:7] = 0  # ids never seen
    table = balanced_table(counts_V, E, K)
    assert table.tolist() == _reference_balanced(counts_V.tolist(), E, K)
    assert all(len(set(row)) == K for row in table.tolist())
    loads = _loads(table, counts_V, E)
    random_loads = _loads(torch.rand(V, E, generator=gen).argsort(1)[:, :K], counts_V, E)
    # greedy by frequency: the first column's spread is at most the largest count, and
    # the table's loads are far more even than a random table's
    first = _loads(table[:, :1], counts_V, E)
    assert max(first) - min(first) <= int(counts_V.max())
    assert np.std(loads) < 0.25 * np.std(random_loads)
    # the experts are not locked in groups: many distinct pairs
    assert len({tuple(sorted(row)) for row in table.tolist()}) > E


def test_balance_rebuilds_the_balanced_table_only() -> None:
    router = Router(_config(vocab_size=6, n_experts=2, top_k=1, hash_table="balanced"))
    rule = router.selection
    assert rule.needs_token_counts
    # before balance(): every id unseen, round-robin
    assert rule.table_VK.flatten().tolist() == [0, 1, 0, 1, 0, 1]
    rule.balance(torch.tensor([10, 1, 7, 3, 0, 4]))
    assert rule.table_VK.flatten().tolist() == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="a count >= 0 for each of the V = 6"):
        rule.balance(torch.tensor([1, 2, 3]))
    random_rule = Router(_config()).selection
    assert not random_rule.needs_token_counts
    with pytest.raises(ValueError, match="drawn at construction"):
        random_rule.balance(torch.ones(10))


def test_checkpoint_round_trip_keeps_the_table() -> None:
    torch.manual_seed(0)
    router = Router(_config(vocab_size=40))
    torch.manual_seed(1)
    fresh = Router(_config(vocab_size=40))
    assert not torch.equal(fresh.selection.table_VK, router.selection.table_VK)
    assert "selection.table_VK" in router.state_dict()
    fresh.load_state_dict(router.state_dict())
    assert torch.equal(fresh.selection.table_VK, router.selection.table_VK)
    ids_T = torch.randint(0, 40, (16,))
    x_TD = torch.randn(16, 8)
    assert torch.equal(
        fresh(x_TD, token_ids_T=ids_T).ids_TK, router(x_TD, token_ids_T=ids_T).ids_TK
    )


def test_missing_or_bad_token_ids_are_refused() -> None:
    router = Router(_config())
    with pytest.raises(ValueError, match="routes by token id"):
        router(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size = 10\)"):
        router(torch.randn(2, 8), token_ids_T=torch.tensor([3, 10]))


def test_learned_score_gate_gradient_matches_a_loop_reference() -> None:
    torch.manual_seed(0)
    router = Router(_config(vocab_size=12))
    table = router.selection.table_VK.tolist()
    x_TD = torch.randn(19, 8)
    ids_T = torch.randint(0, 12, (19,))
    target_TK = torch.randn(19, 2)
    (router(x_TD, token_ids_T=ids_T).weights_TK * target_TK).sum().backward()

    weight = router.weight.detach().clone().requires_grad_(True)
    probs_TE = torch.softmax(x_TD @ weight.t(), -1)
    loss = sum(
        probs_TE[t, e] * target_TK[t, j]
        for t in range(19)
        for j, e in enumerate(table[int(ids_T[t])])
    )
    loss.backward()
    assert router.weight.grad is not None and weight.grad is not None
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)
    # Roller et al.'s plain hash layer: K = 1 with renorm, every gate 1
    plain = Router(_config(top_k=1, renorm=True))
    out = plain(torch.randn(7, 8), token_ids_T=torch.arange(7))
    assert torch.equal(out.weights_TK, torch.ones(7, 1))


def test_config_answers_and_refusals() -> None:
    config = _config()
    assert (config.slots, config.expected_experts) == (2, 2.0)
    rule = config.selection_rule
    assert rule is Hash
    assert (rule.truncates, rule.sweep, rule.calibrates) == (False, "top_k", False)
    with pytest.raises(ValueError, match="needs vocab_size"):
        RouterConfig(d_model=8, n_experts=4, selection="hash")
    for key, value in (("noise_std", 0.1), ("sample_extra", 1), ("bias_rate", 0.01)):
        with pytest.raises(ValueError, match=f"set {key}=0"):
            _config(**{key: value})
    with pytest.raises(ValueError, match="hash_table must be one of"):
        _config(hash_table="bigram")
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        _config(vocab_size=0)
    # the model gives its routers its vocabulary
    mc = ModelConfig(
        n_layers=2,
        d_model=8,
        n_heads=2,
        n_kv_heads=1,
        d_ff=16,
        vocab_size=77,
        max_seq_len=8,
        n_experts=4,
        router={"selection": "hash"},
    )
    assert mc.router_config().vocab_size == 77


def test_a_tiny_model_learns_with_hash_routing(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from moelab.data import TokenShard
    from moelab.diagnostics import evaluate, stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "router": {"selection": "hash", "hash_table": "balanced"}}
    train_learns(corpus, run, checkpoint_every=50, model=model)
    # the saved tables are balanced on the training shard's token counts
    shard = TokenShard.open(run / "data" / "train.bin")
    counts_V = torch.from_numpy(np.bincount(shard.tokens, minlength=shard.vocab_size))
    want = torch.tensor(_reference_balanced(counts_V.tolist(), 4, 2))
    (checkpoint,) = (p for p in run.rglob("model.safetensors"))
    tables = {k: v for k, v in load_file(checkpoint).items() if k.endswith("table_VK")}
    assert len(tables) == 1 and all(torch.equal(t, want) for t in tables.values())
    st = stats(run, max_batches=1)  # the model passes the token ids to its routers
    assert (st["selection"], st["truncating"]) == ("hash", False)
    for layer in st["layers"]:
        assert layer["active_experts"] == pytest.approx(2.0)
    # the K sweep: K = 4 routes the table's 2 experts, as K = 2 does
    sweep = evaluate(run, [1, 2, 4], max_batches=1)["results"]
    assert [r["active_experts"] for r in sweep] == pytest.approx([1.0, 2.0, 2.0])
    assert sweep[2]["nll"] == pytest.approx(sweep[1]["nll"]) and sweep[0]["nll"] > 0
