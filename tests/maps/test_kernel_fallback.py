"""When the CPU kernels cannot be built, the maps take the PyTorch path: one
RuntimeWarning per process, with the compiler's error line, and no exception, at
first use and from the install-time build (``_kernels.main``, which ``make`` runs).

Failures simulated: no C++ compiler (``CXX`` naming a missing program), and a flag
the compiler refuses (a real build, in a subprocess with its own extension folder).
Also: the build target flag per machine (``-mcpu=native`` on ARM).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moelab import maps
from moelab.maps import _kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader as in a new process (restored afterwards)."""
    monkeypatch.setitem(_kernels._state, "loaded", None)
    monkeypatch.setitem(_kernels._state, "backend", "auto")
    monkeypatch.delenv("MOELAB_KERNELS", raising=False)


def _calls() -> torch.Tensor:
    z = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    p = maps.sparsemax(z, dim=-1)
    (p * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    maps.entmax(z.detach(), 1.5)
    maps.lapsum(z.detach(), 2.0, temperature=0.5)
    return p


def test_missing_compiler_falls_back_with_one_warning(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/moelab-test-g++")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = _calls()
        _calls()
        assert maps.backend() == "torch"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "/nonexistent/moelab-test-g++" in msgs[0] and "\n" not in msgs[0]
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=torch.float64))


def test_build_error_line_picks_the_compiler_error() -> None:
    log = (
        "Error building extension 'moelab_maps_cpu_0': [1/2] c++ -MMD -O3 -mfoo x.cpp\n"
        "FAILED: maps_cpu.o\n"
        "c++: error: unrecognized command-line option '-mfoo'\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert _kernels.build_error_line(log) == "c++: error: unrecognized command-line option '-mfoo'"
    assert _kernels.build_error_line("just one line\nand more") == "just one line"


def test_native_flag_per_machine() -> None:
    assert _kernels.native_flag("x86_64") == "-march=native"
    assert _kernels.native_flag("aarch64") == "-mcpu=native"
    assert _kernels.native_flag("arm64") == "-mcpu=native"


_BAD_FLAG_RUN = """
import warnings
from moelab.maps import _kernels
_kernels._CFLAGS = [*_kernels._CFLAGS, "-mmoelab-no-such-flag"]
import torch
from moelab import maps
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    p = maps.sparsemax(torch.tensor([[1.0, 0.2, -1.0]], requires_grad=True), dim=-1)
    p.sum().backward()
    maps.entmax(torch.randn(4, 6), 1.5)
msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
print(len(msgs), maps.backend(), [round(v, 6) for v in p.detach()[0].tolist()])
print(msgs[0] if msgs else "")
_kernels.main()
"""


def test_rejected_flag_falls_back_with_one_warning(tmp_path: Path) -> None:
    """A real build that the compiler refuses: the first use and the install-time
    ``_kernels.main()`` both fall back; main exits 0."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("MOELAB_KERNELS", None)
    run = subprocess.run(
        [sys.executable, "-c", _BAD_FLAG_RUN],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    count, backend, p = run.stdout.splitlines()[0].split(" ", 2)
    assert (count, backend) == ("1", "torch"), run.stdout
    assert p == "[0.9, 0.1, 0.0]", run.stdout
    assert "-mmoelab-no-such-flag" in run.stdout.splitlines()[1]
    assert "moelab maps backend: torch" in run.stdout
