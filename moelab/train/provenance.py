"""What a run ran on: versions, the source checkout, the device, the CPU and threads.

Float results depend on the machine and on the thread count (the order of a sum's
terms changes with both), so a run's trajectory is reproducible only where these
match; the training loop records them in ``config.json`` under ``"run_info"`` (and each
resumption under ``"run_info"]["resumes"]``), next to the ``threads`` setting.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_info", "git_commit", "run_info"]

SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "neon",
    "asimd",
    "sve",
    "sve2",
)
"""The CPU flags that decide which vector kernels run (x86 and Arm names)."""


def git_commit(folder: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout that holds the moelab
    package (or ``folder``), or None when it is not tracked by git (an installed
    package, no git at hand). ``dirty``: tracked files differ from the commit."""
    here = Path(folder) if folder is not None else Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # NOTE: the package's own files must be tracked: a package installed into a
    # virtual environment inside some other repository is not that repository's code
    if git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None
    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no", ".")
    return {"commit": commit, "dirty": bool(status)}


def cpu_info() -> dict[str, Any]:
    """The CPU's model name, the vector flags of :data:`SIMD_FLAGS` it has (from
    /proc/cpuinfo where there is one) and the kernel set torch picked
    (``torch.backends.cpu.get_cpu_capability()``, e.g. "AVX2")."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    info: dict[str, Any] = {
        "model": model,
        "arch": platform.machine(),
        "flags": [f for f in SIMD_FLAGS if f in flags],
    }
    try:
        info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # NOTE: older torch has no such call
        pass
    return info


def run_info(device: torch.device, threads: int, world_size: int = 1) -> dict[str, Any]:
    """The provenance of a run started now: moelab, torch and Python versions, the git
    commit of a checkout (None when installed), the device (with the GPU's name), the
    CPU, the intra-op thread count and the number of ranks."""
    from moelab import __version__

    info: dict[str, Any] = {
        "moelab": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git": git_commit(),
        "device": str(device),
        "cpu": cpu_info(),
        "threads": threads,
        "world_size": world_size,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info
