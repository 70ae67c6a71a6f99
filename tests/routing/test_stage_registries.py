"""The gate and balancing stages' registries: a new gate or auxiliary loss is one class
and one register call, and the router asks the stage, never a name."""

from __future__ import annotations

import pytest
import torch

from moelab.routing import Router, RouterConfig, gates, losses


class SqrtGate(gates.Gate):
    """A toy gate: w = sqrt(p)."""

    name = "sqrt"

    def weigh(self, p_TK: torch.Tensor) -> torch.Tensor:
        return p_TK.sqrt()


class MeanProb(losses.AuxLoss):
    """A toy loss, always on: the mean of the map's values, weight 0.5."""

    name = "mean_prob"

    @classmethod
    def on(cls, config: losses.BalancingConfig) -> bool:
        return True

    def weight(self, router: torch.nn.Module) -> float:
        return 0.5

    def __call__(self, routed: losses.Routed) -> torch.Tensor:
        return routed.probs_TE.mean()


@pytest.fixture
def toys():
    gates.register(SqrtGate)
    losses.register(MeanProb)
    yield
    gates.unregister(SqrtGate.name)
    losses.unregister(MeanProb.name)


def _router(**kw) -> Router:
    """A router with the losses ``kw`` turns on, none else (the Switch loss is on by
    default)."""
    torch.manual_seed(0)
    return Router(RouterConfig(d_model=6, n_experts=5, top_k=2, **{"aux_weight": 0.0, **kw}))


def test_a_registered_gate_and_loss_drive_the_router(toys) -> None:
    router = _router(gate="sqrt", routed_scaling=3.0, z_loss_weight=0.1)
    x_TD = torch.randn(7, 6)
    out = router(x_TD)
    p_TK = out.probs_TE.gather(-1, out.ids_TK)
    torch.testing.assert_close(out.weights_TK, 3.0 * p_TK.sqrt())
    assert set(out.losses) == {"z", "mean_prob"}
    torch.testing.assert_close(out.losses["mean_prob"], out.probs_TE.mean())
    expected = 0.1 * out.losses["z"] + 0.5 * out.losses["mean_prob"]
    torch.testing.assert_close(out.aux_loss, expected)
    # the toy gate gets gradient through sqrt
    out.weights_TK.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_gate_key_and_flat_keys_agree() -> None:
    assert RouterConfig(d_model=4, n_experts=4).gate_rule == "map"
    renorm = RouterConfig(d_model=4, n_experts=4, gate="renorm")
    assert (renorm.renorm, renorm.straight_through, renorm.gate_rule) == (True, False, "renorm")
    flat = RouterConfig(d_model=4, n_experts=4, straight_through=True)
    assert flat.gate_rule == "straight_through"
    # the gate key and the flat keys give the same weights
    x_TD = torch.randn(5, 4)
    a = Router(RouterConfig(d_model=4, n_experts=4, gate="renorm"))
    b = Router(RouterConfig(d_model=4, n_experts=4, renorm=True))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x_TD).weights_TK, b(x_TD).weights_TK)
    with pytest.raises(ValueError, match=r"gate must be one of .*got 'soft'"):
        RouterConfig(d_model=4, n_experts=4, gate="soft")
    with pytest.raises(ValueError, match="disagree"):
        RouterConfig(d_model=4, n_experts=4, gate="map", renorm=True)


def test_built_in_losses_sum_into_aux_loss() -> None:
    router = _router(aux_weight=0.01, z_loss_weight=0.001, entropy_loss_weight=0.1)
    out = router(torch.randn(9, 6))
    assert list(out.losses) == ["switch", "z", "entropy"]
    expected = 0.01 * out.losses["switch"] + 0.001 * out.losses["z"] + 0.1 * out.losses["entropy"]
    torch.testing.assert_close(out.aux_loss, expected)
    assert _router()(torch.randn(3, 6)).losses == {}


def test_registries_refuse_duplicates_and_unknown_names(toys) -> None:
    class Other(gates.Gate):
        name = "sqrt"

    with pytest.raises(ValueError, match="gate 'sqrt' is already registered"):
        gates.register(Other)
    with pytest.raises(ValueError, match="auxiliary loss must be one of"):
        losses.get("nope")
    assert "mean_prob" in losses.available() and "sqrt" in gates.available()
