"""Speed of the maps' PyTorch path compiled with ``torch.compile`` against eager mode.

The PyTorch path is the one a CUDA tensor takes; on the CPU it is forced with
``maps.use_backend("torch")`` (the fused CPU kernels are not timed here: see
:mod:`moelab.bench.maps`). For every number of experts ``E`` the benchmark draws
float32 scores ``x`` of shape ``(rows, E)`` (``randn * 2``) and an upstream gradient
``g``, and times a forward and backward pass (``y = f(x)``, ``y.backward(g)``) of each
map eagerly and compiled (``torch.compile(f, fullgraph=True)``, static shapes): the
median of ``repeats`` timed calls after ``warmup`` untimed ones, on CUDA with a
device synchronisation closing every call. The first compiled call, which compiles
the forward and the backward graph, is timed on its own (``compile_s``).

``torch.softmax`` is timed the same way, eager and compiled; every ratio is over its
eager time for the same shape.

    >>> from moelab.bench.maps_compile import run, format_table
    >>> print(format_table(run(rows=16384, experts=(16, 64))))
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moelab import maps
from moelab.bench.timing import num_threads, significant
from moelab.train.provenance import cpu_info

__all__ = ["GENERAL", "IMPLEMENTATIONS", "REFERENCE", "format_table", "run"]

Map = Callable[[torch.Tensor], torch.Tensor]

REFERENCE = "torch.softmax"
"""The implementation every ratio is relative to (its eager time)."""

IMPLEMENTATIONS: dict[str, Map] = {
    REFERENCE: lambda x: torch.softmax(x, -1),
    "moelab.softmax": lambda x: maps.softmax(x),
    "moelab.sparsemax": lambda x: maps.sparsemax(x),
    "moelab.entmax15": lambda x: maps.entmax(x, 1.5),
    "moelab.normmax2": lambda x: maps.normmax(x, 2.0),
    "moelab.lapsum(k=2)": lambda x: maps.lapsum(x, 2.0),
}
"""The maps timed by default, by name (lapsum is skipped for E <= 2)."""

GENERAL: dict[str, Map] = {
    "moelab.entmax(1.3)": lambda x: maps.entmax(x, 1.3),
    "moelab.normmax(3)": lambda x: maps.normmax(x, 3.0),
}
"""The iterative solvers of general alpha (``general=True``): their fixed Newton
iterations make graphs of thousands of nodes, which take minutes to compile on a CPU."""


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """Median milliseconds of ``repeats`` calls after ``warmup`` ones, synchronising the
    device around every call on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return median_ms


def _fwdbwd(f: Map, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        f(x.detach().requires_grad_()).backward(g)

    return step


def _compiled(
    f: Map,
    x: torch.Tensor,
    g: torch.Tensor,
    backend: str,
    median_ms: Callable[[Callable[[], object], int, int], float],
    repeats: int,
    warmup: int,
) -> tuple[float, float]:
    """``f`` compiled (fullgraph, static shapes): the seconds of its first forward+backward
    call, compiling included, and the median ms of its timed calls."""
    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    _fwdbwd(compiled, x, g)()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    return compile_s, median_ms(_fwdbwd(compiled, x, g), repeats, warmup)


def _row(
    name: str,
    shape: str,
    eager_ms: float,
    compiled_ms: float,
    compile_s: float,
    ref_ms: float | None,
) -> dict[str, Any]:
    """One row of :func:`run`'s table; the ratios are NaN without the reference's time."""

    def ratio(ms: float) -> float:
        return significant(ms / ref_ms) if ref_ms else float("nan")

    return {
        "impl": name,
        "shape": shape,
        "eager_ms": significant(eager_ms),
        "compiled_ms": significant(compiled_ms),
        "speedup": significant(eager_ms / compiled_ms),
        "compile_s": significant(compile_s),
        "eager_ratio": ratio(eager_ms),
        "compiled_ratio": ratio(compiled_ms),
    }


def run(
    rows: int = 16384,
    experts: Sequence[int] = (16, 32, 64, 128),
    threads: int | None = 1,
    repeats: int = 7,
    warmup: int = 2,
    device: str = "cpu",
    backend: str = "inductor",
    general: bool = False,
    names: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Time forward+backward of every map's PyTorch path, eager and compiled.

    Args:
        rows: score rows (tokens) per call.
        experts: the numbers of experts ``E``.
        threads: torch intra-op threads (restored afterwards); None keeps the setting.
        repeats: timed calls per measurement; the median is reported.
        warmup: untimed calls before the timed ones (after the compiling call).
        device: ``"cpu"`` or ``"cuda"``.
        backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` to time
            the tracing alone).
        general: also time the general-alpha solvers (:data:`GENERAL`).
        names: time only these implementations (keys of :data:`IMPLEMENTATIONS` or
            :data:`GENERAL`); :data:`REFERENCE` is always timed.
        seed: seed of the generator that draws the scores and gradients.
        progress: say on stderr which map and E are being compiled and timed.

    Returns:
        ``{"rows": [{"impl", "shape", "eager_ms", "compiled_ms", "speedup",
        "compile_s", "eager_ratio", "compiled_ratio"}, ...], "device", "backend",
        "threads", "torch", "notes"}``: ``speedup`` is eager over compiled time,
        the ratios are times over eager ``torch.softmax``'s; a map that fails to
        compile gets a note instead of a row.
    """
    if rows < 1 or repeats < 1 or warmup < 0 or any(int(e) < 1 for e in experts):
        raise ValueError(
            f"rows and repeats must be >= 1, warmup >= 0 and every E >= 1, got rows={rows}, "
            f"repeats={repeats}, warmup={warmup}, experts={list(experts)}"
        )
    dev = torch.device(device)
    table = {**IMPLEMENTATIONS, **(GENERAL if general else {})}
    if names is not None:
        unknown = sorted(set(names) - set(IMPLEMENTATIONS) - set(GENERAL))
        if unknown:
            raise ValueError(
                f"unknown map names {unknown}; choose from {[*IMPLEMENTATIONS, *GENERAL]}"
            )
        every = {**IMPLEMENTATIONS, **GENERAL}
        table = {REFERENCE: IMPLEMENTATIONS[REFERENCE]} | {n: every[n] for n in names}
    median_ms = _timer(dev)
    notes: list[str] = []
    out: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(seed)
    with num_threads(threads), maps.use_backend("torch"):
        n_threads = torch.get_num_threads()
        for e in (int(e) for e in experts):
            x = (torch.randn(rows, e, generator=gen) * 2).to(dev)
            g = torch.randn(rows, e, generator=gen).to(dev)
            ref_ms = None
            for name, f in table.items():
                if "lapsum" in name and e <= 2:
                    continue
                if progress:
                    print(f"bench maps --compile: E={e} {name}", file=sys.stderr, flush=True)
                torch._dynamo.reset()
                eager_ms = median_ms(_fwdbwd(f, x, g), repeats, warmup)
                try:
                    compile_s, compiled_ms = _compiled(f, x, g, backend, median_ms, repeats, warmup)
                except Exception as exc:  # one map's failure must not end the run
                    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    notes.append(f"{name} at E={e} did not compile: {type(exc).__name__}: {line}")
                    continue
                if name == REFERENCE:
                    ref_ms = eager_ms
                out.append(_row(name, f"{rows}x{e}", eager_ms, compiled_ms, compile_s, ref_ms))
            del x, g
            gc.collect()
    torch._dynamo.reset()
    notes.append(
        f"forward+backward, float32 scores randn * 2; ms: median of {repeats} calls after "
        f"{warmup} warm-up calls; compile_s: the first compiled call; ratios: over eager "
        f"{REFERENCE}'s ms; speedup: eager ms / compiled ms"
    )
    return {
        "rows": out,
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "cpu": cpu_info()["model"],
        "backend": backend,
        "threads": n_threads,
        "torch": torch.__version__,
        "notes": notes,
    }


def format_table(result: dict) -> str:
    """An aligned Markdown table of a :func:`run` result: one line per map and ``E``
    with eager and compiled ms, the speedup, the ratios to eager torch.softmax and
    the compile time, then the notes."""
    header = [
        "impl",
        "shape",
        "eager ms",
        "compiled ms",
        "speedup",
        "eager/sm",
        "comp/sm",
        "compile s",
    ]
    body = [
        [
            r["impl"],
            r["shape"],
            f"{r['eager_ms']:.3f}",
            f"{r['compiled_ms']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['eager_ratio']:.2f}x",
            f"{r['compiled_ratio']:.2f}x",
            f"{r['compile_s']:.1f}",
        ]
        for r in result["rows"]
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 2)) if i < 2 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)
        )
        + "|"
    )
    lines = [
        f"maps' PyTorch path, torch.compile({result['backend']!r}, fullgraph=True) vs eager; "
        f"device={result['device']} threads={result['threads']} torch={result['torch']}"
        f" (cpu: {result.get('cpu', 'unknown')})",
        "",
        line(header),
        rule,
        *(line(r) for r in body),
    ]
    if result["notes"]:
        lines += ["", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines)
