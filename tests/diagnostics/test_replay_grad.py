"""Gradients under routing replay (moelab.diagnostics.replay), in float64.

A replayed step has the gradient of a normal step when the recorded experts are the live
ones (bare MoE layer and Transformer, every map kind: softmax, sparsemax, entmax 1.5 and
another alpha, LapSum), and that gradient is the finite-difference one (gradcheck). The
gate weights under replay are the map's values at the *replayed* experts from the *live*
scores, checked against a float64 reference written here; the zeroed-gather mistake
(weights gathered from a row that top-k already masked) gives another gradient, and the
checks moelab passes fail on it. A replayed expert outside a sparse map's support: weight
0, a selected slot that is not computed, no gradient through it."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from moelab.diagnostics import RoutingRecord, record, replay
from moelab.model import ModelConfig, Transformer
from moelab.moe import MoE, MoEConfig
from moelab.routing import RouterConfig
from moelab.routing.router import Router


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


SHARP = {"temperature": 0.2}  # sharper logits: the sparse maps leave experts out
MAPS: dict[str, dict] = {
    "softmax": {"map": "softmax"},
    "sparsemax": {"map": "sparsemax", **SHARP},
    "entmax15": {"map": "entmax", "alpha": 1.5, **SHARP},
    "entmax13": {"map": "entmax", "alpha": 1.3, **SHARP},  # the bisection solver
    "lapsum": {"map": "lapsum", "lapsum_k": 2.0},
}
TOL = 1e-12


def _moe(keys: dict, gate: str = "map", seed: int = 0) -> MoE:
    """A float64 MoE layer: 6 experts, top-2, width 8, an auxiliary loss on; router
    weights of std 0.5 (so that the routing is not a near-tie)."""
    torch.manual_seed(seed)
    rc = RouterConfig(d_model=8, n_experts=6, top_k=2, gate=gate, aux_weight=0.01, **keys)
    moe = MoE(MoEConfig(d_model=8, d_ff=16, router=rc)).double().train()
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.5)
    return moe


def _grads(module: torch.nn.Module, *extra: torch.Tensor) -> list[torch.Tensor]:
    found = [p.grad for p in module.parameters() if p.grad is not None]
    return [g.clone() for g in [*found, *(t.grad for t in extra)] if g is not None]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("gate", ["map", "renorm"])
@pytest.mark.parametrize("name", list(MAPS))
def test_moe_layer_replay_has_the_normal_gradient(name: str, gate: str) -> None:
    moe = _moe(MAPS[name], gate)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    coef = torch.randn(6, 8, dtype=torch.float64)

    def step() -> list[torch.Tensor]:
        moe.zero_grad()
        x.grad = None
        y, out = moe(x)
        ((y * coef).sum() + out.aux_loss).backward()
        return _grads(moe, x)

    with record(moe) as rec:
        normal = step()
    assert len(normal) == 1 + len(list(moe.parameters()))  # x and every parameter
    assert bool(moe.router.weight.grad.abs().sum() > 0)
    with replay(moe, rec):
        replayed = step()
    assert _max_diff(normal, replayed) <= TOL

    # the replayed step's gradient is the finite-difference one: gradcheck in float64
    weight = moe.router.weight.detach().clone()

    def replayed_layer(x_TD: torch.Tensor, w_ED: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rec.rewind()  # every evaluation replays the same rows
        y, out = functional_call(moe, {"router.weight": w_ED}, (x_TD,))
        return y, out.weights_TK, out.aux_loss

    with replay(moe, rec):
        assert torch.autograd.gradcheck(
            replayed_layer,
            (x.detach().clone().requires_grad_(), weight.requires_grad_()),
            fast_mode=True,
        )


@pytest.mark.parametrize("name", list(MAPS))
def test_transformer_replay_has_the_normal_gradient(name: str) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=100,
        max_seq_len=16, n_experts=4, router={"top_k": 2, "aux_weight": 0.01, **MAPS[name]},
    )  # fmt: skip
    model = Transformer(config).double().train()
    with torch.no_grad():
        for layer in model.moe_layers:
            layer.router.weight.normal_(0.0, 0.3)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def step() -> list[torch.Tensor]:
        model.zero_grad()
        out = model(x)
        logp = torch.log_softmax(out.logits_BSV.double(), dim=-1)
        nll = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean()
        assert out.aux_loss is not None
        (nll + out.aux_loss).backward()
        return _grads(model)

    with record(model) as rec:
        normal = step()
    with replay(model, rec):
        replayed = step()
    assert all(bool(layer.router.weight.grad.abs().sum() > 0) for layer in model.moe_layers)
    assert _max_diff(normal, replayed) <= TOL


# ------------------------------------------------------------------ the zeroed gather


def _softmax_row_reference(
    w_ED: torch.Tensor, x_TD: torch.Tensor, ids_TK: torch.Tensor, renorm: bool
) -> torch.Tensor:
    """The gate replay should give: softmax over all E of the live scores x W^T, gathered
    at the replayed experts, renormalised over them (float64, written out)."""
    z_TE = x_TD @ w_ED.t()
    p_TE = torch.exp(z_TE - z_TE.amax(-1, keepdim=True))
    p_TE = p_TE / p_TE.sum(-1, keepdim=True)
    p_TK = p_TE.gather(-1, ids_TK)
    return p_TK / p_TK.sum(-1, keepdim=True) if renorm else p_TK


def _zeroed_gather(
    w_ED: torch.Tensor, x_TD: torch.Tensor, ids_TK: torch.Tensor, renorm: bool
) -> torch.Tensor:
    """The mistake: the probabilities of the live top-k kept in a dense row (the others
    set to 0, the row renormalised), and the replayed experts' weights gathered from it."""
    p_TE = torch.softmax(x_TD @ w_ED.t(), dim=-1)
    top_TK, live_TK = p_TE.topk(ids_TK.shape[1], dim=-1)
    masked_TE = torch.zeros_like(p_TE).scatter(-1, live_TK, top_TK)
    if renorm:
        masked_TE = masked_TE / masked_TE.sum(-1, keepdim=True)
    return masked_TE.gather(-1, ids_TK)


def _replayed_router(keys: dict, ids_TK: torch.Tensor, x_TD: torch.Tensor):
    """(router, record, gate(w_ED)): a float64 Router replaying ``ids_TK`` on ``x_TD``,
    and its gate weights as a function of its weight."""
    torch.manual_seed(1)
    router = Router(RouterConfig(d_model=x_TD.shape[1], n_experts=6, top_k=2, **keys)).double()
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
    rec = RoutingRecord([ids_TK], [torch.ones_like(ids_TK, dtype=torch.bool)], 6)

    def gate(w_ED: torch.Tensor) -> torch.Tensor:
        rec.rewind()
        return functional_call(router, {"weight": w_ED}, (x_TD,)).weights_TK

    return router, rec, gate


def _jacobian(fn, w_ED: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.jacobian(fn, w_ED)


def _against_reference(fn, w_ED: torch.Tensor, reference) -> float:
    """The largest difference between ``fn``'s values and Jacobian in the weight and the
    reference's: 0 (to rounding) for a replay that keeps the gradient."""
    values = float((fn(w_ED) - reference(w_ED)).abs().max())
    return max(values, float((_jacobian(fn, w_ED) - _jacobian(reference, w_ED)).abs().max()))


@pytest.mark.parametrize("renorm", [True, False])
def test_zeroed_gather_gives_the_wrong_gradient_and_moelab_does_not(renorm: bool) -> None:
    x_TD = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    keys = {"map": "softmax", "gate": "renorm" if renorm else "map"}
    router, rec, _ = _replayed_router(keys, torch.zeros(5, 2, dtype=torch.long), x_TD)
    with torch.no_grad():
        live_TK = router(x_TD).ids_TK
    # the replayed experts: each token's live first choice, and an expert it did not choose
    outside_TK = torch.tensor(
        [next(e for e in range(6) if e not in row) for row in live_TK.tolist()]
    )
    ids_TK = torch.stack([live_TK[:, 0], outside_TK], dim=1)
    router, rec, gate = _replayed_router(keys, ids_TK, x_TD)
    w_ED = router.weight.detach().clone()

    def reference(w: torch.Tensor) -> torch.Tensor:
        return _softmax_row_reference(w, x_TD, ids_TK, renorm)

    def mistake(w: torch.Tensor) -> torch.Tensor:
        return _zeroed_gather(w, x_TD, ids_TK, renorm)

    # the reference is the finite-difference gradient of the replayed gate
    assert torch.autograd.gradcheck(reference, (w_ED.clone().requires_grad_(),))
    with replay(router, rec):
        assert torch.equal(router(x_TD).ids_TK, ids_TK)
        assert _against_reference(gate, w_ED, reference) <= TOL
        # the same check on the mistake fails: it is what moelab would fail if it made it
        assert _against_reference(mistake, w_ED, reference) > 1e-3
        # the mistake's replayed experts outside the live top-k: weight 0, and no
        # gradient at all to their scores; moelab's: the live probability, and one
        jac_TKED = _jacobian(gate, w_ED)
    wrong_TKED = _jacobian(mistake, w_ED)
    for t, e in enumerate(outside_TK.tolist()):
        assert float(mistake(w_ED)[t, 1]) == 0.0 and float(gate(w_ED)[t, 1]) > 0
        assert float(wrong_TKED[t, 1].abs().max()) == 0.0  # the slot passes no gradient
        assert float(jac_TKED[t, 1, e].abs().max()) > 1e-3  # moelab's reaches row e


@pytest.mark.parametrize("gate", ["map", "renorm"])
@pytest.mark.parametrize("name", list(MAPS))
def test_replayed_weights_are_the_maps_values_at_the_replayed_experts(name: str, gate: str) -> None:
    """The weights are map(live logits) at the replayed ids (renormalised over them
    with renorm), whatever the live choice; LapSum and the sparse maps give their own
    values on the replayed set."""
    from moelab import maps

    x_TD = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids_TK = torch.tensor([[0, 1], [2, 3], [4, 5], [5, 0], [1, 4], [3, 2], [0, 5], [2, 4]])
    router, rec, fn = _replayed_router({**MAPS[name], "gate": gate}, ids_TK, x_TD)
    with replay(router, rec):
        out = router(x_TD)
        weights_TK = fn(router.weight.detach())
    cfg = router.config
    params = {"alpha": cfg.alpha} if cfg.alpha is not None else {}
    if name == "lapsum":
        params = {"k": cfg.lapsum_k}
    tau = router.temperature.tau.detach().double()  # cfg.temperature, held in float32
    z_TE = (x_TD @ router.weight.detach().t()) / tau  # the live logits
    torch.testing.assert_close(out.logits_TE, z_TE, atol=TOL, rtol=0)
    # NOTE: the map on the router's own logits: entmax's bisection moves by more than
    # 1e-12 between inputs that differ in the last bit
    p_TK = maps.get(cfg.map)(out.logits_TE.detach(), **params).gather(-1, ids_TK)
    if gate == "renorm":
        total = p_TK.sum(-1, keepdim=True)
        p_TK = torch.where(total > 0, p_TK / total.clamp_min(1e-300), 0)
    torch.testing.assert_close(out.weights_TK, p_TK, atol=TOL, rtol=0)
    torch.testing.assert_close(weights_TK, p_TK, atol=TOL, rtol=0)
    assert torch.equal(out.ids_TK, ids_TK) and bool(out.selected_TK.all())


def test_a_replayed_expert_outside_a_sparse_support_gets_no_gradient() -> None:
    """sparsemax gives most experts probability 0: a replayed expert there weighs 0 (a
    filler: selected, not computed), and since sparsemax is flat outside its support,
    its slot passes no gradient; the other slot of the token keeps its gradient. With
    renorm, a token whose replayed experts all have p = 0 has no weight and no gradient."""
    x_TD = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    keys = {"map": "sparsemax", "temperature": 0.2}
    router, rec, _ = _replayed_router(keys, torch.zeros(6, 2, dtype=torch.long), x_TD)
    with torch.no_grad():
        probs_TE = router(x_TD).probs_TE
    support_TE = probs_TE > 0
    assert bool((support_TE.sum(-1) < 6).all())  # every token leaves some experts out
    inside = [int(row.nonzero()[0]) for row in support_TE]
    outside = [int((~row).nonzero()[0]) for row in support_TE]
    mixed_TK = torch.tensor([[a, b] for a, b in zip(inside, outside, strict=True)])
    all_out = [[int(i) for i in (~row).nonzero()[:2, 0]] for row in support_TE]
    for gate_rule in ("map", "renorm"):
        for ids in (mixed_TK, torch.tensor(all_out)):
            router, rec, gate = _replayed_router({**keys, "gate": gate_rule}, ids, x_TD)
            with replay(router, rec):
                out = router(x_TD)
                jac_TKED = _jacobian(gate, router.weight.detach())
            assert bool(out.selected_TK.all()) and torch.equal(out.ids_TK, ids)
            outside_slot = 1 if ids is mixed_TK else slice(None)
            assert float(out.weights_TK.detach()[:, outside_slot].abs().max()) == 0.0
            assert not bool(out.computed_TK[:, outside_slot].any())  # fillers
            assert float(jac_TKED[:, outside_slot].abs().max()) == 0.0  # no gradient
            if ids is mixed_TK and gate_rule == "map":  # the other slot learns ...
                learns_T = jac_TKED[:, 0].abs().flatten(1).amax(-1) > 0
                # ... unless it is the token's only expert in the support (p = 1, flat)
                wide_T = support_TE.sum(-1) >= 2
                assert bool(wide_T.any()) and torch.equal(learns_T, wide_T)
