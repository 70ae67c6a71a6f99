"""sqrtsoftplus (DeepSeek-V4's score): values against a brute-force reference, its
closed-form backward against the formula and finite differences in float64, extreme
inputs, its record, and a tiny model that trains with it under the loss-free bias."""

from __future__ import annotations

import math

import pytest
import torch

from moelab import maps


def _reference(z: float) -> float:
    """sqrt(log(1 + e^z)) in Python floats, one number at a time (the brute force)."""
    if z == -math.inf:
        return 0.0
    # log(1 + e^z) = max(z, 0) + log1p(e^{-|z|}): no overflow for large z
    return math.sqrt(max(z, 0.0) + math.log1p(math.exp(-abs(z))))


def _reference_grad(z: float) -> float:
    """sigmoid(z) / (2 sqrt(softplus(z))), with its limit 0 at -inf and where the
    float64 softplus underflows (e^{z/2} / 2, below 1e-160 there)."""
    p = _reference(z)
    if p == 0.0:
        return 0.0
    sig = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return sig / (2.0 * p)


Z = [-1e4, -800.0, -700.0, -60.0, -20.0, -3.0, -0.5, 0.0, 1e-6, 0.7, 5.0, 30.0, 1e4]


def test_values_match_the_reference_in_float64() -> None:
    z = torch.tensor([Z], dtype=torch.float64)
    p = maps.sqrtsoftplus(z)
    expected = torch.tensor([[_reference(v) for v in Z]], dtype=torch.float64)
    torch.testing.assert_close(p, expected, rtol=1e-13, atol=0)
    assert maps.get("sqrtsoftplus") is maps.sqrtsoftplus


def test_backward_matches_the_formula_in_float64() -> None:
    z = torch.tensor([Z], dtype=torch.float64, requires_grad=True)
    g = torch.linspace(-1.5, 2.0, len(Z), dtype=torch.float64).unsqueeze(0)
    maps.sqrtsoftplus(z).backward(g)
    expected = torch.tensor([[_reference_grad(v) for v in Z]], dtype=torch.float64) * g
    torch.testing.assert_close(z.grad, expected, rtol=1e-12, atol=0)


def test_gradcheck_and_gradgradcheck_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(4, 6, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    with torch.no_grad():
        z[0, 0] = -40.0  # deep in the left tail: p ~ e^{-20}
        z[1, 1] = 25.0  # beyond softplus's linear switch at 20
    assert torch.autograd.gradcheck(maps.sqrtsoftplus, (z,))
    assert torch.autograd.gradgradcheck(maps.sqrtsoftplus, (z,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_inputs_are_finite_with_finite_gradients(dtype: torch.dtype) -> None:
    z = torch.tensor([[-1e4, -1e3, -150.0, -100.0, 0.0, 1e3, 1e4, -math.inf]], dtype=dtype)
    z.requires_grad_(True)
    p = maps.sqrtsoftplus(z)
    (grad,) = torch.autograd.grad(p.sum(), z, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), z)
    for t in (p, grad, second):
        assert bool(torch.isfinite(t).all()), t
    assert bool((p >= 0).all())
    # -inf (a masked expert) and -1e4 (softplus underflows): value 0, gradient 0
    assert p[0, 0] == 0 and p[0, -1] == 0
    assert grad[0, 0] == 0 and grad[0, -1] == 0
    # large z: p = sqrt(z), dp/dz = 1 / (2 sqrt(z))
    torch.testing.assert_close(p[0, 6], torch.tensor(100.0, dtype=dtype))
    torch.testing.assert_close(grad[0, 6], torch.tensor(0.005, dtype=dtype))


def test_subnormal_outputs_take_the_limit_gradient() -> None:
    # float32: softplus(-100) = e^-100 ~ 3.7e-44 is subnormal, p ~ 1.9e-22 is normal but
    # p^2 rounds to 0: the gradient is the limit p / 2, not 0/0
    z = torch.tensor([[-100.0, -95.0, 0.0]], requires_grad=True)
    p = maps.sqrtsoftplus(z)
    p.sum().backward()
    assert bool((p[0, :2] > 0).all())
    torch.testing.assert_close(z.grad[0, :2], p.detach()[0, :2] / 2, rtol=1e-3, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_plus_inf_are_rejected(bad: float) -> None:
    z = torch.tensor([[0.0, bad, 1.0]])
    with pytest.raises(ValueError, match=r"sqrtsoftplus: scores contain NaN or \+inf"):
        maps.sqrtsoftplus(z)
    with pytest.raises(ValueError, match="every score of flattened row 0 is -inf"):
        maps.sqrtsoftplus(torch.full((1, 3), -math.inf))


def test_record_not_a_simplex_map_and_no_fixed_total() -> None:
    info = maps.info("sqrtsoftplus")
    assert not info.simplex and not info.fixed_total and not info.needs_k
    assert info.threshold_law is None and maps.threshold("sqrtsoftplus") is None
    assert dict(info.params) == {}


def test_router_with_every_gate_and_the_bias() -> None:
    from moelab.routing import Router, RouterConfig

    torch.manual_seed(0)
    router = Router(
        RouterConfig(
            d_model=8, n_experts=6, top_k=2, map="sqrtsoftplus", gate="renorm", bias_rate=0.01
        )
    )
    x_TD = torch.randn(32, 8)
    out = router(x_TD)
    a_TE = torch.nn.functional.softplus(x_TD @ router.weight.t()).sqrt()
    torch.testing.assert_close(out.probs_TE, a_TE)
    chosen = a_TE.topk(2, dim=-1)
    torch.testing.assert_close(out.ids_TK.sort(-1).values, chosen.indices.sort(-1).values)
    torch.testing.assert_close(out.weights_TK.sum(-1), torch.ones(32))
    router.step(out)
    assert bool((router.bias != 0).any())  # the loss-free bias moved


def test_a_tiny_model_trains_with_it(tmp_path) -> None:
    # DeepSeek-V4's routed part: sqrt-softplus scores, top-2, renormalised gates, the
    # loss-free bias steering the choice (no Switch loss)
    import json

    from moelab.train import train
    from tests.train import TINY_MODEL, make_corpus, tiny_config

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    router = {"map": "sqrtsoftplus", "gate": "renorm", "bias_rate": 0.01, "aux_weight": 0.0}
    train(tiny_config(corpus, run, steps=4, model=dict(TINY_MODEL, router=router)))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert all("discarded_mass" not in r for r in rows if "loss" in r)  # no fixed total
    biased = [r for r in rows if "bias_abs_mean_layers" in r]
    assert biased and max(biased[-1]["bias_abs_mean_layers"]) > 0
