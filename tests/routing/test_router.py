"""The router: every map with every gate, K at inference, truncation, exploration,
rejected configurations, float32 under autocast."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moelab.routing import Router, RouterConfig

MAP_ARGS = {
    "softmax": {},
    "sigmoid": {},
    "relu": {},
    "sqrtsoftplus": {},
    "sparsemax": {},
    "entmax": {"alpha": 1.5},
    "normmax": {"alpha": 2.0},
    "lapsum": {"lapsum_k": 2.0},
}
GATES = {
    "map": {},
    "renorm": {"renorm": True},
    "straight_through": {"straight_through": True},
}


def make(seed: int = 0, **kw) -> Router:
    torch.manual_seed(seed)
    kw.setdefault("d_model", 16)
    kw.setdefault("n_experts", 8)
    kw.setdefault("init_std", 0.5)  # spread-out scores: sparse maps keep >1 expert often
    return Router(RouterConfig(**kw))


def tokens(t: int = 64, d: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "gate"), list(itertools.product(MAP_ARGS, GATES)))
def test_every_map_and_gate_gives_router_gradient(name: str, gate: str) -> None:
    router = make(map=name, top_k=2, **MAP_ARGS[name], **GATES[gate])
    out = router(tokens())
    assert out.ids_TK.shape == (64, 2) and out.weights_TK.shape == (64, 2)
    assert out.probs_TE.shape == (64, 8) and out.probs_TE.dtype == torch.float32
    # a loss that depends on the gate weights only through the selected slots
    target = torch.randn(64, 2, generator=torch.Generator().manual_seed(3))
    (out.weights_TK * target).sum().backward()
    assert router.weight.grad is not None
    assert router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(MAP_ARGS))
def test_weights_are_the_map_values_at_the_selection(name: str) -> None:
    router = make(map=name, top_k=3, **MAP_ARGS[name])
    out = router(tokens())
    torch.testing.assert_close(out.weights_TK, out.probs_TE.gather(-1, out.ids_TK))
    # top-k by logits: the selected experts are the k largest scores
    expected = out.logits_TE.topk(3, dim=-1).indices
    assert torch.equal(out.ids_TK, expected)


def test_renorm_and_straight_through_values() -> None:
    out = make(map="softmax", top_k=2, renorm=True)(tokens())
    torch.testing.assert_close(out.weights_TK.sum(-1), torch.ones(64))
    p = out.probs_TE.gather(-1, out.ids_TK)
    torch.testing.assert_close(out.weights_TK, p / p.sum(-1, keepdim=True))
    out = make(map="sparsemax", top_k=4, straight_through=True)(tokens())
    p = out.probs_TE.gather(-1, out.ids_TK)
    assert torch.equal(out.weights_TK, (p > 0).float())  # 1 forward, fillers stay 0


def test_straight_through_gradient_is_that_of_log_p() -> None:
    router = make(map="softmax", top_k=2, straight_through=True)
    x = tokens()
    out = router(x)
    g = torch.randn(64, 2)
    (out.weights_TK * g).sum().backward()
    st_grad = router.weight.grad.clone()
    router.weight.grad = None
    out = router(x)
    (torch.log(out.probs_TE.gather(-1, out.ids_TK)) * g).sum().backward()
    torch.testing.assert_close(st_grad, router.weight.grad)


def test_fillers_stay_selected() -> None:
    # sparsemax with well separated scores: top-4 holds zero-weight selections
    out = make(map="sparsemax", top_k=4, init_std=3.0)(tokens())
    assert out.selected_TK.all()
    assert out.fillers_TK.any()
    assert not (out.computed_TK & out.fillers_TK).any()


def test_top_k_changes_at_inference_without_touching_weights() -> None:
    router = make(map="entmax", alpha=1.5, top_k=2).eval()
    x = tokens()
    before = {k: v.clone() for k, v in router.state_dict().items() if torch.is_tensor(v)}
    out2 = router(x)
    out8 = router(x, top_k=8)
    router.top_k = 4
    out4 = router(x)
    assert out2.ids_TK.shape[1] == 2 and out4.ids_TK.shape[1] == 4 and out8.ids_TK.shape[1] == 8
    assert torch.equal(out4.ids_TK[:, :2], out2.ids_TK)  # a superset, in rank order
    assert torch.equal(out8.ids_TK.sort(-1).values, torch.arange(8).expand(64, 8))
    torch.testing.assert_close(out2.probs_TE, out8.probs_TE)  # the map is unchanged
    for k, v in before.items():
        assert torch.equal(router.state_dict()[k], v)
    with pytest.raises(ValueError, match="top_k must lie"):
        router(x, top_k=9)


def test_threshold_truncation_and_cap() -> None:
    router = make(map="lapsum", lapsum_k=2.0, selection="threshold", threshold=0.3)
    out = router(tokens())
    assert out.ids_TK.shape[1] == 8  # no cap: up to every expert
    count = (out.probs_TE > 0.3).sum(-1)
    assert torch.equal(out.selected_TK.sum(-1), count)
    assert count.min() < count.max()  # token-dependent number of experts
    capped = make(map="lapsum", lapsum_k=2.0, selection="threshold", threshold=0.3, cap_factor=1.5)(
        tokens()
    )
    assert capped.ids_TK.shape[1] == 3  # ceil(2 * 1.5)
    assert torch.equal(capped.selected_TK.sum(-1), count.clamp(max=3))
    torch.testing.assert_close(
        capped.weights_TK,
        torch.where(capped.selected_TK, capped.probs_TE.gather(-1, capped.ids_TK), 0),
    )


def test_exploration_only_in_training() -> None:
    x = tokens()
    for kw in ({"noise_std": 1.0}, {"sample_extra": 3}):
        router = make(map="softmax", top_k=2, **kw)
        plain = router.eval()(x).ids_TK
        router.train()
        ids = router(x, generator=torch.Generator().manual_seed(5)).ids_TK
        assert not torch.equal(ids, plain)  # exploration changed some choices
        assert torch.equal(router.eval()(x).ids_TK, plain)  # and none at inference
    # sampling stays inside the top K + c
    router = make(map="softmax", top_k=2, sample_extra=1).train()
    ids = router(x, generator=torch.Generator().manual_seed(6)).ids_TK
    top3 = router.eval()(x).logits_TE.topk(3).indices
    assert (ids[..., None] == top3[:, None, :]).any(-1).all()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"renorm": True, "top_k": 1}, "no gradient"),
        ({"top_k": 9}, "top_k must lie"),
        ({"map": "entmax", "alpha": 1.0}, "alpha must be > 1"),
        ({"map": "normmax", "alpha": 0.5}, "alpha must be > 1"),
        ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
        ({"map": "lapsum"}, "needs lapsum_k"),
        ({"map": "lapsum", "lapsum_k": 8.0}, "lapsum_k must lie"),
        ({"sample_extra": -1}, "sample_extra"),
        ({"top_k": 6, "sample_extra": 3}, "exceeds n_experts"),
        ({"map": "softmax", "alpha": 1.5}, "alpha only applies"),
        ({"map": "sparsmax"}, "unknown map"),
        ({"renorm": True, "straight_through": True}, "not both"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"selection": "top-k"}, "selection must be one of"),
    ],
)
def test_rejected_configurations(kw: dict, match: str) -> None:
    base = {"d_model": 16, "n_experts": 8, "top_k": 2}
    with pytest.raises(ValueError, match=match):
        RouterConfig(**{**base, **kw})


def test_router_is_float32_under_bf16_autocast() -> None:
    router = make(map="sparsemax", top_k=2)
    x = tokens().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.scores_TE.dtype == torch.float32 and out.weights_TK.dtype == torch.float32
    torch.testing.assert_close(out.scores_TE, x.float() @ router.weight.t())


def test_straight_through_trains_on_a_small_problem() -> None:
    # Four fixed experts; the best expert for x is argmax(A x). A top-1 router
    # with the straight-through gate must learn that assignment from the loss
    # of the expert it picks, with no other signal. Picking i ~ p (sample 1 of
    # the top 1 + 3) makes the straight-through gradient the gate essay's
    # estimator E_{i~p}[grad log p_i <grad l, e_i>].
    d, e = 8, 4
    g = torch.Generator().manual_seed(10)
    a = torch.randn(e, d, generator=g)
    experts = torch.randn(e, d, d, generator=g) / d**0.5
    router = make(
        seed=1,
        d_model=d,
        n_experts=e,
        map="softmax",
        top_k=1,
        straight_through=True,
        sample_extra=3,
        init_std=0.01,
    )
    opt = torch.optim.Adam(router.parameters(), lr=0.05)

    def loss_fn(x: torch.Tensor, out) -> torch.Tensor:
        best = (a @ x.t()).argmax(0)
        target = torch.einsum("tij,tj->ti", experts[best], x)
        y = torch.einsum("tij,tj->ti", experts[out.ids_TK[:, 0]], x) * out.weights_TK
        return (y - target).square().mean()

    x_eval = torch.randn(2000, d, generator=g)
    router.eval()
    acc0 = (router(x_eval).ids_TK[:, 0] == (a @ x_eval.t()).argmax(0)).float().mean()
    router.train()
    for _ in range(300):
        x = torch.randn(256, d, generator=g)
        loss = loss_fn(x, router(x, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    router.eval()
    acc = (router(x_eval).ids_TK[:, 0] == (a @ x_eval.t()).argmax(0)).float().mean()
    assert acc > 0.9 and acc - acc0 > 0.3, (float(acc0), float(acc))


def test_state_dict_keeps_budget_threshold_and_schedule() -> None:
    router = make(map="lapsum", lapsum_k=2.0, selection="threshold", schedule="lipschitz")
    router.top_k = 3
    router.threshold = 0.25
    router.step()  # one power-iteration step moves the temperature
    fresh = make(seed=9, map="lapsum", lapsum_k=2.0, selection="threshold", schedule="lipschitz")
    fresh.load_state_dict(router.state_dict())
    assert fresh.top_k == 3 and fresh.threshold == 0.25
    assert fresh.temperature.value == router.temperature.value
    x = tokens()
    torch.testing.assert_close(fresh(x).weights_TK, router(x).weights_TK)


def test_calibrated_threshold_and_learned_k_drive_truncation() -> None:
    from moelab.routing.allocation import LayerAllocator, ThresholdCalibrator

    router = make(map="lapsum", lapsum_k=2.0, selection="threshold", cap_factor=2.0)
    calibrator = ThresholdCalibrator()
    for seed in range(4):
        calibrator.observe(router(tokens(256, seed=seed)).probs_TE)
    router.calibrate(calibrator, 2.0)
    active = router(tokens(2048, seed=99)).selected_TK.sum(-1).float().mean()
    assert abs(active - 2.0) < 0.25  # about k experts per token on fresh tokens
    # a learned per-layer k feeds LapSum and moves the cap with it
    allocator = LayerAllocator(n_layers=2, k_total=5.0, n_experts=8)
    with torch.no_grad():
        allocator.eta.copy_(torch.tensor([0.0, 1.0]))
    k_l = allocator()
    out = router(tokens(), lapsum_k=k_l[1])
    torch.testing.assert_close(out.probs_TE.sum(-1), k_l[1].detach().expand(64))
    assert out.ids_TK.shape[1] == min(8, math.ceil(k_l[1].item() * 2.0))
    out.weights_TK.sum().backward()
    assert allocator.eta.grad is not None and allocator.eta.grad.abs().sum() > 0


def test_capacity_drops_by_the_switch_rule_and_fillers_take_no_capacity() -> None:
    from moelab.routing.balancing import capacity_drop

    router = make(map="sparsemax", top_k=3, init_std=2.0, capacity_factor=0.5)
    out = router(tokens(128))
    assert out.fillers_TK.any() and out.dropped_TK.any()
    assert not (out.dropped_TK & out.fillers_TK).any()
    live = out.selected_TK & (out.weights_TK != 0)
    assert torch.equal(out.dropped_TK, capacity_drop(out.ids_TK, live, 8, 0.5))
    # each expert computes at most ceil(0.5 * T * K / E) slots
    computed = out.ids_TK[out.computed_TK]
    assert torch.bincount(computed, minlength=8).max() <= math.ceil(0.5 * 128 * 3 / 8)
