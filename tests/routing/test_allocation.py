"""Learned per-layer allocation, the cap, and threshold calibration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelab.routing.allocation import LayerAllocator, ThresholdCalibrator, cap


@given(
    seed=st.integers(0, 2**31 - 1),
    n_layers=st.integers(1, 12),
    extra=st.floats(0.1, 20.0),
    eta_scale=st.floats(0.0, 20.0),
)
def test_allocation_sums_to_budget_and_each_at_least_one(
    seed: int, n_layers: int, extra: float, eta_scale: float
) -> None:
    k_total = n_layers + extra
    alloc = LayerAllocator(n_layers, k_total, n_experts=int(extra) + 3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        alloc.eta.copy_(eta_scale * torch.randn(n_layers, generator=gen))
    k_L = alloc().detach()
    assert k_L.shape == (n_layers,)
    assert float(k_L.sum()) == pytest.approx(k_total, rel=1e-5)
    assert (k_L >= 1).all()
    assert (k_L <= k_total - n_layers + 1 + 1e-5).all()


def test_init_is_uniform() -> None:
    alloc = LayerAllocator(n_layers=4, k_total=8, n_experts=8)
    torch.testing.assert_close(alloc(), torch.full((4,), 2.0))
    assert alloc.eta.shape == (4,) and alloc.eta.requires_grad
    assert [name for name, _ in alloc.named_parameters()] == ["eta"]


def test_gradient_reaches_eta() -> None:
    alloc = LayerAllocator(n_layers=5, k_total=10, n_experts=8)
    # sum(k) is constant, so weight the layers differently
    loss = (alloc() * torch.arange(5.0)).sum()
    loss.backward()
    assert alloc.eta.grad is not None
    assert alloc.eta.grad.abs().max() > 0
    # softmax Jacobian: d loss / d eta_l = (K - L) * pi_l * (w_l - mean_pi(w)) = 5/5 * (l - 2)
    torch.testing.assert_close(alloc.eta.grad, torch.arange(5.0) - 2.0)


def test_validation() -> None:
    with pytest.raises(ValueError, match="must exceed n_layers"):
        LayerAllocator(n_layers=4, k_total=4, n_experts=8)
    with pytest.raises(ValueError, match="must exceed n_layers"):
        LayerAllocator(n_layers=4, k_total=3.5, n_experts=8)
    with pytest.raises(ValueError, match="k < n_experts"):
        LayerAllocator(n_layers=4, k_total=11, n_experts=8)  # k_l could reach 8
    with pytest.raises(ValueError, match="n_layers must be"):
        LayerAllocator(n_layers=0, k_total=2, n_experts=8)
    LayerAllocator(n_layers=4, k_total=10.5, n_experts=8)  # max k_l = 7.5 < 8: fine


def test_cap() -> None:
    assert cap(2, 2.0) == 4
    assert cap(1.5, 2.0) == 3
    assert cap(1.2, 2.0) == 3
    assert cap(0.1, 2.0) == 1
    assert cap(torch.tensor(1.6), 4.0) == 7  # 6.4 -> 7
    assert LayerAllocator.cap(2.5, 2.0) == 5
    # float32 noise just above an integer does not add a slot
    assert cap(torch.tensor(2.0000002), 2.0) == 4
    assert cap(0.1, 30.0) == 3  # 0.1 * 30 = 3.0000000000000004
    k_L = LayerAllocator(n_layers=3, k_total=6, n_experts=8)()
    assert [cap(k, 2.0) for k in k_L] == [4, 4, 4]
    with pytest.raises(ValueError, match="cap_factor"):
        cap(2, 0.0)
    with pytest.raises(ValueError, match="k must be"):
        cap(0, 2.0)


def test_calibrator_by_hand() -> None:
    calib = ThresholdCalibrator()
    assert calib.n_batches == 0 and not calib.ready(1)
    calib.observe(torch.tensor([[0.5, 0.3, 0.2]]))
    calib.observe(torch.tensor([[0.6, 0.3, 0.1]]))
    assert calib.n_batches == 2 and calib.n_tokens == 2
    assert calib.ready(2) and not calib.ready(3)
    # sorted: 0.6 0.5 0.3 0.3 0.2 0.1 (T_total = 2)
    assert calib.threshold(1.0) == pytest.approx(0.3)  # n = 2 -> keeps 0.6, 0.5: mean 1
    assert calib.threshold(2.0) == pytest.approx(0.2)  # n = 4 -> keeps four: mean 2
    assert calib.threshold(0.5) == pytest.approx(0.5)  # n = 1 -> keeps 0.6: mean 0.5
    # tie at position 3: tau = 0.3 and both 0.3s are inactive, so the mean is 1, not 1.5
    assert calib.threshold(1.5) == pytest.approx(0.3)
    assert calib.threshold(torch.tensor(2.0)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="k must lie"):
        calib.threshold(3.0)
    with pytest.raises(ValueError, match="experts"):
        calib.observe(torch.rand(2, 4))
    calib.reset()
    assert calib.n_batches == 0
    with pytest.raises(RuntimeError, match="observe"):
        calib.threshold(1.0)


@pytest.mark.parametrize("k", [1.0, 1.5, 2.0, 3.7])
def test_calibrator_on_random_probs(k: float) -> None:
    gen = torch.Generator().manual_seed(0)
    calib = ThresholdCalibrator()
    batches = [torch.softmax(2 * torch.randn(4, 16, 8, generator=gen), -1) for _ in range(3)]
    for probs_BSE in batches:  # leading shape (B, S) is flattened
        calib.observe(probs_BSE)
    tau = calib.threshold(k)
    probs_TE = torch.cat([b.reshape(-1, 8) for b in batches])
    mean_active = float((probs_TE > tau).sum(-1).float().mean())
    assert abs(mean_active - k) < 0.05
