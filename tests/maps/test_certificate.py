"""maps.certificate: the compiled path's fixed-count solvers, with a per-row flag that
says whether every iteration met its stopping rule. Checked against float64 answers:
a certified row is right, the known hard rows are not certified, and starving the
counts withdraws the certificate."""

from __future__ import annotations

import importlib

import pytest
import torch

from moelab import maps
from moelab.maps import _core

lapsum_module = importlib.import_module("moelab.maps.lapsum")

ITERATIVE = [
    ("entmax", {"alpha": 1.05}),
    ("entmax", {"alpha": 1.3}),
    ("entmax", {"alpha": 3.0}),
    ("entmax", {"alpha": 10.0}),
    ("normmax", {"alpha": 1.5}),
    ("normmax", {"alpha": 3.0}),
    ("lapsum", {"k": 2.0}),
    ("lapsum", {"k": 5.5, "temperature": 0.1}),
]
CLOSED_FORM = [("softmax", {}), ("sparsemax", {}), ("entmax", {"alpha": 1.5}),
               ("normmax", {"alpha": 2.0})]  # fmt: skip


def _scores(n: int, scale: float, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, n, generator=gen, dtype=dtype) * scale


def _error(name: str, z: torch.Tensor, p: torch.Tensor, params: dict) -> torch.Tensor:
    """Per row, the largest distance of p from the map in float64 (eager)."""
    ref = maps.get(name)(z.double(), **params)
    return (p.double() - ref).abs().amax(-1)


@pytest.mark.parametrize(("name", "params"), ITERATIVE + CLOSED_FORM)
@pytest.mark.parametrize("n", [8, 64, 257])
def test_ordinary_scores_are_certified_and_right(name: str, params: dict, n: int) -> None:
    for scale in (0.1, 1.0, 10.0):
        z = _scores(n, scale, seed=n)
        p, ok = maps.certificate(name, z, **params)
        assert ok.shape == (32,) and ok.dtype == torch.bool
        assert bool(ok.all()), f"{name} {params} n={n} scale={scale}: {ok}"
        assert float(_error(name, z, p, params).max()) < 1e-5


def test_the_known_hard_rows_are_not_certified() -> None:
    """entmax at alpha = 3 in float32 over 1024 scores 1e-6 apart: the compiled form's
    two frames miss the support on most rows (errors up to 5.6e-4). Every row more
    than 1e-6 off is refused a certificate; the certified ones are right."""
    gen = torch.Generator().manual_seed(300)
    z = torch.randn(16, 1024, generator=gen) * 1e-6
    p, ok = maps.certificate("entmax", z, alpha=3.0)
    err = _error("entmax", z, p, {"alpha": 3.0})
    assert int((~ok).sum()) >= 8  # most rows are hard
    assert bool((err[ok] < 1e-6).all()), err[ok]
    assert bool((err > 1e-6).le(~ok).all())  # no wrong row certified


def test_too_few_steps_withdraw_the_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    z = _scores(64, 2.0, seed=1)
    monkeypatch.setattr(_core, "COMPILED_NEWTON_STEPS", 1)
    p, ok = maps.certificate("entmax", z, alpha=1.3)
    assert not bool(ok.all())
    err = _error("entmax", z, p, {"alpha": 1.3})
    assert bool((err[ok] < 1e-5).all())  # what is still certified is right
    assert float(err[~ok].max()) > 1e-5  # and what is not, is off
    monkeypatch.setattr(_core, "COMPILED_NEWTON_STEPS", 32)
    monkeypatch.setattr(lapsum_module, "FIXED_ROUNDS", 0)
    _, ok = maps.certificate("lapsum", z, k=2.0)
    assert not bool(ok.any())  # no round: no split confirmed


def test_too_few_frame_steps_withdraw_the_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """entmax at alpha > 2 solves every row in the offset form's frames: one Newton step
    per frame leaves some rows short (0.18 off), which lose their certificate."""
    z = _scores(64, 1.0, seed=2)
    monkeypatch.setattr(_core, "COMPILED_FRAME_STEPS", 1)
    p, ok = maps.certificate("entmax", z, alpha=10.0)
    err = _error("entmax", z, p, {"alpha": 10.0})
    assert 0 < int((~ok).sum()) < 32
    assert bool((err[ok] < 1e-6).all()) and float(err[~ok].max()) > 1e-3


def test_shape_dim_and_bad_rows() -> None:
    z = _scores(16, 1.0, seed=3).reshape(4, 8, 16).transpose(1, 2)  # experts on dim 1
    z = z.clone()
    z[2, :, 5] = float("nan")
    p, ok = maps.certificate("entmax", z, dim=1, alpha=1.3)
    assert p.shape == z.shape and ok.shape == (4, 8)
    assert not bool(ok[2, 5]) and int((~ok).sum()) == 1  # the NaN row alone
    with pytest.raises(ValueError, match=r"unknown map .nomap.; available maps: softmax"):
        maps.certificate("nomap", z)


def test_the_certified_output_is_the_compiled_paths() -> None:
    """p is what the fixed-count solvers give: the same as the solvers run with the
    compiled branches (the test of test_compile_torch_path's kind)."""
    z = _scores(64, 1.0, seed=4)
    p, _ = maps.certificate("entmax", z, alpha=1.3)
    with maps.use_backend("torch"), _core.fixed_counts():
        again = maps.entmax(z, 1.3)
    assert torch.equal(p, again)
    assert not _core.compiling()  # the context is left
