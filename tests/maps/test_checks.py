"""One policy for input checks: host-read checks run in eager mode, can be
switched off (no host read at all then), and are skipped under torch.compile,
where the solver loops run a fixed number of steps without a host read."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from moelab import maps
from moelab.maps._core import newton_threshold

from .conftest import ALL, MapSpec


@pytest.fixture
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every read of a tensor value on the host raise."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host read of a tensor value")

    with monkeypatch.context() as m:
        for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
            m.setattr(torch.Tensor, name, refuse)
        yield


def test_switch_and_context_manager() -> None:
    assert maps.checks_enabled()
    with maps.checks(False):
        assert not maps.checks_enabled()
        with maps.checks(True):
            assert maps.checks_enabled()
        assert not maps.checks_enabled()
    assert maps.checks_enabled()
    with pytest.raises(RuntimeError), maps.checks(False):
        raise RuntimeError  # restored on the way out of an exception too
    assert maps.checks_enabled()
    maps.set_checks(False)
    try:
        assert not maps.checks_enabled()
    finally:
        maps.set_checks(True)


@pytest.mark.parametrize("spec", ALL, ids=str)
def test_checks_off_skips_the_value_checks(spec: MapSpec, backend: str) -> None:
    z = torch.randn(3, 6)
    z[1, 2] = math.nan
    z[2] = -math.inf
    with pytest.raises(ValueError):
        spec.fn(z)
    with maps.checks(False):
        p = spec.fn(z)  # garbage in, garbage out, but no error and no host read
    assert p.shape == z.shape
    torch.testing.assert_close(p[0], spec.fn(z[:1])[0])  # good rows are unaffected


def test_checks_off_keeps_plain_number_checks() -> None:
    with maps.checks(False):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            maps.lapsum(torch.randn(2, 4), 2.0, math.inf)
        with pytest.raises(ValueError, match="k must lie strictly between"):
            maps.lapsum(torch.randn(2, 4), 4.0)
        with pytest.raises(ValueError, match="alpha must be a finite number"):
            maps.entmax(torch.randn(2, 4), math.inf)


NO_LOOP = {
    "softmax": maps.softmax,
    "sigmoid": maps.sigmoid,
    "relu": maps.relu,
    "sqrtsoftplus": maps.sqrtsoftplus,
    "sparsemax": maps.sparsemax,
    "entmax1.5": lambda z: maps.entmax(z, 1.5),
    "normmax2": lambda z: maps.normmax(z, 2.0),
    "lapsum": lambda z: maps.lapsum(z, 2.5, 0.5),
    "lapsum-tensor-k-t": lambda z: maps.lapsum(z, torch.tensor([1.0, 2.0, 3.0]), torch.tensor(0.5)),
}


@pytest.mark.parametrize("name", list(NO_LOOP))
def test_checks_off_reads_nothing_on_the_host(name: str, backend: str, no_host_reads) -> None:
    # the maps without a solver loop (and LapSum through the kernel) make no host
    # read at all with checks off: forward and backward
    if backend == "torch" and name.startswith("lapsum"):
        pytest.skip("LapSum's PyTorch split iteration stops early on a host read in eager mode")
    fn = NO_LOOP[name]
    z = torch.randn(3, 6, requires_grad=True)
    with maps.checks(False):
        fn(z).sum().backward()
    with pytest.raises(AssertionError, match="host read"):
        fn(z)  # checks on: the same call reads values on the host


# ---- torch.compile (PyTorch backend; the kernels' fake implementations are tested
# elsewhere) ------------------------------------------------------------------

COMPILED = {
    "softmax": maps.softmax,
    "sigmoid": maps.sigmoid,
    "relu": maps.relu,
    "sqrtsoftplus": maps.sqrtsoftplus,
    "sparsemax": maps.sparsemax,
    "entmax1.5": lambda z: maps.entmax(z, 1.5),
    "normmax2": lambda z: maps.normmax(z, 2.0),
    "lapsum": lambda z: maps.lapsum(z, 1.5, 0.5),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiles_without_graph_breaks(name: str) -> None:
    fn = COMPILED[name]
    z = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with maps.use_backend("torch"):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")  # graph breaks raise
        zc = z.clone().requires_grad_(True)
        ze = z.clone().requires_grad_(True)
        out = compiled(zc)
        expected = fn(ze)
        torch.testing.assert_close(out, expected)
        w = torch.randn(3, 4, dtype=torch.float64)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        torch.testing.assert_close(zc.grad, ze.grad)
        bad = z.clone()
        bad[0, 0] = math.nan
        compiled(bad)  # the value checks are skipped under compile: no error, no graph break


@pytest.mark.parametrize("power", [0.5, 2.0])
def test_newton_threshold_compiles_with_a_fixed_bound(power: float) -> None:
    # the iterative maps' solver: no host read under compile, all max_iter steps
    y = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = y - y.amax(-1, keepdim=True)
    torch._dynamo.reset()
    solve = torch.compile(newton_threshold, fullgraph=True, backend="eager")
    tau = solve(y, power, max_iter=60)
    expected = newton_threshold(y, power, max_iter=60)
    torch.testing.assert_close(tau, expected, atol=1e-12, rtol=0)
    total = (y - tau).clamp_min(0).pow(power).sum(-1)
    torch.testing.assert_close(total, torch.ones(5, dtype=torch.float64))
