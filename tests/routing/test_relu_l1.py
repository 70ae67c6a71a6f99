"""ReLU routing with adaptive L1 (ReMoE, Wang et al., ICLR 2025): the routing against a
per-token loop, the load-balanced L1 term against a loop over experts and tokens and its
float64 gradient, the controller of lambda on hand-computed sequences (one lambda for
all layers), the config's refusals, lambda through a checkpoint and a resumed run, the
statistics of its router outputs and a 50-step tiny training run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from moelab import maps
from moelab.diagnostics.accumulators import routing_stats
from moelab.model import load_preset, param_counts
from moelab.routing import Router, RouterConfig, relu_l1
from moelab.routing.router import step_routers
from moelab.train.loop import routing_numbers

E = 6


def _config(**kw) -> RouterConfig:
    # NOTE: no Switch loss (on by default): these tests check the L1 term alone
    base = dict(
        d_model=E, n_experts=E, map="relu", selection="threshold", l1_target=2, aux_weight=0.0
    )
    return RouterConfig(**{**base, **kw})


def _identity_router(**kw) -> Router:
    """A ReMoE router whose logits are its input (W = I, temperature 1)."""
    router = Router(_config(**kw))
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


def _scores(n_tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scores away from 0 (|s| >= 0.05), so that finite differences keep every sign."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n_tokens, E, generator=g, dtype=dtype)
    return torch.where(s.abs() < 0.05, s.sign() * 0.05 + (s == 0) * 0.05, s)


# ------------------------------------------------------------------------ the routing


def test_relu_threshold_routes_every_positive_expert_with_its_relu_gate() -> None:
    router = _identity_router()
    assert router.config.slots == E and router.config.token_cap_factor is None
    assert router.truncation == 0.0 and not router.selection.calibrates
    x = _scores(50, seed=0)
    x[3] = -1.0  # a token no expert takes
    out = router(x)
    out.weights_TK = out.weights_TK.detach()
    for t in range(50):  # the loop: R = relu(s), every positive expert, no renormalisation
        kept = {e: float(x[t, e]) for e in range(E) if x[t, e] > 0}
        got = {
            int(e): float(w)
            for e, w, s in zip(out.ids_TK[t], out.weights_TK[t], out.selected_TK[t], strict=True)
            if s
        }
        assert got == pytest.approx(kept), t
    assert out.selected_TK[3].sum() == 0
    torch.testing.assert_close(out.probs_TE, x.clamp_min(0))


def test_the_rule_answers_from_the_config() -> None:
    rc = _config(top_k=3, l1_target=2.5)
    assert rc.expected_experts == 2.5  # the L1 target, not top_k
    assert rc.slots == E
    # with a token cap the cap follows the target k: ceil(2.5 * 2) = 5
    assert _config(l1_target=2.5, token_cap_factor=2.0).slots == 5
    # without l1_target the threshold rule keeps its calibration and its nominal k
    plain = RouterConfig(d_model=E, n_experts=E, map="relu", selection="threshold", top_k=3)
    assert plain.expected_experts == 3.0 and Router(plain).selection.calibrates
    model = load_preset("tiny")
    remoe = dataclasses.replace(
        model, router={"map": "relu", "selection": "threshold", "l1_target": 1}
    )
    top2 = param_counts(model)
    counts = param_counts(remoe)
    n_moe = len(model.moe_indices)
    assert model.expert_d_ff is not None
    expert = 3 * model.d_model * model.expert_d_ff
    assert counts["active"] == top2["active"] - n_moe * expert  # 1 expert per layer, not 2
    assert counts["active_at_cap"] == counts["total"]  # every expert: no token cap


# ------------------------------------------------------------------------ the L1 term


def reference_l1(gates: list[list[float]], k: float) -> float:
    """sum_e f_e * mean_t R_te with f_e = E / (k T) * #{t : R_te > 0}, by loops."""
    n_tokens, n_experts = len(gates), len(gates[0])
    total = 0.0
    for e in range(n_experts):
        count = sum(1 for t in range(n_tokens) if gates[t][e] > 0)
        f = n_experts / (k * n_tokens) * count
        total += f * sum(gates[t][e] for t in range(n_tokens)) / n_tokens
    return total


@pytest.mark.parametrize("k", [1.0, 2.0, 4.5])
def test_l1_loss_matches_the_loop(k: float) -> None:
    router = _identity_router(l1_target=k, l1_init=0.25)
    x = _scores(64, seed=int(k * 10), dtype=torch.float64)
    out = router(x.float())
    gates = x.clamp_min(0).float().tolist()
    assert float(out.losses["l1"].detach()) == pytest.approx(reference_l1(gates, k), rel=1e-5)
    assert float(out.aux_loss.detach()) == pytest.approx(0.25 * reference_l1(gates, k), rel=1e-5)
    # the function on float64 inputs, the same reference
    ids = torch.arange(E).expand(64, E)
    value = relu_l1.l1_loss(x.clamp_min(0), ids, x > 0, k)
    assert value.dtype == torch.float64
    assert float(value) == pytest.approx(reference_l1(x.clamp_min(0).tolist(), k), rel=1e-12)


def test_even_load_gives_the_plain_mean_l1_norm() -> None:
    # E = 4, k = 2, T = 4: each expert active on exactly k T / E = 2 tokens, so f_e = 1
    gates = torch.tensor(
        [[1.0, 2.0, 0.0, 0.0], [0.0, 0.5, 3.0, 0.0], [0.0, 0.0, 1.0, 4.0], [2.0, 0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    ids = torch.arange(4).expand(4, 4)
    value = relu_l1.l1_loss(gates, ids, gates > 0, 2.0)
    assert float(value) == pytest.approx(float(gates.sum(-1).mean()))  # 14.5 / 4
    assert float(value) == pytest.approx(14.5 / 4)
    # a busy expert weighs more: expert 0 on all 4 tokens (f_0 = 2), 1 on none
    busy = torch.tensor([[1.0, 0, 0, 0]] * 4, dtype=torch.float64)
    assert float(relu_l1.l1_loss(busy, ids, busy > 0, 2.0)) == pytest.approx(2.0 * 1.0)


def test_l1_gradient_gradcheck() -> None:
    x = _scores(12, seed=5, dtype=torch.float64).requires_grad_(True)
    ids = torch.arange(E).expand(12, E)

    def fn(s: torch.Tensor) -> torch.Tensor:
        gates = maps.relu(s)
        return relu_l1.l1_loss(gates, ids, gates.detach() > 0, 2.0)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
    fn(x).backward()
    # by hand: dL/ds_te = f_e / T on positive scores (f detached), 0 elsewhere
    count = (x.detach() > 0).sum(0).double()
    f = E / (2.0 * 12) * count
    expected = torch.where(x.detach() > 0, f / 12, 0.0)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected.expand_as(x))


def test_router_l1_gradient_reaches_the_weight_as_in_the_loop() -> None:
    torch.manual_seed(0)
    router = Router(
        RouterConfig(
            d_model=5, n_experts=E, map="relu", selection="threshold", l1_target=2, init_std=0.5
        )
    )
    x = torch.randn(30, 5, generator=torch.Generator().manual_seed(1))
    out = router(x)
    out.losses["l1"].backward()
    w = router.weight.detach().double().requires_grad_(True)
    s = x.double() @ w.t()
    with torch.no_grad():
        f = E / (2.0 * 30) * (s > 0).sum(0).double()
    total = w.new_zeros(())
    for t in range(30):
        for e in range(E):
            if s[t, e] > 0:
                total = total + f[e] * s[t, e] / 30
    total.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(router.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- the controller


def _activity(active: int, total: int) -> torch.Tensor:
    return torch.tensor([float(active), float(total)], dtype=torch.float64)


def test_controller_follows_the_sign_of_target_minus_sparsity() -> None:
    # E = 6, k = 2: target sparsity 1 - 2/6 = 2/3; per step (active, all) of 60 gates
    router = Router(_config(l1_init=1e-8, l1_rate=1.2))
    steps = [(30, 0.5), (30, 0.5), (20, 2 / 3), (6, 0.9), (0, 1.0), (0, 1.0), (59, 1 / 60)]
    # too dense: up; on target (sign 0): kept; too sparse: down; nearly dense: up
    expected = [1.2e-8, 1.44e-8, 1.44e-8, 1.2e-8, 1e-8, 1e-8 / 1.2, 1e-8]
    for (active, sparsity), lam in zip(steps, expected, strict=True):
        router.step(activity=_activity(active, 60))
        assert float(router.l1_coef) == pytest.approx(lam, rel=1e-6)
        assert float(router.l1_sparsity) == pytest.approx(sparsity)


def test_one_lambda_moves_by_the_sparsity_of_all_layers() -> None:
    # layer A: 3 of 4 experts active (sparsity 1/4, too dense alone); layer B: none
    # (too sparse alone). Together 12 of 32 gates: sparsity 0.625 > target 0.5 -> down.
    cfg = RouterConfig(d_model=4, n_experts=4, map="relu", selection="threshold", l1_target=2)
    a, b = Router(cfg), Router(cfg)
    for r in (a, b):
        with torch.no_grad():
            r.weight.copy_(torch.eye(4))
    xa = torch.tensor([[1.0, 2.0, 3.0, -1.0]] * 4)
    xb = -torch.ones(4, 4)
    outs = [a(xa), b(xb)]
    activity = relu_l1.global_activity([a, b], outs)
    assert activity is not None and activity.tolist() == [12.0, 32.0]
    step_routers([a, b], outs)
    for r in (a, b):
        assert float(r.l1_coef) == pytest.approx(1e-8 / 1.2)
        assert float(r.l1_sparsity) == pytest.approx(0.625)
    # stepped alone, each layer would move its own way
    lone_a, lone_b = Router(cfg), Router(cfg)
    lone_a.step(outs[0])
    lone_b.step(outs[1])
    assert float(lone_a.l1_coef) > 1e-8 > float(lone_b.l1_coef)


def test_routers_without_l1_step_and_save_as_before() -> None:
    plain = Router(RouterConfig(d_model=4, n_experts=4))
    assert plain.l1_coef is None and "l1_coef" not in plain.state_dict()
    out = plain(torch.randn(3, 4))
    assert "l1" not in out.losses
    assert relu_l1.global_activity([plain], [out]) is None
    step_routers([plain], [out])  # no error, nothing to move


# --------------------------------------------------------------------- config refusals


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(map="softmax"), "sum to 1"),
        (dict(map="sparsemax"), "sum to 1"),
        (dict(map="entmax"), "sum to 1"),
        (dict(map="sigmoid"), "never exactly 0"),
        (dict(map="lapsum", lapsum_k=2.0), "budget k"),
        (dict(l1_target=0), r"l1_target must lie in \(0, n_experts=6\]"),
        (dict(l1_target=-1.0), r"l1_target must lie in \(0, n_experts=6\]"),
        (dict(l1_target=7), r"l1_target must lie in \(0, n_experts=6\]"),
        (dict(renorm=True), "renorm=False"),
        (dict(straight_through=True), "straight_through=False"),
        (dict(l1_rate=1.0), "l1_rate"),
        (dict(l1_rate=0.8), "l1_rate"),
        (dict(l1_init=0.0), "l1_init"),
        (dict(l1_init=math.inf), "l1_init"),
        (dict(token_cap_factor=0.5), "exceeds the 1 experts"),
        (dict(selection="topk", top_k=1), "exceeds the 1 experts"),
        (dict(selection="topk", top_k=2, n_null_experts=2), "n_null_experts=0"),
    ],
)
def test_settings_that_cannot_work_are_refused(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**bad)


def test_settings_that_work_are_accepted() -> None:
    assert _config(l1_target=E).expected_experts == E
    assert _config(selection="topk", top_k=2).slots == 2  # ReLU gates under a top-K cap
    assert relu_l1.l1_maps() == ("relu",)


# ------------------------------------------------------------------ checkpoint, resume


def test_lambda_is_in_the_state_dict() -> None:
    router = Router(_config())
    router.step(activity=_activity(60, 60))  # dense: up
    router.step(activity=_activity(60, 60))
    fresh = Router(_config())
    assert float(fresh.l1_coef) == pytest.approx(1e-8)
    fresh.load_state_dict(router.state_dict())
    assert float(fresh.l1_coef) == pytest.approx(1.44e-8, rel=1e-6)
    assert "l1_sparsity" not in router.state_dict()  # a measurement, not state


def _train_config(corpus: Path, run: Path, steps: int, **router):
    from tests.train import TINY_MODEL, tiny_config

    model = dict(
        TINY_MODEL,
        router={
            "map": "relu",
            "selection": "threshold",
            "l1_target": 2,
            "aux_weight": 0.0,  # the L1 controller alone, as ReMoE balances through it
            **router,
        },
    )
    return tiny_config(corpus, run, steps=steps, model=model, lr=3e-3, min_lr=1e-4)


def _rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_lambda_survives_a_resumed_run(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from moelab.train import latest_checkpoint, train
    from tests.train import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_docs=8)
    straight = tmp_path / "straight"
    train(_train_config(corpus, straight, 6, l1_init=1e-4))
    resumed = tmp_path / "resumed"
    train(_train_config(corpus, resumed, 6, l1_init=1e-4), stop_after=3)
    train(_train_config(corpus, resumed, 6, l1_init=1e-4), resume=True)
    one, two = _rows(straight), _rows(resumed)
    assert [r["step"] for r in two] == list(range(1, 7))
    assert len({r["l1_coef"] for r in one}) > 1  # lambda moved
    for a, b in zip(one, two, strict=True):
        assert b["l1_coef"] == pytest.approx(a["l1_coef"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    for run in (straight, resumed):
        ckpt = latest_checkpoint(run)
        assert ckpt is not None
        saved = {k: v for k, v in load_file(ckpt / "model.safetensors").items() if "l1_coef" in k}
        assert saved and all(float(v) == pytest.approx(one[-1]["l1_coef"]) for v in saved.values())


# ------------------------------------------------------------------------- statistics


FIXTURE = torch.tensor(
    [[1.0, -1.0, 2.0, -3.0, -1.0, -1.0], [-1.0, -1.0, -1.0, 0.5, -2.0, -1.0], [1.0] * 6]
)
"""Scores of 3 tokens with 2, 1 and 6 positive gates."""


def test_stats_count_the_positive_gates() -> None:
    out = _identity_router()(FIXTURE)
    assert out.selected_TK.sum(-1).tolist() == [2, 1, 6]
    res = routing_stats([out], "relu")["layers"][0]
    assert res["active_experts"] == pytest.approx(3.0)
    assert res["contributors"] == pytest.approx(3.0)
    assert routing_numbers([out])["active_experts"] == pytest.approx(3.0)
    activity = relu_l1.global_activity([_identity_router()], [out])
    assert activity is not None and activity.tolist() == [9.0, 18.0]


# -------------------------------------------------------------------------- training


def test_a_tiny_model_trains_with_relu_routing(tmp_path: Path) -> None:
    """50 steps at E = 4, l1_target = 2 (target sparsity 0.5), lambda_0 = 1e-4 (the
    paper's 1e-8 needs ~75 steps at gamma = 1.2 to reach a lambda that bites). Observed
    on this seed: the routers go dense first (about 3.9 active experts, lambda rising),
    then lambda pulls them back to 1.5-2 experts per token."""
    from moelab.diagnostics import stats
    from moelab.train import train
    from tests.train import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    summary = train(_train_config(corpus, run, 50, l1_init=1e-4))
    assert math.isfinite(summary["train_loss"])
    rows = _rows(run)
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    # the controller's rule on the logged numbers: lambda_i / lambda_{i-1} = 1.2^sign
    for prev, row in itertools.pairwise(rows):
        sign = (row["l1_sparsity"] < 0.5) - (row["l1_sparsity"] > 0.5)
        assert row["l1_coef"] == pytest.approx(prev["l1_coef"] * 1.2**sign, rel=1e-5)
    active = [r["active_experts"] for r in rows]
    assert max(active) > 3.0  # the dense stage, lambda rising
    late = sum(active[-10:]) / 10
    assert 1.0 <= late <= 3.0, active  # pulled back toward the target 2
    assert abs(late - 2.0) < abs(max(active) - 2.0)
    st = stats(run, max_batches=1)
    for layer in st["layers"]:
        assert 0.0 <= layer["active_experts"] <= 4.0
    assert summary["l1_coef"] == pytest.approx(rows[-1]["l1_coef"])
