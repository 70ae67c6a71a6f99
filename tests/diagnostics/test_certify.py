"""Certified top-1 radii: the streamed fields against moelab.routing.certification on
the same router, numpy percentiles, chunk merging, ties, and the certificate itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moelab.diagnostics.certify import CertificationStats
from moelab.routing import Router, RouterConfig, RouterOutput
from moelab.routing.certification import certified_radius, gate_lipschitz, spectral_norm


def _router(map_name: str = "softmax", tau: float = 0.7, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    kw = {"alpha": 1.5} if map_name == "entmax" else {}
    cfg = RouterConfig(d_model=12, n_experts=6, map=map_name, temperature=tau, init_std=0.5, **kw)
    return Router(cfg).double().eval()


@pytest.mark.parametrize("map_name", ["softmax", "sparsemax", "entmax"])
def test_radii_and_fields_match_the_routing_helpers(map_name: str) -> None:
    router = _router(map_name)
    x = torch.randn(400, 12, dtype=torch.float64)
    out = router(x)
    tau = router.temperature.value
    w = router.weight.detach()
    acc = CertificationStats(tau, float(spectral_norm(w)))
    acc.update(out, x.norm(dim=-1))
    ref = certified_radius(x, w, tau).numpy()
    # the router scores in float32, the reference in float64
    assert np.allclose(acc.radii(out).numpy(), ref, rtol=1e-5, atol=0)
    res = acc.result()
    assert res["tau"] == pytest.approx(0.7, rel=1e-7)
    assert res["lipschitz"] == pytest.approx(float(gate_lipschitz(w, tau)), rel=1e-12)
    assert res["radius_mean"] == pytest.approx(ref.mean(), rel=1e-5)
    rel = ref / x.norm(dim=-1).numpy()
    assert res["radius_rel_mean"] == pytest.approx(rel.mean(), rel=1e-5)
    for q in (10, 50, 90):
        assert res[f"radius_p{q}"] == pytest.approx(np.percentile(ref, q), rel=1.2e-3)
        assert res[f"radius_rel_p{q}"] == pytest.approx(np.percentile(rel, q), rel=1.2e-3)
    # the percentile law alone (no float32 noise): exact radii through the accumulator
    exact = CertificationStats(1.0, 1.0)
    exact.radius.add(ref)
    for q in (1, 10, 50, 90, 99):
        assert exact.radius.percentile(q) == pytest.approx(np.percentile(ref, q), rel=1.16e-3)
    assert res["radius_zero_frac"] == 0.0


def test_radius_certifies_the_top1_choice() -> None:
    """Moving a token by less than its radius never changes its top-1 expert."""
    router = _router("sparsemax", tau=0.5, seed=1)
    x = torch.randn(300, 12, dtype=torch.float64)
    out = router(x)
    acc = CertificationStats(router.temperature.value, float(spectral_norm(router.weight.detach())))
    r = acc.radii(out)
    top1 = out.logits_TE.argmax(-1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        d = torch.randn(x.shape, dtype=torch.float64, generator=gen)
        d = d / d.norm(dim=-1, keepdim=True) * (0.999 * r)[:, None]
        assert torch.equal(router(x + d).logits_TE.argmax(-1), top1)


def test_ties_give_zero_radius_and_percentiles_count_them() -> None:
    router = _router()
    with torch.no_grad():
        router.weight[1] = router.weight[0]  # experts 0 and 1 always tie
        router.weight[2:] = -10 * router.weight[0]
    x = torch.randn(50, 12, dtype=torch.float64)
    x = x * torch.sign(x @ router.weight[0])[:, None]  # experts 0 and 1 on top
    acc = CertificationStats(0.7, float(spectral_norm(router.weight.detach())))
    acc.update(router(x))
    res = acc.result()
    assert res["radius_zero_frac"] == 1.0 and res["radius_p50"] == 0.0
    assert res["radius_rel_p50"] is None  # no token norms given


def test_chunks_merge_to_one_shot_and_bad_input() -> None:
    router = _router()
    x = torch.randn(600, 12, dtype=torch.float64)
    norm = float(spectral_norm(router.weight.detach()))
    one = CertificationStats(0.7, norm).update(router(x), x.norm(dim=-1))
    a = CertificationStats(0.7, norm).update(router(x[:250]), x[:250].norm(dim=-1))
    b = CertificationStats(0.7, norm).update(router(x[250:]), x[250:].norm(dim=-1))
    merged = a.merge(b).result()
    for key, value in one.result().items():
        assert merged[key] == pytest.approx(value, rel=1e-12), key
    with pytest.raises(ValueError, match="different tau"):
        a.merge(CertificationStats(0.5, norm))
    with pytest.raises(ValueError, match="tau must be > 0"):
        CertificationStats(0.0, norm)
    with pytest.raises(ValueError, match="entries"):
        CertificationStats(0.7, norm).update(router(x), x.norm(dim=-1)[:10])


def test_lipschitz_schedule_holds_the_target() -> None:
    """After enough power-iteration steps the reported Lipschitz constant is the target."""
    cfg = RouterConfig(d_model=16, n_experts=8, schedule="lipschitz", lipschitz_target=2.0)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(std=1.0)
    for _ in range(200):
        router.step()
    acc = CertificationStats(router.temperature.value, float(spectral_norm(router.weight.detach())))
    assert acc.result()["lipschitz"] == pytest.approx(2.0, rel=1e-4)
    assert math.isfinite(acc.result()["weight_norm"])


def test_hand_values() -> None:
    """E = 2, W = [[2, 0], [0, 0]] (||W||_2 = 2), tau = 1, x = (1, 0) and (0, 3)."""
    w = torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    logits = x @ w.t()  # (2, 0) and (0, 0)
    out = RouterOutput(
        scores_TE=logits,
        logits_TE=logits,
        probs_TE=torch.softmax(logits, -1),
        ids_TK=torch.zeros(2, 1, dtype=torch.long),
        weights_TK=torch.ones(2, 1),
        selected_TK=torch.ones(2, 1, dtype=torch.bool),
        dropped_TK=torch.zeros(2, 1, dtype=torch.bool),
        aux_loss=torch.zeros(()),
    )
    acc = CertificationStats(1.0, 2.0).update(out, x.norm(dim=-1))
    m = math.tanh(1.0)  # sigmoid(2) - sigmoid(-2)
    r = math.sqrt(2.0) * m / 2.0  # = 0.5386
    assert acc.radii(out).tolist() == pytest.approx([r, 0.0], rel=1e-12)
    res = acc.result()
    assert res["lipschitz"] == 1.0 and res["radius_zero_frac"] == 0.5
    assert res["radius_mean"] == pytest.approx(r / 2, rel=1e-12)
    assert res["radius_rel_mean"] == pytest.approx(r / 2, rel=1e-12)  # ||x|| = 1 for the first
    assert res["radius_p90"] == pytest.approx(0.9 * r, rel=1.2e-3)  # between 0 and r
