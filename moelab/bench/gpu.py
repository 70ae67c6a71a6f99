"""``moelab bench gpu``: one command that checks and measures moelab on one GPU.

    moelab bench gpu --json > gpu.json          # on the GPU machine, at most ~5 minutes
    moelab bench gpu --device cpu --quick --json   # the same sections, tiny, on the CPU

It needs no corpus (it makes its own tokens) and runs with older torch builds (>= 2.4)
and Pythons (>= 3.10): newer APIs are guarded, and a section that fails reports
``{"status": "error", "error": ...}`` in the JSON instead of ending the run. Progress
goes to stderr, the JSON document to stdout.

The document (keys; every section has "status": "ok" | "skipped" | "error", with
"reason" when skipped and "error" when it failed, and "seconds"):

    version, quick, device, seconds
    env:      torch, python, platform, cuda (bool), device_name, capability, bf16,
              grouped_mm (torch._grouped_mm present), compile (torch.compile present)
    train:    preset, steps, batch, seq_len, tokens_per_step, dtype ("bf16" autocast on
              CUDA, "float32" on the CPU), expert_impl (the experts' path, "loop" or
              "grouped"), step_ms (median), tokens_per_s, n_active, flops_per_token,
              flops_formula, peak_tflops, mfu (null without a known peak; --peak-tflops),
              peak_memory_bytes (torch.cuda.max_memory_allocated; null on the CPU, with
              peak_memory_note), loss_first, loss_last
    maps:     rows [{map, dtype, max_abs_err, max_abs_grad_err}] (every map on the device
              against the same map on the CPU in float64; bf16: forward only),
              max_abs_err (float32, over maps), max_abs_grad_err, tolerance, ok
    moe:      dtype, rows (as ``moelab bench moe``: impl, shape, pass, ms, ratio to the
              dense bound), summary [{shape, loop_ratio, grouped_ratio, grouped_speedup}]
              (forward+backward), notes
    compile:  backend, rows [{target, eager_ms, compiled_ms, speedup, compile_s,
              max_abs_diff}] (a dense block and a router, forward+backward)

The training FLOPs per token: 6 N + 12 L S D, N the active parameters without the
input embedding (a lookup), L blocks, S the sequence length, D the width (attention
scores and values, forward and backward, not halved for the causal mask: PaLM's
convention, Chowdhery et al. 2022, App. B); MFU = FLOPs per token x tokens/s / peak.

Shape suffixes: S, T, C, K (moelab.shapes).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from moelab.bench.timing import significant

VERSION = 1
SECTIONS = ("train", "maps", "moe", "compile")

#: Dense bf16 peak FLOP/s by device name (tensor cores, no sparsity).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("4090", 165.2),
    ("3090", 71.0),
)


def _log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device):
    """bf16 autocast on CUDA (as moelab trains), nothing on the CPU."""
    return torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")


def _section(name: str, fn: Callable[[], dict]) -> dict:
    """Run one section; a failure becomes {"status": "error", ...}."""
    _log(f"{name} ...")
    start = time.perf_counter()
    try:
        out = fn()
        out.setdefault("status", "ok")
    except Exception as err:  # reported in the JSON; the run goes on
        out = {
            "status": "error",
            "error": f"{type(err).__name__}: {err}".splitlines()[0][:500],
            "traceback": traceback.format_exc().splitlines()[-6:],
        }
    out["seconds"] = significant(time.perf_counter() - start)
    _log(f"{name}: {out['status']} ({out['seconds']} s)")
    return out


def env_info(device: torch.device) -> dict:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "device_name": None,
        "capability": None,
        "bf16": None,
        "grouped_mm": hasattr(torch, "_grouped_mm"),
        "compile": hasattr(torch, "compile"),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["bf16"] = bool(torch.cuda.is_bf16_supported())
    else:
        info["device_name"] = platform.processor() or "cpu"
    return info


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (TFLOP/s) from PEAK_BF16_TFLOPS, or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def train_flops_per_token(config: Any, seq_len: int) -> tuple[int, int]:
    """(FLOPs per trained token, N): 6 N + 12 L S D with N the active parameters less
    the input embedding."""
    from moelab.model.config import param_counts

    n = param_counts(config)["active"] - config.vocab_size * config.d_model
    return 6 * n + 12 * config.n_layers * seq_len * config.d_model, n


def _adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (lr 3e-4, weight decay 0.1), fused on CUDA where this build has it."""
    try:
        opt = torch.optim.AdamW(
            model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda"
        )
    except (RuntimeError, TypeError):  # NOTE: no fused AdamW in this build
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return opt


def _train_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    pool: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    steps: int,
    max_seconds: float,
) -> tuple[list[float], list[float], int]:
    """``warmup`` untimed then ``steps`` timed training steps on the batches of ``pool``,
    cycled (fewer once ``max_seconds`` have passed and 3 were timed): (the losses logged,
    the last one's included; the seconds of each timed step; the timed steps)."""
    losses: list[float] = []
    times: list[float] = []
    start_all = time.perf_counter()
    done = 0
    for step in range(warmup + steps):
        xy = pool[step % len(pool)]
        _sync(device)
        t0 = time.perf_counter()
        with _autocast(device):
            out = model(xy[:, :-1], xy[:, 1:], collect=False)
            loss = out.loss + out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            done += 1
        if step == 0 or step % 25 == 0 or step == warmup + steps - 1:
            losses.append(float(loss.detach()))
            _log(f"train step {step}: loss {losses[-1]:.3f}")
        if time.perf_counter() - start_all > max_seconds and done >= 3:
            _log(f"train: time budget of {max_seconds:g} s reached after {done} timed steps")
            break
    losses.append(float(loss.detach()))
    return losses, times, done


def bench_train(
    device: torch.device, quick: bool, steps: int, max_seconds: float, peak: float | None
) -> dict:
    """bf16 training of paper-300m (tiny with --quick) on its own tokens."""
    from moelab.model import Transformer, load_preset
    from moelab.moe.experts import compute_dtype

    preset = "tiny" if quick else "paper-300m"
    config = load_preset(preset)
    batch, seq_len = (2, 32) if quick else (4, 2048)
    steps = 3 if quick else steps
    warmup = 1 if quick else 10
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    model.train()
    opt = _adamw(model, device)
    g = torch.Generator().manual_seed(1)
    # four fixed batches, cycled: a model that learns drives their loss down
    pool = [
        torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g) for _ in range(4)
    ]
    pool = [p.to(device) for p in pool]
    with _autocast(device):
        probe = torch.zeros(1, config.d_model, device=device)
        dtype = compute_dtype(probe)
    impl = model.moe_layers[0].experts.resolved_impl(probe.to(dtype)) if model.moe_layers else "-"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, done = _train_steps(model, opt, pool, device, warmup, steps, max_seconds)
    tokens_per_step = batch * seq_len
    step_s = sum(times) / len(times)
    tokens_per_s = tokens_per_step / step_s
    flops, n_active = train_flops_per_token(config, seq_len)
    mfu = None if peak is None else flops * tokens_per_s / (peak * 1e12)
    out = {
        "preset": preset,
        "steps": done,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": tokens_per_step,
        "dtype": "bf16" if dtype == torch.bfloat16 else str(dtype).replace("torch.", ""),
        "expert_impl": impl,
        "step_ms": significant(1e3 * statistics.median(times)),
        "tokens_per_s": significant(tokens_per_s),
        "n_active": n_active,
        "flops_per_token": flops,
        "flops_formula": "6 N_active(no input embedding) + 12 L S D",
        "peak_tflops": peak,
        "mfu": None if mfu is None else significant(mfu),
        "peak_memory_bytes": None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    if device.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    else:
        out["peak_memory_note"] = "skipped: torch.cuda.max_memory_allocated needs CUDA"
    if peak is None:
        out["mfu_note"] = "no known peak for this device: pass --peak-tflops"
    return out


def _map_variants() -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Every registered map at its defaults (k = 2 where k is required), plus the
    iterative solvers and other alphas of entmax and normmax."""
    from moelab import maps

    out: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
    for name in maps.available():
        info = maps.info(name)
        kw = {"k": 2.0} if info.needs_k else {}
        out.append((name, lambda z, f=info.fn, kw=kw: f(z, dim=-1, **kw)))
    out += [
        ("entmax(1.5, iterative)", lambda z: maps.entmax(z, 1.5, dim=-1, method="iterative")),
        ("entmax(1.25)", lambda z: maps.entmax(z, 1.25, dim=-1)),
        ("entmax(3)", lambda z: maps.entmax(z, 3.0, dim=-1)),
        ("normmax(2, iterative)", lambda z: maps.normmax(z, 2.0, dim=-1, method="iterative")),
        ("normmax(4)", lambda z: maps.normmax(z, 4.0, dim=-1)),
        ("lapsum(k=1.5, t=0.3)", lambda z: maps.lapsum(z, 1.5, temperature=0.3, dim=-1)),
    ]
    return out


def bench_maps(device: torch.device, quick: bool, tol: float = 1e-4) -> dict:
    """Every map on ``device`` (float32, and bf16 forward) against the CPU in float64."""
    rows_n, n = (64, 8) if quick else (4096, 64)
    g = torch.Generator().manual_seed(3)
    z64 = torch.randn(rows_n, n, generator=g, dtype=torch.float64) * 2
    z64[::3, 1] = -torch.inf  # a masked expert in every third row
    g64 = torch.randn(rows_n, n, generator=g, dtype=torch.float64)
    rows = []
    for name, fn in _map_variants():
        a = z64.clone().requires_grad_(True)
        p_ref = fn(a)
        (grad_ref,) = torch.autograd.grad(p_ref, a, g64)
        b = z64.to(device, torch.float32).requires_grad_(True)
        p = fn(b)
        (grad,) = torch.autograd.grad(p, b, g64.to(device, torch.float32))
        rows.append(
            {
                "map": name,
                "dtype": "float32",
                "max_abs_err": float((p.detach().double().cpu() - p_ref.detach()).abs().max()),
                "max_abs_grad_err": float((grad.double().cpu() - grad_ref).abs().max()),
            }
        )
        with torch.no_grad():
            p16 = fn(z64.to(device, torch.bfloat16))
            ref16 = fn(z64.to(torch.bfloat16).double())  # the same rounded scores, exactly
        rows.append(
            {
                "map": name,
                "dtype": "bf16",
                "max_abs_err": float((p16.double().cpu() - ref16).abs().max()),
                "max_abs_grad_err": None,
            }
        )
    f32 = [r for r in rows if r["dtype"] == "float32"]
    worst = max(r["max_abs_err"] for r in f32)
    worst_grad = max(r["max_abs_grad_err"] for r in f32)
    return {
        "rows": rows,
        "max_abs_err": worst,
        "max_abs_grad_err": worst_grad,
        "tolerance": tol,
        "ok": bool(worst <= tol and worst_grad <= 10 * tol),
    }


def bench_moe(device: torch.device, quick: bool) -> dict:
    """The MoE layer (loop and grouped experts) against the dense bound, as
    ``moelab bench moe`` times it (bf16 autocast on CUDA)."""
    from moelab.bench import moe

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(256, 64, 128, 8, 2)] if quick else list(moe.SHAPES)
    result = moe.run(
        shapes=shapes,
        threads=None,
        repeats=2 if quick else 10,
        warmup=1 if quick else 3,
        progress=True,
        device=device,
        dtype=dtype,
        mixtral=False,
        routers=False,
    )
    cell = {(r["impl"], r["shape"], r["pass"]): r for r in result["rows"]}
    summary = []
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        loop = cell[("moelab.MoE", shape, "fwdbwd")]
        grouped = cell.get((moe.GROUPED, shape, "fwdbwd"))
        summary.append(
            {
                "shape": shape,
                "loop_ratio": loop["ratio"],
                "grouped_ratio": None if grouped is None else grouped["ratio"],
                "grouped_speedup": None
                if grouped is None
                else significant(loop["ms"] / grouped["ms"]),
            }
        )
    return {
        "dtype": result["dtype"],
        "rows": result["rows"],
        "summary": summary,
        "notes": result["notes"],
    }


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_compile(device: torch.device, quick: bool) -> dict:
    """torch.compile against eager: a dense block and a router, forward+backward."""
    if not hasattr(torch, "compile"):
        return {"status": "skipped", "reason": f"torch {torch.__version__} has no torch.compile"}
    from moelab.model import Transformer, load_preset

    # NOTE: on the CPU with --quick, the "eager" backend checks that dynamo captures the
    # targets without generating code (seconds, not minutes; no speed-up expected)
    backend = "eager" if (quick and device.type != "cuda") else "inductor"
    config = load_preset("tiny" if quick else "paper-300m")
    batch, seq_len = (2, 32) if quick else (4, 2048)
    repeats = 3 if quick else 20
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    dense = next(b for b in model.blocks if not b.is_moe)
    cos, sin = model.cos_SC[:seq_len], model.sin_SC[:seq_len]
    x = torch.randn(batch, seq_len, config.d_model, device=device)
    targets: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.nn.Module]] = [
        ("block (dense)", lambda a: dense(a, cos, sin)[0], dense),
    ]
    if model.moe_layers:
        router = model.moe_layers[0].router
        targets.append(("router", lambda a: router(a.reshape(-1, a.shape[-1])).weights_TK, router))
    rows = []
    for name, fn, module in targets:
        compiled = torch.compile(fn, backend=backend)
        params = list(module.parameters())

        def step(
            f: Callable[[torch.Tensor], torch.Tensor] = fn,
            params: list[torch.nn.Parameter] = params,
        ) -> None:
            xr = x.detach().requires_grad_(True)
            with _autocast(device):
                out = f(xr)
            out.float().sum().backward()
            for p in params:
                p.grad = None

        with torch.no_grad():
            diff = float((compiled(x) - fn(x)).abs().max())  # float32, compile included
        t0 = time.perf_counter()
        step(compiled)
        _sync(device)
        compile_s = time.perf_counter() - t0
        step(fn)
        eager_ms = _median_ms(step, device, repeats)
        compiled_ms = _median_ms(lambda c=compiled: step(c), device, repeats)
        rows.append(
            {
                "target": name,
                "eager_ms": significant(eager_ms),
                "compiled_ms": significant(compiled_ms),
                "speedup": significant(eager_ms / compiled_ms),
                "compile_s": significant(compile_s),
                "max_abs_diff": diff,
            }
        )
    return {"backend": backend, "rows": rows}


def resolve_device(device: str | None) -> torch.device:
    """The device to check: ``device`` ("cuda", "cuda:N" or "cpu"); None: CUDA when
    present, else the CPU.

    Raises:
        ValueError: not a CUDA or CPU device, or a CUDA device that torch does not see
            (the message names the valid devices).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # torch's own message lists every device type
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(
            f"--device {device}: bench gpu runs on cuda (cuda:N for one GPU of several) or "
            "cpu (with --quick on a machine without a GPU)"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch sees no CUDA GPU; use --device cpu --quick")
    count = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.index is not None and dev.type == "cuda" and dev.index >= count:
        raise ValueError(
            f"--device {device}, but torch sees {count} CUDA GPU(s): give cuda:0 .. "
            f"cuda:{count - 1}"
        )
    return dev


def run(
    device: str | None = None,
    quick: bool = False,
    steps: int = 300,
    train_seconds: float = 90.0,
    peak: float | None = None,
    sections: tuple[str, ...] = SECTIONS,
) -> dict:
    """Every section on ``device`` (default: CUDA when present, else the CPU)."""
    start = time.perf_counter()
    dev = resolve_device(device)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose among {', '.join(SECTIONS)}")
    peak = peak if peak is not None else peak_tflops(dev)
    result: dict[str, Any] = {
        "version": VERSION,
        "quick": quick,
        "device": str(dev),
        "env": env_info(dev),
    }
    if dev.type != "cuda" and not quick:
        _log("no CUDA device: the full run is meant for a GPU (add --quick on the CPU)")
    jobs: dict[str, Callable[[], dict]] = {
        "train": lambda: bench_train(dev, quick, steps, train_seconds, peak),
        "maps": lambda: bench_maps(dev, quick),
        "moe": lambda: bench_moe(dev, quick),
        "compile": lambda: bench_compile(dev, quick),
    }
    for name in SECTIONS:
        if name in sections:
            result[name] = _section(name, jobs[name])
        else:
            result[name] = {"status": "skipped", "reason": "not asked for (--sections)"}
    result["seconds"] = significant(time.perf_counter() - start)
    return result


def format_report(result: dict) -> str:
    """A short human-readable summary (the JSON holds everything)."""
    env = result["env"]
    lines = [
        f"moelab bench gpu on {result['device']} ({env['device_name']}), torch {env['torch']}, "
        f"python {env['python']}, {result['seconds']} s"
    ]
    for name in SECTIONS:
        sec = result[name]
        status = sec["status"]
        if status != "ok":
            lines.append(f"{name}: {status}: {sec.get('reason') or sec.get('error')}")
            continue
        if name == "train":
            mfu = "-" if sec["mfu"] is None else f"{100 * sec['mfu']:.1f}%"
            mem = sec["peak_memory_bytes"]
            lines.append(
                f"train {sec['preset']} ({sec['dtype']}, experts {sec['expert_impl']}): "
                f"{sec['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak memory "
                f"{'-' if mem is None else f'{mem / 2**30:.2f} GiB'}, loss "
                f"{sec['loss_first']:.3f} -> {sec['loss_last']:.3f}"
            )
        elif name == "maps":
            lines.append(
                f"maps: max abs error {sec['max_abs_err']:.2e} (grad {sec['max_abs_grad_err']:.2e})"
                f" against CPU float64: {'ok' if sec['ok'] else 'ABOVE ' + str(sec['tolerance'])}"
            )
        elif name == "moe":
            for s in sec["summary"]:
                lines.append(
                    f"moe {s['shape']}: fwd+bwd / dense bound: loop {s['loop_ratio']}x, grouped "
                    f"{s['grouped_ratio']}x"
                )
        else:
            for r in sec["rows"]:
                lines.append(
                    f"compile ({sec['backend']}) {r['target']}: eager {r['eager_ms']:.2f} ms, "
                    f"compiled {r['compiled_ms']:.2f} ms ({r['speedup']}x), max diff "
                    f"{r['max_abs_diff']:.1e}"
                )
    return "\n".join(lines)
