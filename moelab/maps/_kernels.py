"""Loading of the fused CPU kernels in ``csrc/maps_cpu.cpp``.

The kernels are compiled on first use with ``torch.utils.cpp_extension`` (about
15 s, once per machine; ``make test`` and ``make demo`` do it up front) and
cached under torch's extension directory. When they cannot be built the maps
fall back to their plain-PyTorch implementations, which are exact too, and a
warning says so. ``MOELAB_KERNELS=0`` disables the kernels; so does
``maps.use_backend("torch")``.

``python -c "from moelab.maps import _kernels; _kernels.main()"`` builds them and
prints the backend (``make`` does this).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "maps_cpu.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]

_state: dict[str, object] = {"loaded": None, "backend": "auto"}


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction set: '-march=native' code built on
    one machine must not be loaded on another with a smaller one."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha1((flags + " ".join(_CFLAGS)).encode()).hexdigest()[:10]


def _load(verbose: bool = False) -> bool:
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    if os.environ.get("MOELAB_KERNELS", "1") == "0":
        _state["loaded"] = False
        return False
    try:
        from torch.utils import cpp_extension

        try:  # the ninja wheel's binary, whether or not the venv is on PATH
            import ninja  # type: ignore[import-untyped]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        name = f"moelab_maps_cpu_{_cpu_tag()}"
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        if not (build_dir / f"{name}.so").exists():
            print(
                "moelab: compiling the CPU kernels of the maps (once, about 15 s) ...",
                file=sys.stderr,
                flush=True,
            )
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            is_python_module=False,
            verbose=verbose,
        )
        _state["loaded"] = True
    except Exception as err:
        warnings.warn(
            f"moelab: the CPU kernels of the maps could not be built ({type(err).__name__}: "
            f"{err}); using the plain-PyTorch implementations, which are exact but slower.",
            RuntimeWarning,
            stacklevel=3,
        )
        _state["loaded"] = False
    return bool(_state["loaded"])


def use_kernels(z: torch.Tensor) -> bool:
    """Whether a map call on ``z`` takes the fused CPU kernel."""
    if _state["backend"] == "torch":
        return False
    if z.device.type != "cpu" or z.dtype not in (torch.float32, torch.float64):
        return False
    return _load()


def ops() -> object:
    return torch.ops.moelab_maps


def backend() -> str:
    """'cpu-kernels' when CPU tensors go through the fused kernels, else 'torch'."""
    if _state["backend"] == "torch":
        return "torch"
    return "cpu-kernels" if _load() else "torch"


def set_backend(name: str) -> None:
    """'auto' (fused kernels for CPU float32/float64 when they build) or 'torch'."""
    if name not in ("auto", "torch"):
        raise ValueError(f"backend must be 'auto' or 'torch', got {name!r}")
    _state["backend"] = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_backend`."""
    before = _state["backend"]
    set_backend(name)
    try:
        yield
    finally:
        _state["backend"] = before


def main() -> None:
    """Build the kernels now (verbosely with -v) and say which backend the maps use."""
    ok = _load(verbose="-v" in sys.argv)
    print(f"moelab maps backend: {backend()}")
    if not ok:
        sys.exit(1)
