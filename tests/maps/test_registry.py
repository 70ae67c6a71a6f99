"""The map registry: every record agrees with its function's behaviour, and
registering a map is all it takes for the rest of moelab to list it."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator

import pytest
import torch

from moelab import maps
from moelab.maps import _registry

RECORDS = list(maps.registry().values())
ALPHAS = (1.25, 1.5, 2.0, 3.0)
K = 2.0  # the budget given to maps that need k


def _ids(info: maps.MapInfo) -> str:
    return info.name


def _call_params(info: maps.MapInfo) -> dict[str, float]:
    """The parameters to call ``info.fn`` with: none, or k where it needs one."""
    return {"k": K} if info.needs_k else {}


def _rows(n: int = 400, e: int = 6, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, e, generator=g, dtype=torch.float64) * scale


def _runner_up(z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-2 gap, weight of the runner-up) per row."""
    top2 = z.topk(2, dim=-1)
    return top2.values[:, 0] - top2.values[:, 1], p.gather(-1, top2.indices[:, 1:2])[:, 0]


def test_builtin_maps_are_registered() -> None:
    names = (
        "softmax",
        "sigmoid",
        "relu",
        "sqrtsoftplus",
        "sparsemax",
        "entmax",
        "normmax",
        "lapsum",
    )
    assert maps.available() == names
    assert tuple(maps.registry()) == names
    for name in names:
        assert maps.info(name).name == name
        assert maps.get(name) is maps.info(name).fn is getattr(maps, name)


@pytest.mark.parametrize("info", RECORDS, ids=_ids)
def test_params_are_the_functions_keywords_with_its_defaults(info: maps.MapInfo) -> None:
    sig = inspect.signature(info.fn).parameters
    for p, spec in info.params.items():
        want = inspect.Parameter.empty if spec.default is maps.REQUIRED else spec.default
        assert sig[p].default == want, (info.name, p)
    # every keyword of fn other than the scores, dim and the solver's method is a param
    assert set(sig) - {"z", "dim", "method"} == set(info.params)


@pytest.mark.parametrize("info", [i for i in RECORDS if i.defaults()], ids=_ids)
def test_defaults_are_what_the_function_uses(info: maps.MapInfo) -> None:
    z = _rows(seed=1)
    base = _call_params(info)
    p_omitted = info.fn(z, **base)
    torch.testing.assert_close(p_omitted, info.fn(z, **base, **info.defaults()), rtol=0, atol=0)
    # and each parameter matters, so the comparison above could fail
    for p, default in info.defaults().items():
        other = info.fn(z, **base, **{p: default * 1.5})
        assert not torch.allclose(p_omitted, other), (info.name, p)


@pytest.mark.parametrize("info", [i for i in RECORDS if i.threshold_law is not None], ids=_ids)
def test_threshold_law_holds_row_by_row(info: maps.MapInfo) -> None:
    settings = [{"alpha": a} for a in ALPHAS] if "alpha" in info.params else [{}]
    for given in settings:
        thr = info.threshold(**given)
        assert thr == maps.threshold(info.name, given.get("alpha"))
        # scores spread on the scale of the threshold: both sides of the law occur
        z = _rows(n=4000, e=8, scale=1.5 * thr, seed=2)
        gap, runner_up = _runner_up(z, info.fn(z, **given))
        assert torch.equal(runner_up == 0, gap >= thr), (info.name, given)
        assert 0.02 < (gap >= thr).double().mean() < 0.98


@pytest.mark.parametrize("info", [i for i in RECORDS if i.threshold_law is None], ids=_ids)
def test_maps_without_a_threshold_have_none(info: maps.MapInfo) -> None:
    assert info.threshold(**_call_params(info)) is None
    assert maps.threshold(info.name) is None
    # no gap makes the runner-up 0: at gaps of 10 to 20 it still has weight
    z = _rows(n=200, e=6, scale=1.0, seed=3).clamp(-3, 0)
    z[:, 1] = 1.0
    z[:, 0] = 1.0 + torch.linspace(10, 20, 200, dtype=torch.float64)
    gap, runner_up = _runner_up(z, info.fn(z, **_call_params(info)))
    assert bool((gap >= 10).all()) and bool((runner_up > 0).all())


@pytest.mark.parametrize("info", RECORDS, ids=_ids)
def test_needs_k(info: maps.MapInfo) -> None:
    z = _rows(n=8, seed=4)
    if info.needs_k:
        with pytest.raises(TypeError, match="k"):
            info.fn(z)
        with pytest.raises(ValueError, match=f"map='{info.name}' needs k"):
            info.check_params()
        assert info.fn(z, k=K).sum(-1).allclose(torch.full((8,), K, dtype=z.dtype))
    else:
        assert info.fn(z).shape == z.shape
        assert "k" not in info.check_params()


@pytest.mark.parametrize("info", RECORDS, ids=_ids)
def test_simplex(info: maps.MapInfo) -> None:
    z = _rows(n=300, e=6, seed=5)
    z[::3, 4] = -math.inf  # masked experts
    p = info.fn(z, **_call_params(info))
    sums = p.sum(-1)
    on_simplex = bool(torch.allclose(sums, torch.ones_like(sums))) and bool((p >= 0).all())
    assert on_simplex == info.simplex


def test_unknown_names_raise_with_the_list() -> None:
    listing = (
        "available maps: softmax, sigmoid, relu, sqrtsoftplus, sparsemax, entmax, normmax, lapsum"
    )
    for call in (maps.info, maps.get, maps.threshold):
        with pytest.raises(ValueError, match=f"unknown map 'sparsmax'; {listing}"):
            call("sparsmax")


def test_check_params_messages_are_the_maps_own() -> None:
    z6 = torch.randn(3, 6)
    for name in ("entmax", "normmax"):
        for bad in (1.0, 0.5, math.inf):
            with pytest.raises(ValueError) as from_map:
                maps.get(name)(z6, alpha=bad)
            with pytest.raises(ValueError) as from_record:
                maps.info(name).check_params(alpha=bad)
            assert str(from_record.value) == str(from_map.value)
    with pytest.raises(ValueError) as from_map:
        maps.lapsum(z6, 7.0)
    with pytest.raises(ValueError) as from_record:
        maps.info("lapsum").check_params(k=7.0, n_experts=6)
    assert str(from_record.value) == str(from_map.value)
    assert "k must lie strictly between 0 and the number of experts (6)" in str(from_map.value)


def test_check_params() -> None:
    entmax, lapsum = maps.info("entmax"), maps.info("lapsum")
    assert entmax.check_params() == {"alpha": 1.5}
    assert entmax.check_params(alpha=3) == {"alpha": 3.0}
    assert lapsum.check_params(k=2) == {"k": 2.0, "temperature": 1.0}
    assert maps.info("softmax").check_params(alpha=None) == {}  # None: not given
    k_tensor = torch.tensor([1.0, 2.0])
    assert lapsum.check_params(k=k_tensor)["k"] is k_tensor  # tensors: the map checks them
    with pytest.raises(ValueError, match="alpha only applies to entmax and normmax, not softmax"):
        maps.info("softmax").check_params(alpha=1.5)
    with pytest.raises(ValueError, match="entmax takes no parameter 'beta'; its parameters: alpha"):
        entmax.check_params(beta=1.0)
    keys = {"k": "lapsum_k"}
    with pytest.raises(ValueError, match="map='lapsum' needs lapsum_k"):
        lapsum.check_params(keys=keys)
    with pytest.raises(ValueError, match="lapsum_k must lie strictly between 0 and the number"):
        lapsum.check_params(k=8.0, n_experts=8, keys=keys)
    with pytest.raises(ValueError, match="k must be a positive finite number"):
        lapsum.check_params(k=-1.0)
    with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
        lapsum.check_params(k=2.0, temperature=0.0)
    with pytest.raises(ValueError, match="alpha must be > 1"):
        entmax.bind(alpha=1.0)
    z = _rows(n=4, seed=6)
    torch.testing.assert_close(entmax.bind(alpha=1.25)(z), maps.entmax(z, alpha=1.25))


def _toy(z: torch.Tensor, scale: float = 2.0, dim: int = -1) -> torch.Tensor:
    return torch.tanh(z * scale)


TOY = maps.MapInfo("toy", _toy, "tanh of scaled scores", {"scale": maps.Param(2.0)}, simplex=False)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[maps.MapInfo]:
    """The toy map registered for one test (the registry is restored after)."""
    monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
    yield maps.register(TOY)


def test_registering_is_all_a_new_map_needs(toy: maps.MapInfo) -> None:
    from moelab.bench.maps import implementations
    from moelab.studies import tour

    assert maps.available()[-1] == "toy"
    assert maps.get("toy") is _toy and maps.info("toy") is toy
    assert maps.threshold("toy") is None
    assert toy.check_params() == {"scale": 2.0} and not toy.needs_k
    assert "toy" in [label for label, _, _ in tour.tour()]
    shown = tour.run(rows=50)["vectors"][0]["maps"]
    assert [m["map"] for m in shown if m["map"] == "toy"] == ["toy"]
    bench = dict(implementations(None))
    z = torch.randn(3, 4)
    torch.testing.assert_close(bench["moelab.toy"](z), torch.tanh(2 * z))
    # the router takes it by name, with the map's defaults
    from moelab.routing import Router, RouterConfig

    rc = RouterConfig(d_model=8, n_experts=4, top_k=2, map="toy")
    out = Router(rc).eval()(torch.randn(5, 8))
    torch.testing.assert_close(out.probs_TE, torch.tanh(2 * out.logits_TE))
    with pytest.raises(ValueError, match="alpha only applies to entmax and normmax, not toy"):
        RouterConfig(d_model=8, n_experts=4, map="toy", alpha=1.5)
    with pytest.raises(ValueError, match="registered already"):
        maps.register(TOY)
    wrong = maps.MapInfo("toy2", _toy, "a param the function lacks", {"beta": maps.Param(1.0)})
    with pytest.raises(ValueError, match="its function takes no parameter beta"):
        maps.register(wrong)


def test_the_toy_map_is_gone_after_its_test() -> None:
    assert "toy" not in maps.available()
