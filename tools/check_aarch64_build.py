"""Cross-compile the maps' CPU kernels (moelab/maps/csrc/maps_cpu.cpp) for aarch64.

Compile only (``-c``): the source against the installed torch's headers, with the flags
moelab/maps/_kernels.py builds with, the machine's own target (``-mcpu=native`` on
ARM, which a cross compiler cannot take) replaced by a fixed one (``--target``,
default ``armv8-a``: every 64-bit ARM CPU; ``armv8.2-a`` for Graviton 2 and later,
Apple silicon). Linking and running need an aarch64 build of torch, which an x86
machine does not have.

    apt-get install g++-aarch64-linux-gnu      # Debian / Ubuntu
    python tools/check_aarch64_build.py [--cxx aarch64-linux-gnu-g++] [--target armv8-a]
                                        [--source moelab/maps/csrc/maps_cpu.cpp]

Prints the command, the compiler's output and the result; exits 0 when the object
file was built, 1 when the compiler failed, 2 when the cross compiler is missing.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from moelab.maps import _kernels


def command(cxx: str, target: str, out: Path, source: Path = _kernels._SOURCE) -> list[str]:
    """The compile-only command: _kernels' flags with ``-march=<target>`` for the
    native flag, and the defines and include folders torch's extension build uses."""
    # (whether or not _CFLAGS holds the build target: any -march/-mcpu is replaced)
    flags = [f for f in _kernels._CFLAGS if not f.startswith(("-march=", "-mcpu="))]
    flags.append(f"-march={target}")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [
        cxx,
        "-c",
        str(source),
        "-o",
        str(out),
        "-std=c++17",
        "-fPIC",
        "-Wall",
        *flags,
        "-DTORCH_EXTENSION_NAME=moelab_maps_cpu",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *[arg for path in includes for arg in ("-isystem", path)],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cxx", default="aarch64-linux-gnu-g++")
    parser.add_argument("--target", default="armv8-a", help="-march value (default armv8-a)")
    parser.add_argument("--source", type=Path, default=_kernels._SOURCE, help="kernel source")
    args = parser.parse_args(argv)
    if shutil.which(args.cxx) is None:
        print(f"cross compiler {args.cxx!r} not found: apt-get install g++-aarch64-linux-gnu")
        return 2
    version = subprocess.run([args.cxx, "--version"], capture_output=True, text=True)
    print(version.stdout.splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "maps_cpu.o"
        cmd = command(args.cxx, args.target, out, args.source)
        print(" ".join(cmd))
        start = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(run.stdout + run.stderr, end="")
        if run.returncode != 0 or not out.exists():
            print(f"FAILED: exit {run.returncode} after {seconds:.0f} s")
            return 1
        objdump = shutil.which(args.cxx.replace("g++", "objdump"))
        kind = ""
        if objdump:
            head = subprocess.run([objdump, "-f", str(out)], capture_output=True, text=True)
            kind = next((ln for ln in head.stdout.splitlines() if "file format" in ln), "")
            kind = " (" + kind.split("file format")[-1].strip() + ")"
        print(f"OK: {out.stat().st_size} bytes of object code{kind} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
