"""Speed benchmark of the probability maps against ``torch.softmax`` and the ``entmax`` package.

For every number of experts ``E`` the benchmark draws float32 scores ``x`` of shape
``(rows, E)`` and an upstream gradient ``g`` of the same shape, then times two passes
of each implementation:

    fwd      ``f(x)`` on an input that does not require grad
    fwdbwd   ``x.detach().requires_grad_()``, ``y = f(x)``, ``y.backward(g)``

Each pass runs ``warmup`` untimed calls, then ``repeats`` timed calls
(``time.perf_counter``); the reported time is the median in milliseconds, and the
ratio is that time over the time of ``torch.softmax`` for the same shape and pass.

Every registered map (:func:`moelab.maps.registry`) is timed: with the settings in
:data:`SETTINGS`, else with its defaults. The ``entmax`` package (Peters, Niculae &
Martins) is an optional dependency: when it does not import, its rows are skipped and
a note says so.

The result says where it ran (``machine``): the CPU model, the build target of the
fused kernels (``march``), the instruction set their code uses (``isa``: ``avx512``,
``avx2``, ...), the width of their vector types and the kernel path of each map's
forward and backward at each ``E`` (:func:`moelab.maps.kernel_build_info`). ``march``
builds the kernels for another target (``x86-64-v3``: AVX2 without AVX-512), in a
subprocess when this process has loaded another build already.

    >>> from moelab.bench.maps import run, format_table
    >>> print(format_table(run(rows=65536, experts=(16, 64))))
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from tqdm.auto import tqdm

from moelab import maps
from moelab.bench.timing import median_ms, num_threads, significant
from moelab.train.progress import is_terminal

__all__ = ["BENCH_K", "REFERENCE", "SETTINGS", "format_table", "implementations", "run"]

#: The implementation every ratio is relative to.
REFERENCE = "torch.softmax"

Map = Callable[[torch.Tensor], torch.Tensor]


def _import_entmax() -> ModuleType | None:
    """The ``entmax`` package, or None when it does not import."""
    try:
        import entmax
    except ImportError:
        return None
    return entmax


#: Settings timed per map, as ``(row label, parameters)``, by map name. Every other
#: registered map is timed once with its defaults, as ``moelab.<name>`` (with k =
#: :data:`BENCH_K` where it needs k: ``moelab.<name>(k=2)``).
SETTINGS: dict[str, tuple[tuple[str, dict[str, float]], ...]] = {
    "entmax": (("moelab.entmax15", {"alpha": 1.5}), ("moelab.entmax(1.3)", {"alpha": 1.3})),
    "normmax": (("moelab.normmax2", {"alpha": 2.0}), ("moelab.normmax(3)", {"alpha": 3.0})),
}
BENCH_K = 2.0


def _package_rows(em: ModuleType) -> dict[str, list[tuple[str, Map]]]:
    """The ``entmax`` package's implementations of a moelab row's map and setting,
    by that row's label (timed right after it)."""
    return {
        "moelab.sparsemax": [
            ("entmax.sparsemax", lambda x: em.sparsemax(x, dim=-1)),
            ("entmax.sparsemax_bisect", lambda x: em.sparsemax_bisect(x, dim=-1)),
        ],
        "moelab.entmax15": [
            ("entmax.entmax15", lambda x: em.entmax15(x, dim=-1)),
            ("entmax.entmax_bisect(1.5)", lambda x: em.entmax_bisect(x, 1.5, dim=-1)),
        ],
        "moelab.entmax(1.3)": [
            ("entmax.entmax_bisect(1.3)", lambda x: em.entmax_bisect(x, 1.3, dim=-1))
        ],
        "moelab.normmax2": [
            ("entmax.normmax_bisect(2)", lambda x: em.normmax_bisect(x, alpha=2, dim=-1))
        ],
        "moelab.normmax(3)": [
            ("entmax.normmax_bisect(3)", lambda x: em.normmax_bisect(x, alpha=3, dim=-1))
        ],
    }


def _rows(entmax: ModuleType | None) -> list[tuple[str, Map, int]]:
    """``(name, f, smallest E it applies to)`` for every benchmarked implementation,
    in table order: torch.softmax, then each registered map's settings, each followed
    by the entmax package's rows of the same setting."""
    package = _package_rows(entmax) if entmax is not None else {}
    rows: list[tuple[str, Map, int]] = [(REFERENCE, lambda x: torch.softmax(x, -1), 1)]
    for name, info in maps.registry().items():
        k = {"k": BENCH_K} if info.needs_k else {}
        default = f"moelab.{name}" + "".join(f"({p}={v:g})" for p, v in k.items())
        for label, given in SETTINGS.get(name, ((default, k),)):
            # a map with a budget k needs more than k experts
            min_e = math.floor(given["k"]) + 1 if "k" in given else 1
            rows.append((label, info.bind(**given), min_e))
            rows += [(n, f, min_e) for n, f in package.get(label, [])]
    return rows


def implementations(entmax: ModuleType | None) -> list[tuple[str, Map]]:
    """The benchmarked implementations in table order, as ``(name, f)`` pairs with
    ``f(x)`` mapping scores of shape ``(rows, E)`` along the last dim.

    Every registered map is listed (:func:`moelab.maps.registry`, settings in
    :data:`SETTINGS`), each followed by the ``entmax.*`` rows of the same map, which
    are left out when ``entmax`` is None. ``moelab.lapsum(k=2)`` is always listed;
    :func:`run` skips it for ``E <= 2``.
    """
    return [(name, f) for name, f, _ in _rows(entmax)]


def _time_fwd(f: Map, x: torch.Tensor, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``f(x)``."""
    return median_ms(lambda: f(x), repeats, warmup)


def _time_fwdbwd(f: Map, x: torch.Tensor, g: torch.Tensor, warmup: int, repeats: int) -> float:
    """Median milliseconds of a forward and a backward pass of ``f`` at ``x``."""

    def step() -> None:
        xr = x.detach().requires_grad_()
        f(xr).backward(g)

    return median_ms(step, repeats, warmup)


def _check_args(rows: int, experts: Sequence[int], repeats: int, warmup: int) -> list[int]:
    """``experts`` as ints; ValueError for a setting below its minimum."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    experts = [int(e) for e in experts]
    if any(e < 1 for e in experts):
        raise ValueError(f"every number of experts must be >= 1, got {experts}")
    return experts


def _time_impls(
    impls: list[tuple[str, Map, int]],
    x: torch.Tensor,
    g: torch.Tensor,
    e: int,
    shape: str,
    warmup: int,
    repeats: int,
    bar: Any,
    notes: list[str],
) -> dict[tuple[str, str], float]:
    """Median ms of each implementation that takes ``e`` experts, forward and
    forward+backward, keyed by (impl, pass); a failing implementation is left out, with
    a note."""
    timed: dict[tuple[str, str], float] = {}
    for name, f, min_e in impls:
        if e < min_e:
            continue
        bar.set_description(f"E={e} {name}")
        try:
            timed[name, "fwd"] = _time_fwd(f, x, warmup, repeats)
            timed[name, "fwdbwd"] = _time_fwdbwd(f, x, g, warmup, repeats)
        except Exception as exc:  # a failing implementation must not end the run
            timed.pop((name, "fwd"), None)
            notes.append(f"{name} failed at {shape}: {type(exc).__name__}: {exc}")
        bar.update(1)
    return timed


class _Lines:
    """Progress as plain lines on stderr, for a log file or a pipe (a tqdm bar there
    writes its redraws into the file): ``bench maps: [5/72] E=16 moelab.sparsemax``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def set_description(self, text: str) -> None:
        print(f"bench maps: [{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n: int) -> None:
        self.done += n

    def close(self) -> None:
        pass


def _ratio_rows(
    impls: list[tuple[str, Map, int]], shape: str, timed: dict[tuple[str, str], float]
) -> list[dict[str, Any]]:
    """The result rows of one shape: each timed (impl, pass) with its ratio to
    ``torch.softmax``'s time (NaN where that is missing)."""
    out_rows: list[dict[str, Any]] = []
    for name, _, _ in impls:
        for pass_ in ("fwd", "fwdbwd"):
            if (name, pass_) not in timed:
                continue
            ms = timed[name, pass_]
            ref = timed.get((REFERENCE, pass_))
            if name == REFERENCE:
                ratio = 1.0
            elif ref is None or ref <= 0:
                ratio = float("nan")
            else:
                ratio = ms / ref
            out_rows.append(
                {
                    "impl": name,
                    "shape": shape,
                    "pass": pass_,
                    "ms": significant(ms),
                    "ratio": significant(ratio),
                }
            )
    return out_rows


def run(
    rows: int = 65536,
    experts: Sequence[int] = (8, 16, 32, 64, 128),
    threads: int | None = 1,
    repeats: int = 7,
    warmup: int = 2,
    progress: bool = True,
    seed: int = 0,
    march: str | None = None,
) -> dict:
    """Time every implementation at every ``(rows, E)`` shape, forward and forward+backward.

    Args:
        rows: number of score rows (tokens) per call.
        experts: the numbers of experts ``E`` to benchmark.
        threads: torch intra-op threads for the run (the previous setting is restored
            afterwards); None keeps the current setting.
        repeats: timed calls per pass; the median is reported.
        warmup: untimed calls before the timed ones.
        progress: report progress on stderr over all ``(E, impl)`` pairs: a tqdm bar on a
            terminal, plain lines elsewhere.
        seed: seed of the generator that draws the scores and the upstream gradients.
        march: build the fused kernels for this ``-march`` target (``native``,
            ``x86-64-v3``, ``x86-64-v4``, ...; None: ``$MOELAB_KERNEL_MARCH``, else
            native); run in a subprocess when this process has loaded another build.
            ValueError when the kernels do not build (or are off) for it.

    Returns:
        ``{"rows": [{"impl", "shape", "pass", "ms", "ratio"}, ...], "threads",
        "backend", "torch", "machine", "notes"}``, where ``machine`` is
        :func:`moelab.maps.kernel_build_info` at the benchmarked ``E``s (``cpu``,
        ``march``, ``isa``, ``vector_bits``, ``paths``), ``shape`` is ``f"{rows}x{E}"``,
        ``pass`` is ``"fwd"`` or ``"fwdbwd"``, ``ms`` the median milliseconds and
        ``ratio`` that time over ``torch.softmax``'s for the same shape and pass
        (1.0 for ``torch.softmax`` itself), each to
        :data:`~moelab.bench.timing.SIGNIFICANT` significant digits.
    """
    experts = _check_args(rows, experts, repeats, warmup)
    if march is not None and not maps.kernel_target(march):
        given = dict(rows=rows, experts=experts, threads=threads, repeats=repeats)
        given.update(warmup=warmup, progress=progress, seed=seed, march=march)
        return _run_in_subprocess(given)
    if march is not None and maps.kernel_build_info()["march"] != march.strip():
        raise ValueError(
            f"the maps' kernels are not in use for -march={march.strip()} (not built: see the "
            "warning above, or MOELAB_KERNELS=0 / the torch backend); a target GCC's -march "
            "takes, e.g. x86-64-v3"
        )
    notes: list[str] = []
    entmax = _import_entmax()
    if entmax is None:
        notes.append("the entmax package does not import: its rows are skipped")
    impls = _rows(entmax)
    for name, _, min_e in impls:
        if any(e < min_e for e in experts):
            notes.append(f"{name} is skipped for E <= {min_e - 1}")

    out_rows: list[dict[str, Any]] = []
    with num_threads(threads):
        n_threads = torch.get_num_threads()
        total = sum(1 for e in experts for _, _, min_e in impls if e >= min_e)
        bar: Any
        if progress and not is_terminal(sys.stderr):
            bar = _Lines(total)
        else:
            bar = tqdm(total=total, file=sys.stderr, leave=False, unit="map", disable=not progress)
        gen = torch.Generator().manual_seed(seed)
        try:
            for e in experts:
                shape = f"{rows}x{e}"
                x = torch.randn(rows, e, generator=gen, dtype=torch.float32) * 2
                g = torch.randn(rows, e, generator=gen, dtype=torch.float32)
                timed = _time_impls(impls, x, g, e, shape, warmup, repeats, bar, notes)
                out_rows += _ratio_rows(impls, shape, timed)
                del x, g, timed
                gc.collect()
        finally:
            bar.close()

    notes.append(
        f"ms: median of {repeats} timed calls after {warmup} warm-up calls, float32 scores "
        "randn * 2; ratio: ms over torch.softmax's for the same shape and pass"
    )
    return {
        "rows": out_rows,
        "threads": n_threads,
        "backend": maps.backend(),
        "torch": torch.__version__,
        "machine": maps.kernel_build_info(widths=experts),
        "notes": notes,
    }


def _run_in_subprocess(given: dict[str, Any]) -> dict:
    """:func:`run` with ``given`` in a fresh Python process (one kernel build per
    process), its JSON result read back."""
    env = {**os.environ, "MOELAB_KERNEL_MARCH": given["march"]}
    code = (
        "import json, sys; from moelab.bench.maps import run; "
        "json.dump(run(**json.loads(sys.argv[1])), sys.stdout)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(given)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the maps benchmark for -march={given['march']} failed (see above)")
    return json.loads(done.stdout)


def _experts_of(shape: str) -> int:
    """``E`` from a shape string ``f"{rows}x{E}"``."""
    return int(shape.split("x")[1])


def _markdown(header: list[str], body: list[list[str]]) -> list[str]:
    """An aligned Markdown table: first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths))
        + "|"
    )
    return [line(header), rule, *(line(r) for r in body)]


#: The kernels whose path per E the text report shows, by their row label.
PATH_LABELS = {
    "sparsemax": "sparsemax",
    "entmax15": "entmax15",
    "normmax2": "normmax2",
    "lapsum": "lapsum",
    "entmax": "entmax/normmax(a)",
}


def _machine_lines(machine: dict | None, experts: list[int]) -> list[str]:
    """Where the benchmark ran: CPU, the kernels' build and their path per E (fwd bwd)."""
    if not machine:
        return []
    if machine.get("isa") is None:
        return [f"cpu: {machine.get('cpu')}  kernels: not in use (torch path)"]
    lines = [
        f"cpu: {machine.get('cpu')}  kernels: -march={machine.get('march')}, "
        f"{machine.get('isa')} code, {machine.get('vector_bits')}-bit vector types"
    ]
    paths = machine.get("paths") or {}
    parts = []
    for e in experts:
        at = paths.get(str(e)) or {}
        cells = [f"{label} {at[op]}" for op, label in PATH_LABELS.items() if op in at]
        if cells:
            parts.append(f"  E={e}: " + ", ".join(cells))
    if parts:
        lines.append(
            "kernel path (forward backward; lanesL: blocks of L rows across the lanes, "
            "rowW: along the row in W-lane vectors):"
        )
        lines += parts
    return lines


def format_table(result: dict) -> str:
    """A compact, aligned Markdown table of a :func:`run` result.

    One row per implementation and, per ``E``, a ``fwd`` and a ``fwd+bwd`` column of
    the time ratios to ``torch.softmax`` (``"2.31x"``; ``"-"`` where not measured),
    preceded by a line with rows, threads and backend, a line with the absolute
    ``torch.softmax`` milliseconds per ``E`` and the lines of where it ran (CPU,
    the kernels' build and path per ``E``), and followed by the notes.
    """
    rows = result["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(r["impl"], r["shape"], r["pass"]): r for r in rows}
    n_rows = shapes[0].split("x")[0] if shapes else "?"

    lines = [
        f"rows={n_rows}  threads={result.get('threads')}  backend={result.get('backend')}  "
        f"torch={result.get('torch')}  (ratio = time / torch.softmax time; lower is faster)"
    ]
    ref_parts = []
    for s in shapes:
        fwd = cell.get((REFERENCE, s, "fwd"))
        bwd = cell.get((REFERENCE, s, "fwdbwd"))
        fwd_ms = f"{fwd['ms']:.3f}" if fwd else "-"
        bwd_ms = f"{bwd['ms']:.3f}" if bwd else "-"
        ref_parts.append(f"E={_experts_of(s)} fwd {fwd_ms} / fwd+bwd {bwd_ms}")
    lines.append(f"{REFERENCE} ms: " + "; ".join(ref_parts))
    lines += _machine_lines(result.get("machine"), [_experts_of(s) for s in shapes])
    lines.append("")

    header = ["impl"]
    for s in shapes:
        e = _experts_of(s)
        header += [f"E={e} fwd", f"E={e} fwd+bwd"]
    body = []
    for name in impls:
        cells = [name]
        for s in shapes:
            for pass_ in ("fwd", "fwdbwd"):
                r = cell.get((name, s, pass_))
                cells.append(f"{r['ratio']:.2f}x" if r is not None else "-")
        body.append(cells)
    lines += _markdown(header, body)

    notes = result.get("notes") or []
    if notes:
        lines.append("")
        lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
