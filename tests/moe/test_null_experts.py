"""Null experts (AdaMoE; MoE++'s zero-computation and copy experts): the router scores
E + M experts, null slots take no dispatch, the layer against a loop over tokens and
slots, gradients, the balance loss over E + M, config refusals, statistics over the
real experts (hand-computed), parameter counts, a tiny training run, old runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab import cli
from moelab.diagnostics import RoutingStats
from moelab.model import ModelConfig, Transformer, load_preset, param_counts
from moelab.moe import MoE, MoEConfig
from moelab.routing import Router, RouterConfig


def _layer(kind: str, renorm: bool, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    rc = RouterConfig(
        d_model=6, n_experts=4, top_k=3, n_null_experts=2, null_expert=kind, renorm=renorm
    )
    moe = MoE(MoEConfig(6, 5, rc)).double()
    with torch.no_grad():  # scores of order 1, so that tokens differ in their null slots
        moe.router.weight.normal_()
    return moe


def _loop_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the E + M scores, top-K, the real experts weighted
    by p (renorm: over the real slots, AdaMoE; over every slot with identity experts),
    an identity null expert adds its weight times x, a zero one nothing."""
    cfg = moe.config.router
    E = cfg.n_experts
    rows = []
    for t in range(x_TD.shape[0]):
        x = x_TD[t]
        p = torch.softmax(moe.router.weight @ x, -1)
        top = sorted(range(E + cfg.n_null_experts), key=lambda e: -float(p[e].detach()))[
            : cfg.top_k
        ]
        outputs = [e for e in top if e < E or cfg.null_expert == "identity"]
        total = sum(p[e] for e in outputs) if cfg.renorm else 1.0
        y = torch.zeros_like(x)
        for e in outputs:
            out_e = moe.experts.forward_expert(e, x[None])[0] if e < E else x
            y = y + p[e] / total * out_e
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["zero", "identity"])
@pytest.mark.parametrize("renorm", [False, True])
def test_layer_matches_a_loop_over_tokens_and_slots(kind: str, renorm: bool) -> None:
    moe = _layer(kind, renorm)
    x_TD = torch.randn(16, 6, dtype=torch.float64)
    y, out = moe(x_TD)
    # NOTE: the router computes in float32 whatever the input dtype
    torch.testing.assert_close(y, _loop_reference(moe, x_TD), rtol=1e-5, atol=1e-6)
    n_real = (out.ids_TK < 4).sum(-1)
    assert set(n_real.tolist()) > {3}  # some tokens reach fewer than K real experts
    assert out.null_TK is not None and torch.equal(out.null_TK, out.ids_TK >= 4)
    assert torch.equal(out.selected_TK, out.ids_TK < 4)
    assert torch.equal(out.computed_TK, out.ids_TK < 4)
    assert (out.n_experts, out.n_null, out.probs_TE.shape[-1]) == (4, 2, 6)
    assert bool(out.chosen_TK.all())
    null_w = out.weights_TK[out.null_TK]
    assert bool((null_w > 0).all()) if kind == "identity" else bool((null_w == 0).all())


def test_null_slots_take_no_dispatch() -> None:
    moe = _layer("identity", False)
    rows: list[int] = []
    forward = moe.experts.forward

    def counting(x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
        rows.append(x_ND.shape[0])
        assert len(counts_E) == 4  # the real experts only
        return forward(x_ND, counts_E)

    moe.experts.forward = counting  # type: ignore[method-assign]
    _, out = moe(torch.randn(16, 6, dtype=torch.float64))
    assert rows == [int((out.ids_TK < 4).sum())] and rows[0] < 16 * 3


@pytest.mark.parametrize("kind", ["zero", "identity"])
@pytest.mark.parametrize("renorm", [False, True])
def test_gradients_match_the_loop_reference(kind: str, renorm: bool) -> None:
    moe = _layer(kind, renorm, seed=1)
    x_TD = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(9, 6, dtype=torch.float64)
    params = [x_TD, moe.router.weight, *moe.experts.parameters()]
    y, _ = moe(x_TD)
    got = torch.autograd.grad((y * target).sum(), params)
    want = torch.autograd.grad((_loop_reference(moe, x_TD) * target).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    null_rows = float(got[1][4:].abs().sum())
    if kind == "zero" and renorm:
        # p_e / (sum of the selected real p) does not depend on the null scores: the
        # null experts' router rows learn from the balance loss alone (AdaMoE)
        assert null_rows < 1e-9
    else:  # the null scores enter the weights (softmax's denominator, or as experts)
        assert null_rows > 1e-6


def test_the_balance_loss_counts_the_null_experts() -> None:
    torch.manual_seed(2)
    rc = RouterConfig(d_model=6, n_experts=4, top_k=2, n_null_experts=2, aux_weight=0.1)
    router = Router(rc)
    with torch.no_grad():
        router.weight.normal_()
    x_TD = torch.randn(32, 6)
    out = router(x_TD)
    assert tuple(router.weight.shape) == (6, 6) and tuple(router.bias.shape) == (6,)
    assert out.null_TK is not None and bool(out.null_TK.any())
    # AdaMoE: f over the E + M experts (null slots included), P from the same softmax
    f = torch.zeros(6)
    for e in out.ids_TK.flatten().tolist():
        f[e] += 1 / (32 * 2)
    expected = 6 * (f * out.probs_TE.mean(0)).sum()
    torch.testing.assert_close(out.losses["switch"], expected)
    # bias balancing moves the null experts too, from the load over E + M
    biased = Router(RouterConfig(d_model=6, n_experts=4, top_k=2, n_null_experts=2, bias_rate=1.0))
    with torch.no_grad():
        biased.weight.copy_(router.weight)
    biased.step(biased(x_TD))
    load = torch.bincount(out.ids_TK.flatten(), minlength=6).float()
    torch.testing.assert_close(biased.bias, torch.sign(load.mean() - load))


def test_config_defaults_and_refusals() -> None:
    old = RouterConfig(d_model=4, n_experts=8, top_k=2)  # a config without the new keys
    assert (old.n_null_experts, old.null_expert, old.n_scored) == (0, "zero", 8)
    assert (
        tuple(Router(old).weight.shape) == (8, 4) and Router(old)(torch.randn(3, 4)).null_TK is None
    )
    null = RouterConfig(d_model=4, n_experts=8, top_k=2, n_null_experts=2)
    assert (null.n_scored, null.slots, null.expected_experts) == (10, 2, 2 * 8 / 10)

    def make(**kw):
        return RouterConfig(d_model=4, n_experts=8, top_k=2, **kw)

    with pytest.raises(ValueError, match="n_null_experts must be >= 0"):
        make(n_null_experts=-1)
    with pytest.raises(ValueError, match="null_expert must be one of"):
        make(n_null_experts=1, null_expert="bogus")
    with pytest.raises(ValueError, match="set n_null_experts >= 1"):
        make(null_expert="identity")
    for rule in ("expert_choice", "threshold", "top_p"):
        with pytest.raises(ValueError, match="selection='topk' with n_null_experts"):
            make(n_null_experts=2, selection=rule)
    with pytest.raises(ValueError, match="n_groups=None"):
        make(n_null_experts=2, n_groups=2, topk_groups=1)
    with pytest.raises(ValueError, match="l1_target=None"):
        make(n_null_experts=2, map="relu", l1_target=2.0)


def test_stats_fixture_counts_real_experts_only() -> None:
    # scorer = identity: the logits are log(p), so the softmax gives p exactly.
    # E = 2 real experts, M = 1 null (id 2), K = 2:
    #   t0: p = (.5, .3, .2) -> {0, 1}: 2 real, mass kept .8
    #   t1: p = (.3, .2, .5) -> {2, 0}: 1 real + null, kept .3
    #   t2: p = (.5, .1, .4) -> {0, 2}: 1 real + null, kept .5
    rc = RouterConfig(d_model=3, n_experts=2, top_k=2, n_null_experts=1)
    router = Router(rc).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    p = torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.2, 0.5], [0.5, 0.1, 0.4]])
    out = router(p.log())
    torch.testing.assert_close(out.probs_TE, p)
    res = RoutingStats("softmax").update(out).result()
    # the mass on the null expert reaches no expert: discarded, selected or not
    assert res["discarded_mass"] == pytest.approx((0.2 + 0.7 + 0.5) / 3)
    assert res["null_fraction"] == pytest.approx(2 / 6)
    assert res["contributors"] == pytest.approx(4 / 3)
    assert res["active_experts"] == pytest.approx(4 / 3)
    # real loads (3, 1): mean 2, std 1 (over E + M columns (3, 1, 2) it would be 0.41)
    assert res["load_cv"] == pytest.approx(0.5)
    assert res["nominal_cv"] == pytest.approx(0.5)
    assert res["load_shares"] == pytest.approx([0.75, 0.25])
    assert res["dead_experts"] == 0
    assert res["unrouted_fraction"] == 0.0
    assert res["dropped_fraction"] == 0.0
    # the training log's numbers count the real experts too
    from moelab.train.loop import routing_numbers

    logged = routing_numbers([out])
    assert logged["load_cv"] == pytest.approx(0.5)
    assert logged["active_experts"] == pytest.approx(4 / 3)
    # a router without null experts: null_fraction 0, the statistics unchanged
    plain = Router(RouterConfig(d_model=3, n_experts=3, top_k=2)).eval()
    with torch.no_grad():
        plain.weight.copy_(torch.eye(3))
    res_plain = RoutingStats("softmax").update(plain(p.log())).result()
    assert res_plain["null_fraction"] == 0.0
    assert res_plain["discarded_mass"] == pytest.approx((0.2 + 0.2 + 0.1) / 3)


def test_params_count_the_expected_real_experts(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny: D = 128, expert width 256, 2 MoE layers, E = 8, K = 2; M = 2
    base = param_counts(load_preset("tiny"))
    expert = 3 * 128 * 256
    command = ["params", "--preset", "tiny", "--set", "router.n_null_experts=2", "--json"]
    assert cli.main(command) == 0
    out = json.loads(capsys.readouterr().out)
    router = 2 * 10 * 128  # E + M rows per layer
    assert out["router"] == router == base["router"] + 2 * 2 * 128
    non_expert = base["active"] - 2 * 2 * expert + 2 * 2 * 128
    assert out["total"] == base["total"] + 2 * 2 * 128 == 2_494_080
    # K * E / (E + M) = 1.6 real experts per layer under balanced load
    assert out["active"] == non_expert + round(2 * 1.6 * expert) == 1_235_789
    assert out["active_at_cap"] == non_expert + 2 * 2 * expert == 1_314_432  # K at most
    assert (out["k"], out["cap"]) == (pytest.approx(1.6), 2)
    small = ModelConfig(
        n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=50,
        max_seq_len=8, n_experts=4, router={"n_null_experts": 3},
    )  # fmt: skip
    assert param_counts(small)["total"] == sum(p.numel() for p in Transformer(small).parameters())


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_a_tiny_model_learns_with_null_experts(tmp_path: Path) -> None:
    from moelab.diagnostics import stats
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "router": {"n_null_experts": 2}}
    train_learns(corpus, run, model=model)
    st = stats(run, max_batches=1)
    for layer in st["layers"]:
        assert 0.0 < layer["null_fraction"] < 1.0
        # K = 2 slots, a share null_fraction of them null: the real ones are the rest
        assert layer["active_experts"] == pytest.approx(2 * (1 - layer["null_fraction"]))
        assert len(layer["load_shares"]) == 4  # the E = 4 real experts


def test_a_run_without_the_new_keys_still_loads(tmp_path: Path) -> None:
    from moelab.diagnostics import load_run, stats
    from moelab.train import train
    from tests.train import make_corpus, tiny_config

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=2))
    path = run / "config.json"
    config = json.loads(path.read_text())
    for key in ("n_shared_experts", "shared_gate"):
        del config["model"][key]
    for key in ("n_null_experts", "null_expert"):
        del config["model"]["router"][key]
    path.write_text(json.dumps(config))  # as a run written before these keys
    loaded = load_run(run)
    layer = loaded.model.moe_layers[0]
    assert layer.shared is None and layer.router.config.n_null_experts == 0
    st = stats(loaded, max_batches=1)
    assert all(lay["null_fraction"] == 0.0 for lay in st["layers"])
