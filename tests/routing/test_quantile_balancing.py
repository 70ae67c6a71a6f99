"""Quantile balancing (bias_update="quantile"): the bias against a brute-force bisection
of the same load target, its fixed point on a frozen batch, the blend and centring, the
router's update, the config's checks, and a tiny model whose load it evens out."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.model.config import ModelConfig
from moelab.model.transformer import Transformer
from moelab.routing import Router, RouterConfig
from moelab.routing.balancing import (
    expert_counts,
    global_mean,
    quantile_bias,
    quantile_update,
)
from moelab.routing.measures import load_cv
from moelab.routing.router import step_routers

# Shape suffixes: T, E, K (moelab.shapes).


def _takers(rank_TE: torch.Tensor, bias_E: torch.Tensor, k: int, e: int, b: float) -> int:
    """Tokens whose top k of rank + bias holds expert e when e's bias is b (the others
    held): the router's own choice, counted."""
    trial_E = bias_E.clone()
    trial_E[e] = b
    ids_TK = (rank_TE + trial_E).topk(k, dim=-1).indices
    return int((ids_TK == e).sum())


def _bisect(rank_TE: torch.Tensor, bias_E: torch.Tensor, k: int, e: int, n: int) -> float:
    """The smallest bias of e (to float64 resolution) at which at least n tokens take it."""
    lo, hi = -1e3, 1e3  # no token at lo, every token at hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if _takers(rank_TE, bias_E, k, e, mid) >= n:
            hi = mid
        else:
            lo = mid
    return hi


@pytest.mark.parametrize(("T", "E", "K"), [(64, 8, 2), (203, 8, 2), (50, 6, 1), (97, 16, 4)])
def test_each_expert_gets_its_share_as_bisection_finds_it(T: int, E: int, K: int) -> None:
    gen = torch.Generator().manual_seed(T + E + K)
    # experts of different popularity, a current bias of no particular kind
    rank_TE = torch.randn(T, E, generator=gen, dtype=torch.float64) + torch.linspace(-1, 1, E)
    bias_E = 0.3 * torch.randn(E, generator=gen, dtype=torch.float64)
    new_E = quantile_bias(rank_TE, bias_E, K)
    n = math.floor(T * K / E + 0.5)  # the share, rounded: within half a token of T K / E
    assert abs(n - T * K / E) <= 0.5
    for e in range(E):
        # brute force, the other biases held: the interval of e's bias in which exactly
        # n tokens take e, from the bias at which n enter to the one at which n + 1 do
        enter_n = _bisect(rank_TE, bias_E, K, e, n)
        enter_next = _bisect(rank_TE, bias_E, K, e, n + 1)
        b = float(new_E[e])
        assert enter_n <= b < enter_next, (e, enter_n, b, enter_next)
        assert _takers(rank_TE, bias_E, K, e, b) == n
        # midway between the two (to bisection's resolution)
        assert b == pytest.approx((enter_n + enter_next) / 2, abs=1e-9)


def test_repeated_on_a_frozen_batch_it_balances_the_top_k() -> None:
    gen = torch.Generator().manual_seed(0)
    T, E, K = 512, 8, 2
    rank_TE = torch.randn(T, E, generator=gen, dtype=torch.float64) + torch.linspace(-2, 2, E)
    bias_E = torch.zeros(E, dtype=torch.float64)

    def load(b: torch.Tensor) -> torch.Tensor:
        ids_TK = (rank_TE + b).topk(K, dim=-1).indices
        return expert_counts(ids_TK, torch.ones_like(ids_TK, dtype=torch.bool), E)

    assert float(load_cv(load(bias_E))) > 1.0  # the popular experts take most slots
    for _ in range(30):
        bias_E = quantile_update(bias_E, quantile_bias(rank_TE, bias_E, K), 0.0)
    final = load(bias_E)
    assert float(load_cv(final)) < 0.02
    assert float((final - T * K / E).abs().max()) <= 2


def test_blend_and_centring_by_hand() -> None:
    bias_E = torch.tensor([1.0, -1.0, 0.0])
    target_E = torch.tensor([3.0, 0.0, 0.0])
    # 0.5 * [1, -1, 0] + 0.5 * [3, 0, 0] = [2, -0.5, 0], mean 0.5
    new_E = quantile_update(bias_E, target_E, 0.5)
    torch.testing.assert_close(new_E, torch.tensor([1.5, -1.0, -0.5]))
    torch.testing.assert_close(quantile_update(bias_E, target_E, 0.0), torch.tensor([2.0, -1, -1]))
    with pytest.raises(ValueError, match=r"ema must lie in \[0, 1\)"):
        quantile_update(bias_E, target_E, 1.0)


def test_nothing_to_balance_leaves_the_bias() -> None:
    bias_E = torch.tensor([0.5, -0.5, 0.25])
    # K = E: every token takes every expert; one token: no quantile between two
    assert torch.equal(quantile_bias(torch.randn(10, 3), bias_E, 3), bias_E)
    assert torch.equal(quantile_bias(torch.randn(1, 3), bias_E, 1), bias_E)
    with pytest.raises(ValueError, match="rank_TE must have shape"):
        quantile_bias(torch.randn(10, 4), bias_E, 1)


def test_global_mean_in_one_process_is_the_value() -> None:
    value_E = torch.tensor([1.0, 2.0])
    assert global_mean(value_E) is value_E


@pytest.mark.parametrize("rank_by", ["logits", "probs"])
def test_the_router_sets_its_bias_from_the_last_call(rank_by: str) -> None:
    torch.manual_seed(0)
    cfg = RouterConfig(
        d_model=8, n_experts=6, top_k=2, map="sigmoid", bias_update="quantile", rank_by=rank_by
    )
    router = Router(cfg)
    with torch.no_grad():
        router.weight.mul_(50)  # a router that prefers some experts for every token
    x_TD = torch.randn(60, 8) + 1.0
    out = router(x_TD)
    rank_TE = out.probs_TE if rank_by == "probs" else out.logits_TE
    expected_E = quantile_bias(rank_TE, torch.zeros(6), 2)
    router.step(out)
    torch.testing.assert_close(router.bias, expected_E - expected_E.mean())
    # the same tokens again: each expert near its 60 * 2 / 6 = 20 slots
    before = expert_counts(out.ids_TK, out.chosen_TK, 6)
    after_out = router(x_TD)
    after = expert_counts(after_out.ids_TK, after_out.chosen_TK, 6)
    assert float(load_cv(before)) > 0.5 and float(load_cv(after)) < 0.5 * float(load_cv(before))


def test_ema_keeps_part_of_the_old_bias() -> None:
    torch.manual_seed(0)
    x_TD = torch.randn(40, 8)
    routers = [
        Router(RouterConfig(d_model=8, n_experts=6, bias_update="quantile", bias_ema=ema))
        for ema in (0.0, 0.75)
    ]
    routers[1].load_state_dict(routers[0].state_dict())
    for r in routers:
        r.step(r(x_TD))
    torch.testing.assert_close(routers[1].bias, 0.25 * routers[0].bias)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"bias_update": "quantiles"}, "bias_update must be one of"),
        ({"bias_update": "quantile", "bias_rate": 0.01}, "set bias_rate=0"),
        ({"bias_update": "quantile", "bias_ema": 1.0}, r"bias_ema .* must lie in \[0, 1\)"),
        ({"bias_update": "quantile", "bias_ema": math.nan}, r"must lie in \[0, 1\)"),
        ({"bias_ema": 0.5}, "bias_ema blends quantile balancing's bias"),
        ({"bias_update": "quantile", "selection": "threshold"}, "use selection='topk'"),
        ({"bias_update": "quantile", "selection": "expert_choice"}, "use selection='topk'"),
        ({"bias_update": "quantile", "selection": "sinkhorn"}, "use selection='topk'"),
        ({"bias_update": "quantile", "selection": "hash", "vocab_size": 50}, "topk"),
        ({"bias_update": "quantile", "n_groups": 2, "topk_groups": 1}, "set n_groups=None"),
        (
            {"bias_update": "quantile", "n_null_experts": 2, "null_target": 1.5},
            "set null_target=None",
        ),
    ],
)
def test_config_refuses_what_it_cannot_balance(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(d_model=8, n_experts=8, top_k=2, **keys)


def test_config_accepts_it_with_top_k_and_null_experts() -> None:
    cfg = RouterConfig(d_model=8, n_experts=8, bias_update="quantile", n_null_experts=2)
    assert cfg.balancing_config.moves_bias and cfg.bias_rate == 0
    assert not RouterConfig(d_model=8, n_experts=8).balancing_config.moves_bias


def _train_load_cv(router: dict, steps: int = 12) -> float:
    """Mean load CV (over MoE layers and the last ``steps - 2`` steps) of a 2-layer model
    (E = 8, K = 2, no Switch loss) trained on uniform random tokens."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=64,
        max_seq_len=32, n_experts=8, moe_layers="all",
        router=dict(top_k=2, aux_weight=0.0, **router),
    )  # fmt: skip
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    cvs = []
    for step in range(steps):
        idx_BS = torch.randint(0, 64, (8, 33), generator=gen)
        out = model(idx_BS[:, :-1], idx_BS[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:
            for o in out.router_outputs:
                cvs.append(float(load_cv(expert_counts(o.ids_TK, o.chosen_TK, 8))))
        step_routers([layer.router for layer in model.moe_layers], out.router_outputs)
    return sum(cvs) / len(cvs)


def test_a_tiny_model_trains_with_a_lower_load_cv_than_without_balancing() -> None:
    none = _train_load_cv({})
    quantile = _train_load_cv({"bias_update": "quantile"})
    assert math.isfinite(quantile) and quantile < 0.8 * none, (quantile, none)


def _rank_worker(rank: int, world: int, port: int, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from tests.train import rank_env

    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same router on every rank
        router = Router(RouterConfig(d_model=8, n_experts=6, bias_update="quantile"))
        x_TD = torch.randn(30, 8, generator=torch.Generator().manual_seed(10 + rank)) + rank
        out_ = router(x_TD)
        local_E = quantile_bias(out_.logits_TE, router.bias, 2)
        router.step(out_)
        Path(out).with_name(f"rank{rank}.json").write_text(
            json.dumps({"local": local_E.tolist(), "bias": router.bias.tolist()})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_under_two_ranks_the_bias_is_the_ranks_mean(tmp_path) -> None:
    import json

    from tests.train import free_port, spawn_ranks

    spawn_ranks(_rank_worker, (2, free_port(), str(tmp_path / "x")))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    local_2E = torch.tensor([g["local"] for g in got], dtype=torch.float64)
    assert not torch.allclose(local_2E[0], local_2E[1])  # each rank solved its own tokens
    mean_E = local_2E.mean(0)
    expected_E = (mean_E - mean_E.mean()).float()
    for g in got:  # every rank holds the same bias: the mean of the ranks' solves
        torch.testing.assert_close(torch.tensor(g["bias"]), expected_E)
