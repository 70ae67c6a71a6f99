"""The router's input jitter (``router.jitter``, Switch Transformer / Megatron-Core's
``moe_input_jitter_eps``): refused outside [0, 1), absent in eval mode, and in training
the input multiplied entrywise by factors in [1 - eps, 1 + eps] before the scores, so
that selection and gate both see them, with every map. References in float64, drawn
independently from a seeded generator."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moelab import maps
from moelab.routing import Router, RouterConfig
from moelab.routing.router import apply_map

MAP_ARGS: dict[str, dict[str, Any]] = {
    "entmax": {"alpha": 1.5},
    "normmax": {"alpha": 2.0},
    "lapsum": {"lapsum_k": 2.0},
}
D, E, T = 8, 8, 40
EPS = 0.3


def _router(seed: int = 0, **keys: Any) -> Router:
    torch.manual_seed(seed)
    keys = {"d_model": D, "n_experts": E, "top_k": 2, "init_std": 0.5, **keys}
    return Router(RouterConfig(**keys)).double()


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _factors(seed: int, eps: float) -> torch.Tensor:
    """The factors a generator seeded ``seed`` gives, written out: 1 - eps + 2 eps u."""
    u = torch.rand(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return 1.0 - eps + 2.0 * eps * u


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_jitter_outside_zero_one_is_refused_in_one_line(bad: float) -> None:
    with pytest.raises(ValueError, match=r"jitter must lie in \[0, 1\)") as err:
        RouterConfig(d_model=D, n_experts=E, jitter=bad)
    assert "\n" not in str(err.value)


def test_eval_mode_is_unaffected() -> None:
    x = _x()
    plain = _router().eval()
    jittered = _router(jitter=EPS).eval()
    a = plain(x)
    b = jittered(x, generator=torch.Generator().manual_seed(5))
    for name in ("scores_TE", "probs_TE", "weights_TK", "ids_TK"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_training_multiplies_the_input_by_factors_within_the_bounds() -> None:
    # W = identity (D = E), no bias, tau = 1: the scores are the jittered input itself
    router = _router(jitter=EPS).train()
    with torch.no_grad():
        router.weight.copy_(torch.eye(E, D, dtype=torch.float64))
    x = _x()
    out = router(x, generator=torch.Generator().manual_seed(7))
    f = out.scores_TE.detach() / x
    assert out.scores_TE.dtype == torch.float64
    assert bool((f >= 1 - EPS).all()) and bool((f <= 1 + EPS).all())
    assert float(f.min()) < 1 - EPS / 2 and float(f.max()) > 1 + EPS / 2  # spread, not 1
    torch.testing.assert_close(f, _factors(7, EPS), rtol=1e-12, atol=1e-12)
    # the experts' input is untouched, and the gradient reaches x through the product
    x.requires_grad_(True)
    out = router(x, generator=torch.Generator().manual_seed(7))
    out.scores_TE.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, _factors(7, EPS), rtol=1e-12, atol=1e-12)


def test_zero_jitter_draws_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    _router().train()(_x(), generator=g)
    assert torch.equal(g.get_state(), state)


CASES = [(m, {"map": m, **MAP_ARGS.get(m, {})}) for m in maps.available()]
CASES += [
    ("threshold-lapsum", {"map": "lapsum", "lapsum_k": 2.0, "selection": "threshold"}),
    ("renorm", {"renorm": True}),
]


@pytest.mark.parametrize(("name", "keys"), CASES, ids=[c[0] for c in CASES])
def test_training_jitter_composes_with_every_map(name: str, keys: dict[str, Any]) -> None:
    """A jittered router in training routes x exactly as the same router without jitter
    routes x * f: the selection and the gate both see the jittered scores; in eval mode
    it routes x as the plain one does."""
    x = _x()
    jittered = _router(jitter=EPS, **keys).train()
    plain = _router(**keys).train()
    a = jittered(x, generator=torch.Generator().manual_seed(11))
    b = plain(x * _factors(11, EPS))
    for field in ("scores_TE", "probs_TE", "weights_TK"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-12)
    assert torch.equal(a.ids_TK, b.ids_TK) and torch.equal(a.selected_TK, b.selected_TK)
    # the gate weights are the map's values of the jittered scores at the selection
    if not keys.get("renorm"):
        probs = apply_map(jittered.config, a.logits_TE)
        torch.testing.assert_close(a.weights_TK, probs.gather(-1, a.ids_TK) * a.selected_TK)
    # and the jitter did move the scores
    assert not torch.allclose(a.scores_TE, plain(x).scores_TE)
    # eval: the same as the plain router
    e_a, e_b = jittered.eval()(x), plain.eval()(x)
    assert torch.equal(e_a.weights_TK, e_b.weights_TK) and torch.equal(e_a.ids_TK, e_b.ids_TK)


def test_noise_std_stays_ranking_only_beside_jitter() -> None:
    """noise_std (Gaussian on the ranking) leaves the scores and the map's values as they
    are; jitter moves them. Both together: the scores are the jittered ones."""
    x = _x()
    noisy = _router(noise_std=1.0).train()
    out = noisy(x, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(out.scores_TE, x @ noisy.weight.t(), rtol=1e-12, atol=1e-12)
    both = _router(noise_std=1.0, jitter=EPS).train()
    out = both(x, generator=torch.Generator().manual_seed(2))
    expected = (x * _factors(2, EPS)) @ both.weight.t()
    torch.testing.assert_close(out.scores_TE, expected, rtol=1e-12, atol=1e-12)


def test_jitter_is_a_training_only_key_and_a_batch_mechanism() -> None:
    from moelab.diagnostics.analysis.invariance import batch_mechanisms

    source = SimpleNamespace(routers=[_router(jitter=0.05)])
    found = batch_mechanisms(source)  # type: ignore[arg-type]
    assert [m["key"] for m in found] == ["jitter"] and found[0]["when"] == "training"
