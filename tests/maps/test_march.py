"""The kernels' build target (``MOELAB_KERNEL_MARCH``, :func:`moelab.maps._kernels.march`)
and what a build reports of itself (:func:`~moelab.maps._kernels.build_info`).

On an x86 machine, ``test_build_for_target_against_float64`` builds the kernels for
``x86-64-v3`` (AVX2 without AVX-512: 32-byte vectors) and for ``x86-64`` (SSE2: 16-byte
vectors, the width an ARM build takes) in subprocesses and runs the kernels' float64
reference tests on each (forward and backward, every width their paths split on, flat
rows included), so that an AVX-512 machine tests the other builds' code too (and an AVX2
machine the SSE2 build's). Each build takes 20-60 s on two cores the first time (cached
afterwards), so they are marked ``multiprocess``: `make test-multiprocess` (and CI after
`make test`) runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moelab import maps
from moelab.maps import _kernels

ROOT = Path(__file__).resolve().parents[2]
# the kernels' float64 reference tests, through the kernels only (the torch backend's
# half of each is the same code on every build)
REFERENCE_TESTS = [
    "tests/maps/test_march.py::test_loaded_build_is_the_forced_target",
    "tests/maps/test_sparse_kernels.py",
    "tests/maps/test_lapsum.py",
    "tests/maps/test_flat_rows.py",
    "tests/maps/test_general_alpha_kernels.py",
]


def test_march_defaults_to_native_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(_kernels.MARCH_ENV, raising=False)
    assert _kernels.march() == "native"
    assert _kernels.cflags()[-1] == "-march=native"
    monkeypatch.setenv(_kernels.MARCH_ENV, " x86-64-v3 ")
    assert _kernels.march() == "x86-64-v3"
    assert "-march=x86-64-v3" in _kernels.cflags()
    assert not any(f == "-march=native" for f in _kernels.cflags())
    for bad in ("native -O0", "$(id)", "-march=x86-64"):
        monkeypatch.setenv(_kernels.MARCH_ENV, bad)
        with pytest.raises(ValueError, match=r"MOELAB_KERNEL_MARCH .* must be a -march name"):
            _kernels.march()


def test_march_is_part_of_the_build_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    source, cpu, env = b"kernel", "flags : avx2 avx512f", "torch"
    names = set()
    for value in ("native", "x86-64-v3", "x86-64-v4"):
        monkeypatch.setenv(_kernels.MARCH_ENV, value)
        names.add(_kernels.extension_name(source, _kernels.cflags(), cpu, env))
    assert len(names) == 3


def test_build_info_names_the_cpu_target_and_paths() -> None:
    info = _kernels.build_info(widths=(8, 64, 128))
    assert isinstance(info["cpu"], str) and info["cpu"]
    assert set(info["paths"]) == {"8", "64", "128"}
    for ops in info["paths"].values():
        assert set(ops) == set(_kernels.PATH_OPS)
    if maps.backend() != "cpu-kernels":
        assert info["march"] is None and info["isa"] is None
        return
    assert info["march"] == _kernels.march()
    assert info["isa"] in ("avx512", "avx2", "avx", "sse2", "sve", "neon", "generic")
    # the kernels' vectors are the instruction set's registers (no wider: see kVecBytes)
    assert info["vector_bits"] == {"avx512": 512, "avx2": 256}.get(info["isa"], 128)
    # every path string is "<forward> <backward>"
    for ops in info["paths"].values():
        for path in ops.values():
            assert len(path.split()) == 2
    # float32 sparsemax: by blocks of rows at 8 experts, along the row at 128
    assert info["paths"]["8"]["sparsemax"].startswith("lanes")
    assert info["paths"]["128"]["sparsemax"].startswith("row")


def test_loaded_build_is_the_forced_target() -> None:
    """The kernels loaded are the build for $MOELAB_KERNEL_MARCH (native when unset; in
    test_build_for_target_against_float64's subprocesses, x86-64-v3 or x86-64)."""
    forced = os.environ.get(_kernels.MARCH_ENV, "").strip() or "native"
    if maps.backend() != "cpu-kernels":
        assert forced == "native", "a forced build target must build"
        return
    info = _kernels.build_info()
    assert info["march"] == forced
    want = {"x86-64-v3": ("avx2", 256), "x86-64": ("sse2", 128), "x86-64-v4": ("avx512", 512)}
    if forced in want:
        assert (info["isa"], info["vector_bits"]) == want[forced]


# build target, the instruction set its code must use, the CPU flags it needs
TARGETS = [
    ("x86-64-v3", "avx2", ("avx2", "fma")),  # 32-byte vectors: AVX2 machines
    ("x86-64", "sse2", ("sse2",)),  # 16-byte vectors: the width ARM's NEON build takes too
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("target", "isa", "needs"), TARGETS, ids=[t[0] for t in TARGETS])
def test_build_for_target_against_float64(target: str, isa: str, needs: tuple[str, ...]) -> None:
    flags = _kernels._cpu_flags().split()
    if not all(f in flags for f in needs):
        pytest.skip(f"{target} code needs an x86 CPU with {', '.join(needs)}")
    env = {**os.environ, _kernels.MARCH_ENV: target, "MOELAB_KERNELS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    info = subprocess.run(
        [sys.executable, "-c", "import json; from moelab.maps import _kernels; "
         "print(json.dumps(_kernels.build_info(widths=(8, 128))))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    built = json.loads(info.stdout.strip().splitlines()[-1])
    assert (built["march"], built["isa"]) == (target, isa), built
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not torch",
         *REFERENCE_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
