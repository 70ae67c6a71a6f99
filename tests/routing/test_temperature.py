"""Temperature schedules: power iteration, the Lipschitz rule, cosine anneal, state dict."""

from __future__ import annotations

import io
import itertools
import math
from typing import Any

import pytest
import torch

from moelab.routing.certification import spectral_norm
from moelab.routing.temperature import Temperature, TemperatureConfig

D, E = 64, 8


def make(schedule: str, **kw: Any) -> Temperature:
    return Temperature(TemperatureConfig(d_model=D, schedule=schedule, **kw))


def random_weight(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(E, D, generator=gen)


def test_fixed_does_nothing() -> None:
    temp = make("fixed", temperature=0.7)
    for _ in range(3):
        temp.update(random_weight())
    assert temp.value == pytest.approx(0.7)
    assert int(temp.step) == 0
    assert set(temp.state_dict()) == {"tau", "step"}
    scores_TE = torch.randn(5, E)
    torch.testing.assert_close(temp(scores_TE), scores_TE / 0.7)


def test_buffers_dtypes_and_init() -> None:
    temp = make("lipschitz", temperature=2.0)
    assert temp.tau.dtype == torch.float32 and temp.tau.dim() == 0
    assert temp.step.dtype == torch.int64 and temp.step.dim() == 0
    assert temp.v.shape == (D,)
    assert float(temp.v.norm()) == pytest.approx(1.0, abs=1e-6)
    assert temp.value == pytest.approx(2.0)  # tau starts at `temperature`
    assert set(temp.state_dict()) == {"tau", "step", "v", "sigma_hat"}
    # fixed seed: two instances start from the same v, whatever the global RNG did
    torch.manual_seed(123)
    torch.testing.assert_close(make("lipschitz").v, temp.v, rtol=0, atol=0)


def test_power_iteration_converges_to_spectral_norm() -> None:
    w_ED = random_weight(seed=1)
    exact = float(spectral_norm(w_ED))
    temp = make("lipschitz")
    for _ in range(200):
        temp.update(w_ED)
    sigma_hat = float(temp.sigma_hat)
    assert abs(sigma_hat - exact) / exact < 1e-4
    assert sigma_hat <= exact * (1 + 1e-6)  # ||W v|| with unit v never exceeds ||W||_2
    assert int(temp.step) == 200
    assert float(temp.v.norm()) == pytest.approx(1.0, abs=1e-5)


def test_lipschitz_rule_large_weight_branch() -> None:
    target = 2.0
    temp = make("lipschitz", lipschitz_target=target, tau_min=0.05)
    w_ED = random_weight(seed=2)
    temp.update(w_ED)
    sigma_hat = float(temp.sigma_hat)
    assert sigma_hat / (2 * target) > 0.05  # this W is in the sigma branch
    assert temp.value == pytest.approx(sigma_hat / (2 * target), rel=1e-6)
    for _ in range(199):
        temp.update(w_ED)
    assert temp.value == pytest.approx(float(spectral_norm(w_ED)) / (2 * target), rel=1e-4)


def test_lipschitz_rule_tau_min_branch() -> None:
    temp = make("lipschitz", lipschitz_target=1.0, tau_min=0.3, temperature=1.0)
    w_ED = random_weight(seed=3, scale=1e-3)
    temp.update(w_ED)
    assert float(temp.sigma_hat) / 2 < 0.3
    assert temp.value == pytest.approx(0.3)


def test_lipschitz_zero_weight_keeps_unit_v() -> None:
    temp = make("lipschitz", tau_min=0.1)
    v0 = temp.v.clone()
    temp.update(torch.zeros(E, D))
    torch.testing.assert_close(temp.v, v0)
    assert float(temp.sigma_hat) == 0.0
    assert temp.value == pytest.approx(0.1)


def test_lipschitz_rejects_wrong_weight_shape() -> None:
    with pytest.raises(ValueError, match="d_model"):
        make("lipschitz").update(torch.randn(E, D + 1))


def test_state_dict_round_trip() -> None:
    temp = make("lipschitz", lipschitz_target=0.5)
    w_ED = random_weight(seed=4)
    for _ in range(5):
        temp.update(w_ED)
    buf = io.BytesIO()
    torch.save(temp.state_dict(), buf)
    buf.seek(0)

    fresh = make("lipschitz", lipschitz_target=0.5)
    assert not torch.equal(fresh.v, temp.v)
    fresh.load_state_dict(torch.load(buf))
    for name in ("v", "tau", "step", "sigma_hat"):
        assert torch.equal(getattr(fresh, name), getattr(temp, name)), name
    # and both continue identically
    temp.update(w_ED)
    fresh.update(w_ED)
    assert torch.equal(fresh.v, temp.v) and torch.equal(fresh.tau, temp.tau)


def cosine_by_hand(s: int, t0: float, t1: float, n: int) -> float:
    return t1 + (t0 - t1) * 0.5 * (1 + math.cos(math.pi * min(s, n) / n))


def test_cosine_anneal() -> None:
    t0, t1, n = 5.0, 1.0, 10
    temp = make("cosine", temperature=t0, tau_final=t1, anneal_steps=n)
    assert temp.value == pytest.approx(t0)  # step 0
    values = []
    for _ in range(n + 5):
        temp.update(random_weight())
        values.append(temp.value)
    assert int(temp.step) == n + 5
    assert values[n // 2 - 1] == pytest.approx(3.0, abs=1e-6)  # midpoint: (5 + 1) / 2
    assert values[n - 1] == pytest.approx(t1, abs=1e-6)  # step n
    assert values[n:] == pytest.approx([t1] * 5, abs=1e-6)  # and stays there
    for s, got in enumerate(values, start=1):
        assert got == pytest.approx(cosine_by_hand(s, t0, t1, n), abs=1e-6)
    assert all(a >= b for a, b in itertools.pairwise(values))
