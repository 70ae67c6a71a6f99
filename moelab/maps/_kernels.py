"""Loading of the fused CPU kernels in ``csrc/maps_cpu.cpp``.

The kernels are compiled on first use with ``torch.utils.cpp_extension`` (about
20 s, once per kernel source, machine and environment; ``make test`` and ``make
demo`` do it up front) and cached under torch's extension directory. When they cannot be built
the maps fall back to their plain-PyTorch implementations, which are exact too,
and a warning says so. ``MOELAB_KERNELS=0`` disables the kernels; so does
``maps.use_backend("torch")``.

Build cache: the extension's name, and with it its build folder, is
:func:`extension_name`, a hash of the kernel source's bytes, the compiler flags,
this CPU's instruction-set flags and the build environment (torch's version and
folder, Python's headers, the compiler). Checkouts with the same kernel source and
environment share one build; a checkout whose source (or virtual environment)
differs gets its own, so alternating between checkouts never recompiles and no
process loads a kernel built from another source. The source is compiled from a
copy inside the build folder, so the build command is the same whichever checkout
triggered it.

``torch.compile``: the kernels are registered in C++ (``TORCH_LIBRARY(moelab_maps)``)
without a fake-tensor implementation, so a compiler cannot trace them. Once the
library loads, every op ``moelab_maps::<op>`` is wrapped in an opaque custom op
``moelab_maps_opaque::<op>`` with the same schema and a fake (meta) implementation
(:data:`FAKES`); :func:`ops` hands out the wrapped ops while
``torch.compiler.is_compiling()`` and the C++ ops directly otherwise (no wrapper
overhead in eager mode).

Build target: the machine's own (:func:`native_flag`: ``-march=native`` on x86,
``-mcpu=native`` on ARM) unless ``MOELAB_KERNEL_MARCH`` names another (``x86-64-v3``:
AVX2 without AVX-512; ``x86-64-v4``: AVX-512; any value GCC's ``-march`` takes), so that
one machine can build and test the code of another machine class (:func:`march`; it is
part of the build's cache key through the flags). :func:`build_info` says what the
loaded build is: its march, the instruction set its code uses and the kernel path per
row width. The source is portable C++ with GCC vector extensions, its vector width
chosen by the preprocessor from the target, so it builds for aarch64 too
(``python tools/check_aarch64_build.py`` cross-compiles it).

Failure: when the kernels cannot be built or loaded (no C++ compiler, a flag the
compiler refuses, a compile error), the maps take the PyTorch path and one
RuntimeWarning per process says why, with the compiler's error line; nothing raises.

``python -c "from moelab.maps import _kernels; _kernels.main()"`` builds them and
prints the backend (``make`` does this); it exits 0 on the fallback too (the install
must not fail for want of the kernels), 1 only with ``--strict``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "maps_cpu.cpp"


def native_flag(machine: str | None = None) -> str:
    """The flag that builds for this machine's own CPU: ``-mcpu=native`` on ARM
    (``aarch64``/``arm64``/``arm*``: ARM's convention, -mcpu naming the CPU for both the
    instruction set and the tuning), ``-march=native`` elsewhere.

    Args:
        machine: ``platform.machine()`` (default: this one's).
    """
    machine = (machine or platform.machine()).lower()
    return (
        "-mcpu=native"
        if machine in ("aarch64", "arm64") or machine.startswith("arm")
        else ("-march=native")
    )


_CFLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]
"""The compiler flags but the build target (:func:`cflags` adds ``-march``)."""
MARCH_ENV = "MOELAB_KERNEL_MARCH"
"""Environment variable naming the kernels' build target (``-march``; default native)."""
INFO_NAMESPACE = "moelab_maps_info"
"""Namespace of the C++ ops that describe the build (instruction set, paths)."""
NAMESPACE = "moelab_maps"
"""Namespace of the C++ ops (``TORCH_LIBRARY(moelab_maps, m)`` in maps_cpu.cpp)."""
OPAQUE_NAMESPACE = "moelab_maps_opaque"
"""Namespace of their traceable wrappers (same op names and schemas, with fakes)."""

_state: dict[str, object] = {"loaded": None, "backend": "auto", "opaque_lib": None, "march": None}


def march() -> str:
    """The kernels' build target: ``$MOELAB_KERNEL_MARCH``, else ``native``.

    Raises:
        ValueError: the value is not a plain ``-march`` name (letters, digits, ``.+_-``).
    """
    return _checked_march(os.environ.get(MARCH_ENV, ""))


def _checked_march(value: str) -> str:
    value = value.strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", value):
        raise ValueError(
            f"{MARCH_ENV} (bench maps --march) must be a -march name such as native, "
            f"x86-64-v3 or x86-64-v4, got {value!r}"
        )
    return value


def cflags() -> list[str]:
    """The compiler flags of the build: :data:`_CFLAGS` and the target, ``-march=``
    :func:`march` (for ``native``: :func:`native_flag`, ``-mcpu=native`` on ARM)."""
    target = march()
    return [*_CFLAGS, native_flag() if target == "native" else f"-march={target}"]


def _cpu_flags() -> str:
    """This CPU's instruction-set flags ('-march=native' code built on one machine
    must not be loaded on another with a smaller set)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _environment() -> str:
    """What else goes into the build command: torch's version and folder (headers and
    libraries; every virtual environment has its own), Python's headers, the compiler."""
    import sysconfig

    return "\n".join(
        [
            torch.__version__,
            str(Path(torch.__file__).resolve().parent),
            sysconfig.get_paths()["include"],
            os.environ.get("CXX", ""),
        ]
    )


def extension_name(source: bytes, cflags: Sequence[str], cpu_flags: str, environment: str) -> str:
    """Name of the compiled extension (torch derives its build folder from it): a
    hash of everything that decides the binary and its build command. Pure: compiles
    and reads nothing.

    Args:
        source: the bytes of the kernel source.
        cflags: the compiler flags.
        cpu_flags: the CPU's instruction-set flags (``-march=native``).
        environment: torch's version and install folder, Python's include folder and
            the compiler (:func:`_environment`): two checkouts with their own virtual
            environments get their own builds instead of rebuilding each other's.
    """
    h = hashlib.sha256()
    for part in (source, "\0".join(cflags).encode(), cpu_flags.encode(), environment.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return f"moelab_maps_cpu_{h.hexdigest()[:16]}"


def _stage_source(build_dir: Path, source: bytes) -> Path:
    """The kernel source as a file in the build folder (written, atomically, only when
    missing or different), so that every checkout with this source builds the same file."""
    staged = build_dir / _SOURCE.name
    if not (staged.is_file() and staged.read_bytes() == source):
        tmp = build_dir / f".{_SOURCE.name}.{os.getpid()}.tmp"
        tmp.write_bytes(source)
        os.replace(tmp, staged)
    return staged


def _check_compiler() -> None:
    """Raise RuntimeError with one line when the C++ compiler torch would call is
    missing (else torch logs a screenful about compiler compatibility first)."""
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} found (set CXX or install g++)")


def build_error_line(message: str) -> str:
    """The line of a failed build's output that says what went wrong: the compiler's
    first ``error`` line, else the message's first line (torch's build errors hold
    the whole ninja log)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith("Error building extension"):
            return line
    return lines[0] if lines else ""


def _load(verbose: bool = False) -> bool:
    """Build (or find) and load the kernels once per process; whether they loaded."""
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
        _check_compiler()
        source = _SOURCE.read_bytes()
        flags = cflags()
        name = extension_name(source, flags, _cpu_flags(), _environment())
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        staged = _stage_source(build_dir, source)
        if not (build_dir / f"{name}.so").exists():
            print(
                "moelab: compiling the CPU kernels of the maps (once per kernel source, "
                f"machine and -march={march()}, about 20 s) into {build_dir} ...",
                file=sys.stderr,
                flush=True,
            )
        cpp_extension.load(
            name=name,
            sources=[str(staged)],
            extra_cflags=flags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
        _register_opaque()
        _state["march"] = march()
        _state["loaded"] = True
    except Exception as err:
        warnings.warn(
            f"moelab: the CPU kernels of the maps could not be built ({type(err).__name__}: "
            f"{build_error_line(str(err))}); using the plain-PyTorch implementations, which "
            "are exact but slower (MOELAB_KERNELS=0 skips the build; the whole log: "
            'python -c "from moelab.maps import _kernels; _kernels.main()" -v).',
            RuntimeWarning,
            stacklevel=3,
        )
        _state["loaded"] = False
    return bool(_state["loaded"])


# -- fake (meta) implementations, for torch.compile -----------------------------------


def _fake_matrix(z: torch.Tensor) -> torch.Tensor:
    torch._check(z.dim() == 2, lambda: "moelab maps kernel: expected a 2-D (rows, n) tensor")
    return torch.empty_like(z, memory_format=torch.contiguous_format)


def _fake_status(z: torch.Tensor) -> torch.Tensor:
    return z.new_empty((z.shape[0],), dtype=torch.int32)


def _fake_sparse_forward(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_matrix(z), _fake_status(z)


def _fake_sparse_backward(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _fake_matrix(p)


def _fake_general_forward(z: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_matrix(z), _fake_status(z)


def _fake_general_backward(p: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    return _fake_matrix(p)


def _fake_lapsum_forward(
    z: torch.Tensor, k: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_matrix(z), z.new_empty((z.shape[0],)), _fake_status(z)


def _fake_lapsum_backward(
    p: torch.Tensor, g: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_matrix(p), p.new_empty((p.shape[0],))


FAKES: dict[str, Callable[..., object]] = {
    "sparsemax_forward": _fake_sparse_forward,
    "entmax15_forward": _fake_sparse_forward,
    "normmax2_forward": _fake_sparse_forward,
    "sparsemax_backward": _fake_sparse_backward,
    "entmax15_backward": _fake_sparse_backward,
    "normmax2_backward": _fake_sparse_backward,
    "entmax_forward": _fake_general_forward,
    "normmax_forward": _fake_general_forward,
    "entmax_backward": _fake_general_backward,
    "normmax_backward": _fake_general_backward,
    "lapsum_forward": _fake_lapsum_forward,
    "lapsum_backward": _fake_lapsum_backward,
}
"""Fake implementation of every op in maps_cpu.cpp: output shapes and dtypes from the
inputs' (a new op there needs its entry here; tests/maps/test_compile.py checks)."""


def kernel_op_schemas() -> dict[str, str]:
    """``{op name: schema}`` of the ops the loaded C++ library defines (empty before
    it loads)."""
    prefix = f"{NAMESPACE}::"
    return {
        str(s.name)[len(prefix) :]: str(s)[len(prefix) :]
        for s in torch._C._jit_get_all_schemas()
        if str(s.name).startswith(prefix)
    }


def _register_opaque() -> None:
    """Wrap every C++ op with a fake implementation in an opaque custom op of
    OPAQUE_NAMESPACE; ops without an entry in FAKES stay unwrapped."""
    if _state["opaque_lib"] is not None:
        return
    lib = torch.library.Library(OPAQUE_NAMESPACE, "DEF")
    for name, schema in sorted(kernel_op_schemas().items()):
        if name not in FAKES:
            continue
        lib.define(schema)
        lib.impl(name, _forwarder(name), "CPU")
        torch.library.register_fake(f"{OPAQUE_NAMESPACE}::{name}", FAKES[name], lib=lib)
    _state["opaque_lib"] = lib  # keeps the registrations alive


def _forwarder(name: str) -> Callable[..., object]:
    op = getattr(getattr(torch.ops, NAMESPACE), name)

    def kernel(*args: object) -> object:
        return op(*args)

    return kernel


# -- what the build is -------------------------------------------------------------------

PATH_OPS = ("sparsemax", "entmax15", "normmax2", "lapsum", "entmax", "normmax")
"""The kernels whose path :func:`build_info` reports (entmax and normmax: any other
alpha)."""


def target(value: str) -> bool:
    """Build this process's kernels for ``-march=value`` (sets ``MOELAB_KERNEL_MARCH``)
    when none is loaded yet; whether this process's kernels are (or will be) that build.
    False when another build is loaded already (one library per process: a subprocess
    must run the other build).

    Raises:
        ValueError: ``value`` is not a plain ``-march`` name.
    """
    wanted = _checked_march(value)
    if _state["loaded"] is None:
        os.environ[MARCH_ENV] = wanted
        return True
    return _state["march"] == wanted


def cpu_model() -> str:
    """This CPU's model name (``model name`` in /proc/cpuinfo, else the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model name")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine() or "unknown"


def build_info(widths: Sequence[int] = (), itemsize: int = 4) -> dict[str, object]:
    """What the kernels in this process are built for, and the path they take.

    Args:
        widths: row widths n (numbers of experts) to report the kernel paths of.
        itemsize: 4 (float32) or 8 (float64).

    Returns:
        ``{"cpu", "march", "isa", "vector_bits", "paths"}``: the CPU model, the build
        target (``-march``; None when the kernels are not loaded), the widest
        instruction set the build's code uses (``avx512``, ``avx2``, ``neon``, ...;
        None when not loaded), the bits of the kernels' vector types, and
        ``paths[str(n)][op] = "<forward> <backward>"`` (see ``paths`` in
        maps_cpu.cpp: ``lanes16`` a block of 16 rows across a vector's lanes,
        ``row16`` along the row in 16-lane vectors, ``row-scalar`` along the row,
        the compiler's own vectorisation; ``torch`` when the kernels are not in use).
    """
    info: dict[str, object] = {"cpu": cpu_model(), "march": None, "isa": None}
    info["vector_bits"] = None
    if backend() != "cpu-kernels":
        info["paths"] = {str(n): dict.fromkeys(PATH_OPS, "torch") for n in widths}
        return info
    lib = getattr(torch.ops, INFO_NAMESPACE)
    info["march"] = _state["march"]
    info["isa"] = lib.isa()
    info["vector_bits"] = 8 * lib.vector_bytes()
    info["paths"] = {
        str(n): {op: lib.paths(op, int(n), itemsize) for op in PATH_OPS} for n in widths
    }
    return info


# -- backend selection ------------------------------------------------------------------


def use_kernels(z: torch.Tensor) -> bool:
    """Whether a map call on ``z`` takes the fused CPU kernel."""
    if _state["backend"] == "torch":
        return False
    if z.device.type != "cpu" or z.dtype not in (torch.float32, torch.float64):
        return False
    loaded = _state["loaded"]
    if loaded is None:
        # NOTE: building and registering ops cannot be traced: a first call under
        # torch.compile runs the loader eagerly (a graph break, once), later traces see
        # its result. (Decorating _load itself would import torch._dynamo, seconds, on
        # every import of moelab.maps.)
        return torch.compiler.disable(_load)() if torch.compiler.is_compiling() else _load()
    return bool(loaded)


def ops() -> object:
    """The kernels' op namespace: the C++ ops, or their opaque wrappers (which a
    compiler can trace) while ``torch.compiler.is_compiling()``."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops, OPAQUE_NAMESPACE)
    return getattr(torch.ops, NAMESPACE)


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
    """Build the kernels now (verbosely with -v) and say which backend the maps use.
    Exits 0 on the PyTorch fallback too (after its warning), 1 only with --strict."""
    ok = _load(verbose="-v" in sys.argv)
    info = build_info()
    print(
        f"moelab maps backend: {backend()} (march={info['march']}, isa={info['isa']}, "
        f"cpu: {info['cpu']})"
    )
    if not ok and "--strict" in sys.argv:
        sys.exit(1)
