"""``moelab bench train``: how fast a model trains, and where a step's time goes.

Everything is measured in one process, on tokens the benchmark draws itself, and reported
as ratios between figures of the same run (timings on a shared machine drift; ratios
within one run hold):

- **models**: steady-state training steps (forward, loss + auxiliary losses, backward,
  gradient clipping, AdamW, the routers' bias updates: what ``moelab train`` does per
  step, with the loop's own optimizer) of the preset's MoE model and of the dense model of
  equal active parameters (``moe_layers="none"``, its ``d_ff`` chosen so that the active
  parameter counts match), timed alternately, a step of one then a step of the other.
  ``moe_vs_dense`` is the MoE model's tokens/s over the dense model's.
- **matmul**: the rate of a plain float32 ``n x n`` matmul in the same process and thread
  count; each model's FLOP/s (6 N + 12 L S D per token, N the active parameters without the
  input embedding, as ``moelab bench gpu``) is reported as a fraction of it.
- **compile**: each block compiled with ``torch.compile`` (as ``moelab train --compile``)
  against eager: the steady state (alternate steps of the two warmed models) and a whole
  run of ``run_steps`` steps from a fresh model, compilation included (into an empty
  inductor cache, as a first run compiles); the graphs dynamo
  produced and its graph breaks; ``break_even_steps``, the run length from which the
  compiled run is the faster one.
- **profile**: the share of a steady-state eager step spent in each part, from
  ``torch.profiler``: the forward operators inside a part's modules (found through
  ``record_function`` ranges the benchmark opens around them) and the backward operators
  autograd runs for them (matched by their sequence numbers):

      attention   the attention modules (projections, rotary, scaled_dot_product_attention)
      experts     the MoE layers' experts and shared experts
      router      the routers (scores, map, selection, auxiliary losses)
      dispatch    the rest of the MoE layers (permute, unpermute, null experts)
      dense_ff    the dense blocks' feed-forward networks
      output      the output projection (the vocabulary logits)
      optimizer   gradient clipping, AdamW's step, zeroing the gradients, bias updates
      other       the rest: embedding, norms, the loss, autograd's
                  bookkeeping (gradient accumulation) and the profiler's own overhead

The document (``--json``):

    version, preset, threads, batch, seq_len, tokens_per_step, repeats, warmup, seconds
    matmul:   n, ms, gflops
    models:   {moe, dense}: d_ff, moe_layers, n_experts, top_k, n_active,
              flops_per_token, step_ms (median), tokens_per_s, gflops, matmul_fraction
    moe_vs_dense
    compile:  status ("ok" | "skipped" | "error"), backend, run_steps, eager_step_ms,
              compiled_step_ms, steady_speedup, eager_run_s, compiled_run_s, run_speedup,
              first_step_s (the compiled run's first step, which compiles), graphs,
              graph_breaks, break_even_steps (null when compiling does not pay off)
    profile:  status, steps, step_ms, ms {part: ms per step}, shares {part: fraction}
    notes

    >>> from moelab.bench.train import run, format_report
    >>> print(format_report(run(repeats=5, compile=False)))
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from moelab.bench.timing import num_threads, significant

__all__ = ["PARTS", "VERSION", "dense_equivalent", "format_report", "run"]

VERSION = 1

PARTS = (
    "attention", "experts", "router", "dispatch", "dense_ff", "output", "optimizer", "other"
)  # fmt: skip
"""The parts of a step the profile reports, in order."""

_LABEL = "moelab.bench."
"""Prefix of the record_function ranges the profile opens around the parts."""


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"bench train: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- models


def dense_equivalent(config: Any) -> Any:
    """The dense model (``moe_layers="none"``) whose active parameter count is nearest
    ``config``'s: the active count is affine in ``d_ff``, so two counts give the line."""
    from moelab.model.config import param_counts

    target = param_counts(config)["active"]

    def dense(d_ff: int) -> Any:
        return dataclasses.replace(config, moe_layers="none", d_ff=d_ff)

    a, b = param_counts(dense(64))["active"], param_counts(dense(128))["active"]
    slope = (b - a) / 64
    d_ff = max(1, round(64 + (target - a) / slope))
    return dense(d_ff)


class _Trainer:
    """A model and what ``moelab train`` steps with it: the loop's AdamW groups,
    gradient clipping at the default 1.0 and the routers' updates after the step."""

    def __init__(self, config: Any, seed: int) -> None:
        from moelab.model import Transformer
        from moelab.train.config import TrainConfig
        from moelab.train.loop import build_optimizer

        torch.manual_seed(seed)
        self.config = config
        self.model = Transformer(config)
        self.model.train()
        self.train_config = TrainConfig()
        self.opt = build_optimizer(self.model, self.train_config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def step(self, xy: torch.Tensor, mark: Callable[[str], Any] | None = None) -> float:
        from moelab.routing.router import step_routers

        out = self.model(xy[:, :-1], xy[:, 1:])
        loss = out.loss + out.aux_loss
        loss.backward()
        with mark("optimizer") if mark else nullcontext():
            torch.nn.utils.clip_grad_norm_(self.params, self.train_config.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            step_routers([layer.router for layer in self.model.moe_layers], out.router_outputs)
        return float(loss.detach())


def _batches(config: Any, batch: int, seq_len: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g) for _ in range(n)
    ]


def _timed_alternately(
    trainers: dict[str, _Trainer], pool: list[torch.Tensor], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds of ``repeats`` steps of each trainer, one step of each in turn."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(warmup + repeats):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.step(pool[i % len(pool)])
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _matmul(n: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return {"n": n, "ms": significant(1e3 * s), "gflops": significant(2 * n**3 / s / 1e9)}


def _model_row(config: Any, seq_len: int, tokens: int, times: list[float], rate: float) -> dict:
    from moelab.bench.gpu import train_flops_per_token

    flops, n_active = train_flops_per_token(config, seq_len)
    s = statistics.median(times)
    gflops = flops * tokens / s / 1e9
    return {
        "d_ff": config.d_ff,
        "moe_layers": config.moe_layers,
        "n_experts": config.n_experts if config.moe_layers != "none" else None,
        "top_k": config.router_config().top_k if config.moe_layers != "none" else None,
        "n_active": n_active,
        "flops_per_token": flops,
        "step_ms": significant(1e3 * s),
        "tokens_per_s": significant(tokens / s),
        "gflops": significant(gflops),
        "matmul_fraction": significant(gflops / rate),
    }


# ---------------------------------------------------------------------------- compile


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters
    (``torch._dynamo.reset()`` leaves them; take differences)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _bench_compile(
    config: Any, pool: list[torch.Tensor], run_steps: int, repeats: int, warmup: int,
    backend: str, progress: bool,
) -> dict[str, Any]:  # fmt: skip
    import torch._dynamo

    from moelab.train.parallel import compile_blocks

    torch._dynamo.reset()
    graphs_before, breaks_before = _dynamo_counts()
    runs: dict[str, _Trainer] = {}
    run_s: dict[str, float] = {}
    first_s = 0.0
    for name in ("eager", "compiled"):
        _say(progress, f"compile: a {run_steps}-step run, {name}")
        trainer = _Trainer(config, seed=0)
        if name == "compiled":
            compile_blocks(trainer.model, backend=backend)
        t0 = time.perf_counter()
        for i in range(run_steps):
            trainer.step(pool[i % len(pool)])
            if i == 0 and name == "compiled":
                first_s = time.perf_counter() - t0
        run_s[name] = time.perf_counter() - t0
        runs[name] = trainer
    graphs, breaks = (
        now - before
        for now, before in zip(_dynamo_counts(), (graphs_before, breaks_before), strict=True)
    )
    _say(progress, "compile: the steady state, eager and compiled in turn")
    times = _timed_alternately(runs, pool, repeats, warmup)
    eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
    # the compiled run's cost over eager: compiling, then (compiled - eager) per step
    extra = run_s["compiled"] - run_steps * compiled - (run_s["eager"] - run_steps * eager)
    break_even = None if compiled >= eager else max(0, math.ceil(extra / (eager - compiled)))
    return {
        "status": "ok",
        "backend": backend,
        "run_steps": run_steps,
        "eager_step_ms": significant(1e3 * eager),
        "compiled_step_ms": significant(1e3 * compiled),
        "steady_speedup": significant(eager / compiled),
        "eager_run_s": significant(run_s["eager"]),
        "compiled_run_s": significant(run_s["compiled"]),
        "run_speedup": significant(run_s["eager"] / run_s["compiled"]),
        "first_step_s": significant(first_s),
        "graphs": graphs,
        "graph_breaks": breaks,
        "break_even_steps": break_even,
    }


@contextmanager
def _fresh_inductor_cache() -> Iterator[None]:
    """Compile into an empty, temporary inductor cache, so that the whole run's time is
    what a first ``moelab train --compile`` pays (a warm cache compiles faster)."""
    import os
    import tempfile

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="moelab-bench-inductor-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


# ---------------------------------------------------------------------------- profile


def _part_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from moelab.model.transformer import Attention, SwiGLU
    from moelab.moe.layer import MoE

    parts: list[tuple[str, torch.nn.Module]] = []
    for module in model.modules():
        if isinstance(module, Attention):
            parts.append(("attention", module))
        elif isinstance(module, MoE):
            parts += [("dispatch", module), ("router", module.router)]
            parts.append(("experts", module.experts))
            if module.shared is not None:
                parts.append(("experts", module.shared))
        elif isinstance(module, SwiGLU):
            parts.append(("dense_ff", module))
    parts.append(("output", model.lm_head))
    return parts


@contextmanager
def _labelled(model: torch.nn.Module) -> Iterator[None]:
    """Open a ``record_function`` range named after its part around every forward of
    the part's modules (hooks, removed on exit)."""
    from torch.autograd.profiler import record_function

    handles = []
    for part, module in _part_modules(model):
        stack: list[Any] = []

        def pre(_m: Any, _a: Any, part: str = part, stack: list = stack) -> None:
            rf = record_function(_LABEL + part)
            rf.__enter__()
            stack.append(rf)

        def post(_m: Any, _a: Any, _o: Any, stack: list = stack) -> None:
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _without_tracer_lines() -> Iterator[None]:
    """Drop the "USDT: ... profiler_start/stop" lines the profiler's C++ side writes to
    file descriptor 2 when it starts and stops (no setting turns them off); anything
    else written there meanwhile is passed on."""
    import os
    import tempfile

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (e.g. a captured stream)
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def _labelled_parent(event: Any) -> Any:
    """The innermost labelled range around a profiler event (or None)."""
    e = event.cpu_parent
    while e is not None and not e.name.startswith(_LABEL):
        e = e.cpu_parent
    return e


def _part(labelled: Any) -> str:
    return labelled.name[len(_LABEL) :]


_BACKWARD = "autograd::engine::evaluate_function: "
"""The profiler's name of a backward node evaluation (then the node's name)."""


def _backward_parts(events: Any) -> dict[int, str]:
    """The part of each autograd node, by sequence number: the part of the forward
    operator that recorded it (its innermost labelled range; the optimizer's left out)."""
    seq_part: dict[int, str] = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            labelled = _labelled_parent(e)
            if labelled is not None and _part(labelled) != "optimizer":
                seq_part.setdefault(e.sequence_nr, _part(labelled))
    return seq_part


def _part_times(events: Any) -> tuple[dict[str, float], float]:
    """Microseconds of each part in the profiled steps, and of the steps in all.

    Forward: each labelled range's own time (less the labelled ranges inside it).
    Backward: autograd's node evaluations, each in the part of the forward operator that
    recorded the node (:func:`_backward_parts`). "other": the rest of the steps."""
    us = dict.fromkeys(PARTS, 0.0)
    total = sum(e.time_range.elapsed_us() for e in events if e.name == "moelab.bench:step")
    for e in events:
        if e.name.startswith(_LABEL):
            us[_part(e)] += e.time_range.elapsed_us()
            parent = _labelled_parent(e)
            if parent is not None:
                us[_part(parent)] -= e.time_range.elapsed_us()
    seq_part = _backward_parts(events)
    for e in events:
        if e.name.startswith(_BACKWARD) and e.sequence_nr in seq_part:
            us[seq_part[e.sequence_nr]] += e.time_range.elapsed_us()
    us["other"] = total - sum(us[p] for p in PARTS if p != "other")
    return us, total


def _bench_profile(trainer: _Trainer, pool: list[torch.Tensor], steps: int) -> dict[str, Any]:
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    mark = lambda part: record_function(_LABEL + part)  # noqa: E731
    with _labelled(trainer.model):
        trainer.step(pool[0], mark)  # hooks in place before the profiled steps
        prof = profile(activities=[ProfilerActivity.CPU])
        with _without_tracer_lines():
            prof.start()
        for i in range(steps):
            with record_function("moelab.bench:step"):
                trainer.step(pool[i % len(pool)], mark)
        with _without_tracer_lines():
            prof.stop()
    us, total = _part_times(prof.events())
    ms = {p: significant(us[p] / steps / 1e3) for p in PARTS}
    return {
        "status": "ok",
        "steps": steps,
        "step_ms": significant(total / steps / 1e3),
        "ms": ms,
        "shares": {p: significant(us[p] / total) for p in PARTS},
    }


# ---------------------------------------------------------------------------- run


def _notes(config: Any, dense: Any, models: dict[str, Any], kept: bool) -> list[str]:
    """The report's remarks: the dense equal's width, whether freed memory was kept
    (``kept``, read before the timed steps), and how to read the ratios."""
    notes: list[str] = []
    if dense.d_ff != config.d_ff:
        notes.append(
            f"dense equal: moe_layers=none, d_ff {dense.d_ff} ({models['dense']['n_active']} "
            f"active parameters against the MoE model's {models['moe']['n_active']})"
        )
    notes.append(
        "freed memory kept in the process (as `moelab` does; moelab.train.allocator)"
        if kept
        else "malloc's own thresholds (keep_freed_memory not in force: a library call, "
        "not glibc, or opted out)"
    )
    notes.append("ratios are within this run; absolute times depend on the machine's load")
    return notes


def run(
    preset: str = "tiny",
    batch: int = 8,
    seq_len: int = 128,
    threads: int | None = 1,
    repeats: int = 20,
    warmup: int = 3,
    run_steps: int = 300,
    compile: bool = True,
    backend: str = "inductor",
    profile_steps: int = 3,
    matmul_n: int = 1024,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure training speed (see the module docstring for the document's keys).

    Raises:
        ValueError: a count below its least value, or a sequence longer than the
            preset's ``max_seq_len``.
    """
    from moelab.model import load_preset

    for name, value, least in (
        ("batch_size", batch, 1), ("seq_len", seq_len, 1), ("repeats", repeats, 1),
        ("warmup", warmup, 0), ("run_steps", run_steps, 1), ("profile_steps", profile_steps, 1),
        ("matmul_n", matmul_n, 1),
    ):  # fmt: skip
        if value < least:
            raise ValueError(f"{name.replace('_', '-')} must be >= {least}, got {value}")
    if compile:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"backend {backend!r} is not a torch.compile backend; choose one of "
                + ", ".join(b for b in known if "TESTING" not in b)
            )
    config = load_preset(preset)
    if config.moe_layers == "none":
        raise ValueError(f"preset {preset!r} has no MoE layer; pick an MoE preset (tiny)")
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq-len {seq_len} exceeds the preset's max_seq_len {config.max_seq_len}")
    from moelab.train.allocator import in_force

    kept = in_force()  # read before measuring: what the timed steps ran with
    start = time.perf_counter()
    tokens = batch * seq_len
    with num_threads(threads):
        pool = _batches(config, batch, seq_len)
        dense = dense_equivalent(config)
        _say(progress, f"matmul rate ({matmul_n}^3, float32)")
        matmul = _matmul(matmul_n, repeats)
        _say(progress, f"steady state: {preset} MoE and its dense equal, {repeats} steps each")
        trainers = {"moe": _Trainer(config, 0), "dense": _Trainer(dense, 0)}
        times = _timed_alternately(trainers, pool, repeats, warmup)
        models = {
            name: _model_row(trainers[name].config, seq_len, tokens, times[name],
                             matmul["gflops"])
            for name in ("moe", "dense")
        }  # fmt: skip
        _say(progress, f"profile: {profile_steps} eager steps")
        try:
            prof = _bench_profile(trainers["moe"], pool, profile_steps)
        except Exception as err:  # NOTE: the profile is one section; report, go on
            prof = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        del trainers
        if compile:
            try:
                with _fresh_inductor_cache():
                    comp = _bench_compile(
                        config, pool, run_steps, repeats, warmup, backend, progress
                    )
            except Exception as err:  # NOTE: e.g. no C++ compiler for inductor
                comp = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        else:
            comp = {"status": "skipped", "reason": "--no-compile"}
    notes = _notes(config, dense, models, kept)
    return {
        "version": VERSION,
        "preset": preset,
        "threads": torch.get_num_threads() if threads is None else threads,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": tokens,
        "repeats": repeats,
        "warmup": warmup,
        "matmul": matmul,
        "models": models,
        "moe_vs_dense": significant(
            models["moe"]["tokens_per_s"] / models["dense"]["tokens_per_s"]
        ),
        "compile": comp,
        "profile": prof,
        "notes": notes,
        "seconds": significant(time.perf_counter() - start),
    }


def format_report(result: dict[str, Any]) -> str:
    """The document as a few aligned tables."""
    m = result["matmul"]
    out = [
        f"preset {result['preset']}, {result['batch']} x {result['seq_len']} tokens per step, "
        f"{result['threads']} thread(s), median of {result['repeats']} steps",
        f"matmul {m['n']}^3 float32: {m['gflops']:.1f} GFLOP/s",
        "",
        "| model | d_ff | active params | step ms | tokens/s | GFLOP/s | of matmul |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["models"].items():
        out.append(
            f"| {name} | {r['d_ff']} | {r['n_active']:,} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['gflops']:.1f} | {r['matmul_fraction']:.0%} |"
        )
    out += ["", f"MoE / dense tokens/s: {result['moe_vs_dense']:.3f}"]
    c = result["compile"]
    if c["status"] == "ok":
        be = c["break_even_steps"]
        out += [
            "",
            f"compile ({c['backend']}): steady {c['eager_step_ms']:.1f} -> "
            f"{c['compiled_step_ms']:.1f} ms ({c['steady_speedup']:.2f}x); "
            f"{c['run_steps']}-step run {c['eager_run_s']:.1f} -> {c['compiled_run_s']:.1f} s "
            f"({c['run_speedup']:.2f}x, first step {c['first_step_s']:.1f} s); "
            f"{c['graphs']} graphs, {c['graph_breaks']} graph breaks; "
            + ("compiling never pays off" if be is None else f"pays off from {be} steps"),
        ]
    else:
        out += ["", f"compile: {c['status']}: {c.get('reason') or c.get('error')}"]
    p = result["profile"]
    if p["status"] == "ok":
        out += ["", f"profile ({p['steps']} steps, {p['step_ms']:.1f} ms per profiled step):"]
        out += ["| part | ms per step | share |", "|---|---|---|"]
        out += [f"| {k} | {p['ms'][k]:.2f} | {p['shares'][k]:.1%} |" for k in PARTS]
    else:
        out += ["", f"profile: error: {p['error']}"]
    out += [""] + [f"note: {n}" for n in result["notes"]]
    return "\n".join(out)
