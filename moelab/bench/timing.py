"""Timing shared by the benchmarks: medians of wall-clock time, after warm-up."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

SIGNIFICANT = 4
"""Significant digits of a measured bench figure (a time, a rate, a ratio, a share): a
timing is noisy beyond them, and a fixed number of decimals would lose the digits of a
small figure (1.5239 GFLOP/s on a slow machine is not 1.52) or keep noise in a large one."""


def significant(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` rounded to ``digits`` significant digits (0, NaN and infinities unchanged):
    within half a unit of its last digit, a relative error of at most
    ``0.5 * 10 ** (1 - digits)``."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    Timings on a shared machine are noisy: compare implementations as ratios
    measured in the same run, never as absolute numbers across runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def fwd_and_fwdbwd(
    forward: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    x: torch.Tensor,
    repeats: int,
    warmup: int,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """Median ms of ``forward(x)`` under no_grad, and of forward plus the backward of the
    sum of its output with respect to ``x`` (and ``params``, whose grads are cleared).
    On a CUDA ``device`` the calls run under autocast to ``dtype`` (bf16 / fp16) and a
    device synchronisation closes every timed call."""
    cuda = device is not None and device.type == "cuda"
    autocast = cuda and dtype in (torch.bfloat16, torch.float16)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def fwd() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype, enabled=autocast):
            forward(x)
        sync()

    def fwdbwd() -> None:
        xr = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype, enabled=autocast):
            out = forward(xr)
        out.float().sum().backward()
        for p in params:
            p.grad = None
        sync()

    return median_ms(fwd, repeats, warmup), median_ms(fwdbwd, repeats, warmup)


def ratio_rows(timed: dict[str, tuple[float, float]], reference: str, shape: str) -> list[dict]:
    """The JSON rows of one shape: (fwd ms, fwd+bwd ms) per implementation, each with its
    ratio to the ``reference`` implementation's time for the same pass."""
    ref = timed[reference]
    return [
        {
            "impl": name,
            "shape": shape,
            "pass": p,
            "ms": significant(ms[j]),
            "ratio": significant(ms[j] / ref[j]),
        }
        for name, ms in timed.items()
        for j, p in enumerate(("fwd", "fwdbwd"))
    ]


def pass_tables(result: dict, first_column: str, ratio_to: str) -> str:
    """One Markdown table per pass: implementations down, shapes across, "ms (ratio)"
    cells, then the notes."""
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
    cell = {(r["impl"], r["shape"], r["pass"]): r for r in result["rows"]}
    out = [f"threads={result['threads']}  torch={result['torch']}  (ratio = time / {ratio_to})"]
    for p, title in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        out += ["", f"{title}:", f"| {first_column} | " + " | ".join(shapes) + " |"]
        out.append("|:--|" + "--:|" * len(shapes))
        for impl in impls:
            vals = []
            for s in shapes:
                r = cell.get((impl, s, p))
                vals.append(f"{r['ms']:.1f} ms ({r['ratio']:.2f}x)" if r else "-")
            out.append(f"| {impl} | " + " | ".join(vals) + " |")
    out += [""] + [f"note: {n}" for n in result["notes"]]
    return "\n".join(out)


@contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (unchanged for None).

    Raises:
        ValueError: ``threads`` below 1 (torch's own RuntimeError is no user message).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(previous)
