"""The temperature stage's registry: a new schedule is one class and one register call."""

from __future__ import annotations

import pytest
import torch

from moelab.routing import Router, RouterConfig
from moelab.routing import temperature as schedules


class Halving(schedules.Schedule):
    """A toy schedule: tau halves every step."""

    name = "halving"

    def update(self, temp: schedules.Temperature, weight_ED: torch.Tensor) -> None:
        temp.tau.mul_(0.5)


@pytest.fixture
def halving():
    schedules.register(Halving)
    yield Halving
    schedules.unregister(Halving.name)


def test_a_registered_schedule_drives_the_router(halving) -> None:
    assert "halving" in schedules.available()
    router = Router(RouterConfig(d_model=4, n_experts=3, schedule="halving", temperature=2.0))
    x_TD = torch.randn(5, 4)
    for expected in (2.0, 1.0, 0.5):
        out = router(x_TD)
        assert out.temperature == pytest.approx(expected)
        torch.testing.assert_close(out.logits_TE, out.scores_TE / expected)
        router.step(out)
    assert int(router.temperature.step) == 3
    assert "schedule=halving" in repr(router.temperature)


def test_unknown_and_duplicate_names_are_refused(halving) -> None:
    with pytest.raises(ValueError, match=r"schedule must be one of .*'fixed'.*got 'warm'"):
        RouterConfig(d_model=4, n_experts=3, schedule="warm")

    class Other(schedules.Schedule):
        name = "halving"

    with pytest.raises(ValueError, match="already registered"):
        schedules.register(Other)


def test_state_dict_keys_do_not_depend_on_the_schedule_class() -> None:
    # the buffers of old runs: tau, step (+ v, sigma_hat for the Lipschitz schedule)
    keys = {
        name: set(Router(RouterConfig(d_model=4, n_experts=3, schedule=name)).state_dict())
        for name in ("fixed", "cosine", "lipschitz")
    }
    assert keys["fixed"] == keys["cosine"]
    assert keys["lipschitz"] - keys["fixed"] == {"temperature.v", "temperature.sigma_hat"}
    assert {"temperature.tau", "temperature.step"} <= keys["fixed"]
