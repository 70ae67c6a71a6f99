"""Bad input raises a ValueError that says what to change; never a silent NaN."""

from __future__ import annotations

import math

import pytest
import torch

from moelab import maps

from .conftest import ALL, MapSpec


@pytest.mark.parametrize("spec", ALL, ids=str)
@pytest.mark.parametrize(
    ("bad", "match"),
    [(math.nan, "NaN"), (math.inf, r"\+inf")],
)
def test_nan_and_posinf_scores(spec: MapSpec, bad: float, match: str, backend: str) -> None:
    z = torch.randn(3, 6)
    z[1, 2] = bad
    with pytest.raises(ValueError, match=match):
        spec.fn(z)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_fully_masked_row(spec: MapSpec, backend: str) -> None:
    z = torch.randn(3, 6)
    z[2] = -torch.inf
    with pytest.raises(ValueError, match="all experts masked"):
        spec.fn(z)


@pytest.mark.parametrize("fn", [maps.entmax, maps.normmax])
@pytest.mark.parametrize("alpha", [1.0, 0.5, -2.0, math.nan])
def test_alpha_at_most_one(fn, alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha must be > 1"):
        fn(torch.randn(2, 4), alpha=alpha)
    if not math.isnan(alpha):
        with pytest.raises(ValueError, match="alpha must be > 1"):
            maps.threshold("entmax", alpha)


def test_alpha_one_names_the_map_to_use() -> None:
    # the message reaches command-line users too (--alpha 1, --set router.alpha=1):
    # before, it said "use maps.softmax for alpha = 1", a Python function they
    # cannot pass, and said so for normmax too, which tends to a one-hot argmax
    with pytest.raises(ValueError) as err:
        maps.entmax(torch.randn(2, 4), alpha=1.0)
    assert "the map 'softmax'" in str(err.value) and "map=softmax" in str(err.value)
    with pytest.raises(ValueError) as err:
        maps.normmax(torch.randn(2, 4), alpha=1.0)
    assert "softmax" not in str(err.value) and "one-hot argmax" in str(err.value)
    # a config key names the parameter as the user spells it
    with pytest.raises(ValueError, match=r"router\.alpha must be > 1"):
        maps.info("entmax").check_params(alpha=1.0, keys={"alpha": "router.alpha"})


@pytest.mark.parametrize("k", [0.0, -1.0, 6.0, 7.5])
def test_k_outside_open_interval(k: float, backend: str) -> None:
    with pytest.raises(ValueError, match="k must lie strictly between 0 and the number"):
        maps.lapsum(torch.randn(3, 6), k)


def test_k_counts_only_unmasked_experts(backend: str) -> None:
    z = torch.randn(3, 6)
    z[:, :2] = -torch.inf
    maps.lapsum(z, 3.5)  # 4 unmasked experts
    with pytest.raises(ValueError, match="4 unmasked experts"):
        maps.lapsum(z, 4.0)


def test_k_tensor_with_one_bad_row(backend: str) -> None:
    with pytest.raises(ValueError, match="k must lie"):
        maps.lapsum(torch.randn(3, 6), torch.tensor([1.0, 2.0, 0.0]))


@pytest.mark.parametrize("t", [0.0, -1.0, math.nan, math.inf, 1e39, 1e-46])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_temperature_not_positive_and_finite(t: float, as_tensor: bool, backend: str) -> None:
    # 1e39 and 1e-46 are inf and 0 in float32, the dtype the map computes in
    temperature = torch.tensor(t, dtype=torch.float64) if as_tensor else t
    with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
        maps.lapsum(torch.randn(3, 6), 2.0, temperature=temperature)


@pytest.mark.parametrize("fn", [maps.entmax, maps.normmax])
def test_alpha_infinite(fn, backend: str) -> None:
    # used to give the uniform distribution, silently
    with pytest.raises(ValueError, match="alpha must be a finite number > 1"):
        fn(torch.randn(2, 4), alpha=math.inf)
    for name in ("entmax", "normmax"):
        with pytest.raises(ValueError, match="alpha must be a finite number > 1"):
            maps.threshold(name, math.inf)


@pytest.mark.parametrize("spec", ALL, ids=str)
@pytest.mark.parametrize("shape", [(3, 0), (0, 0)])
def test_no_experts(spec: MapSpec, shape: tuple[int, int], backend: str) -> None:
    with pytest.raises(ValueError, match="no experts along dim 1"):
        spec.fn(torch.zeros(shape))


def test_k_shape_that_does_not_broadcast() -> None:
    with pytest.raises(ValueError, match="does not broadcast"):
        maps.lapsum(torch.randn(3, 6), torch.ones(4))


def test_unknown_method_and_missing_exact_solver() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        maps.entmax(torch.randn(2, 4), method="sort")
    with pytest.raises(ValueError, match="no exact solver"):
        maps.entmax(torch.randn(2, 4), alpha=1.3, method="exact")
    with pytest.raises(ValueError, match="no exact solver"):
        maps.normmax(torch.randn(2, 4), alpha=3.0, method="exact")


def test_integer_scores_rejected() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        maps.sparsemax(torch.arange(4))


def test_registry() -> None:
    assert set(maps.available()) == {
        "softmax",
        "sigmoid",
        "relu",
        "sqrtsoftplus",
        "sparsemax",
        "entmax",
        "normmax",
        "lapsum",
    }
    for name in maps.available():
        assert callable(maps.get(name))
    assert maps.get("entmax") is maps.entmax
    with pytest.raises(ValueError, match="available maps: softmax"):
        maps.get("sparsmax")
    with pytest.raises(ValueError, match="unknown map"):
        maps.threshold("nope")


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_the_message_names_the_first_bad_row(spec: MapSpec, backend: str) -> None:
    # -inf masks elsewhere take the checks past their whole-tensor fast path
    z = torch.randn(5, 6)
    z[0, 1] = -torch.inf
    z[3, 2] = math.nan
    z[4] = -torch.inf
    with pytest.raises(ValueError, match="first at flattened row 3"):
        spec.fn(z)
    z[3, 2] = 0.0
    with pytest.raises(ValueError, match="row 4 is -inf"):
        spec.fn(z)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_no_rows(spec: MapSpec, backend: str) -> None:
    assert spec.fn(torch.randn(0, 6)).shape == (0, 6)
