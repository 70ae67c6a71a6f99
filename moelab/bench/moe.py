"""Speed benchmark of the MoE layer.

For each shape (T tokens, width d, expert width f, E experts, top-K) it times
forward and forward+backward of

    moelab.MoE                  softmax router, top-K, renormalised gates (Mixtral's routing),
                                experts through the per-expert loop (impl="loop")
    moelab.MoE (grouped)        the same layer with grouped-GEMM experts (torch._grouped_mm;
                                impl="grouped"), where this torch has it
    hf.MixtralSparseMoeBlock    Hugging Face transformers' block with the same weights
                                (a benchmark-only dependency; skipped when not installed)
    dense-bound                 the same active FLOPs as plain matmuls: one expert's SwiGLU
                                on a (T*K, d) tensor -- what any dispatch must at least cost
    moelab.Router(<map>)        the router alone (scorer, map, top-K, gates), per map

and reports the median milliseconds and the ratio to the dense bound. Before
timing, it checks that moelab's layer and the Mixtral block agree on the same
input (max abs difference, in the notes).

On CUDA (``run(device="cuda", dtype=torch.bfloat16)``, as ``moelab bench gpu`` calls it)
every call runs under bf16 autocast and the timings synchronise the device.

Shape suffixes: T, D, F, E, K (moelab.shapes).
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moelab.bench import MOE_SHAPES
from moelab.bench.timing import fwd_and_fwdbwd, num_threads, pass_tables, ratio_rows
from moelab.moe import MoE, MoEConfig
from moelab.moe.experts import grouped_alignment_problem, grouped_mm_available
from moelab.routing import Router, RouterConfig

#: (T, d, f, E, K): the shapes the issue asks for.
SHAPES: tuple[tuple[int, int, int, int, int], ...] = MOE_SHAPES
ROUTER_MAPS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("softmax", {}),
    ("sparsemax", {}),
    ("entmax", {"alpha": 1.5}),
    ("normmax", {"alpha": 2.0}),
)
REFERENCE = "dense-bound"
GROUPED = "moelab.MoE (grouped)"


def _timer(device: torch.device, dtype: torch.dtype):
    """fwd_and_fwdbwd on ``device`` (on CUDA: under autocast to ``dtype``, synchronised)."""
    return functools.partial(fwd_and_fwdbwd, device=device, dtype=dtype)


def _mixtral_block(moe: MoE) -> torch.nn.Module | None:
    """A transformers Mixtral sparse-MoE block holding ``moe``'s weights, or None."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    ex = moe.experts
    cfg = MixtralConfig(
        hidden_size=ex.d_model,
        intermediate_size=ex.d_ff,
        num_local_experts=ex.n_experts,
        num_experts_per_tok=moe.config.router.top_k,
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ex.w_gate_EFD, ex.w_up_EFD], dim=1))
        block.experts.down_proj.copy_(ex.w_down_EDF)
    return block


def _time_shape(
    T: int,
    d: int,
    f: int,
    E: int,
    K: int,
    repeats: int,
    warmup: int,
    seed: int,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    mixtral: bool = True,
    routers: bool = True,
) -> tuple[list[tuple[str, float, float]], list[str]]:
    """(impl, fwd ms, fwd+bwd ms) for every implementation at one shape (on ``device``,
    computing in ``dtype``: float32 on CPU, bf16 autocast on CUDA)."""
    device = device or torch.device("cpu")
    fwd_and_fwdbwd = _timer(device, dtype)
    shape = f"T={T},d={d},f={f},E={E},K={K}"
    notes: list[str] = []
    torch.manual_seed(seed)
    rc = RouterConfig(d_model=d, n_experts=E, top_k=K, map="softmax", renorm=K > 1)
    moe = MoE(MoEConfig(d_model=d, d_ff=f, router=rc)).to(device)
    x = torch.randn(T, d, device=device)
    moe.experts.impl = "loop"
    timed = [
        (
            "moelab.MoE",
            *fwd_and_fwdbwd(lambda a: moe(a)[0], list(moe.parameters()), x, repeats, warmup),
        )
    ]
    _time_grouped(moe, x, shape, dtype, fwd_and_fwdbwd, repeats, warmup, timed, notes)
    moe.experts.impl = "loop"
    if mixtral:
        _time_mixtral(moe, x, shape, device, fwd_and_fwdbwd, repeats, warmup, timed, notes)
    # Dense lower bound: one expert's weights on all T*K rows.
    w1 = torch.nn.Parameter(torch.randn(f, d, device=device) * 0.02)
    w3 = torch.nn.Parameter(torch.randn(f, d, device=device) * 0.02)
    w2 = torch.nn.Parameter(torch.randn(d, f, device=device) * 0.02)

    def dense(a: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(a, w1)) * F.linear(a, w3), w2)

    x_dense = torch.randn(T * K, d, device=device)
    timed.append((REFERENCE, *fwd_and_fwdbwd(dense, [w1, w2, w3], x_dense, repeats, warmup)))
    for name, kw in ROUTER_MAPS if routers else ():
        torch.manual_seed(seed)
        rcfg = RouterConfig(d_model=d, n_experts=E, top_k=K, map=name, **kw)
        router = Router(rcfg).to(device)
        timed.append(
            (
                f"moelab.Router({name})",
                *fwd_and_fwdbwd(
                    lambda a, r=router: r(a).weights_TK, [router.weight], x, repeats, warmup
                ),
            )
        )
    return timed, notes


def _time_grouped(
    moe: MoE,
    x: torch.Tensor,
    shape: str,
    dtype: torch.dtype,
    fwd_and_fwdbwd: Any,
    repeats: int,
    warmup: int,
    timed: list[tuple[str, float, float]],
    notes: list[str],
) -> None:
    """Append the grouped-GEMM row of ``moe`` to ``timed`` (its experts left grouped), or
    a note saying why there is none."""
    d, f = moe.experts.d_model, moe.experts.d_ff
    problem = (
        f"this torch ({torch.__version__}) has no torch._grouped_mm"
        if not grouped_mm_available()
        else grouped_alignment_problem(dtype, d, f)
    )
    if problem is None:
        moe.experts.impl = "grouped"
        try:
            timed.append(
                (
                    GROUPED,
                    *fwd_and_fwdbwd(
                        lambda a: moe(a)[0], list(moe.parameters()), x, repeats, warmup
                    ),
                )
            )
        except RuntimeError as err:  # e.g. a GPU the grouped kernels do not support
            notes.append(f"{shape}: no grouped row: {str(err).splitlines()[0]}")
    else:
        notes.append(f"{shape}: no grouped row: {problem}")


def _time_mixtral(
    moe: MoE,
    x: torch.Tensor,
    shape: str,
    device: torch.device,
    fwd_and_fwdbwd: Any,
    repeats: int,
    warmup: int,
    timed: list[tuple[str, float, float]],
    notes: list[str],
) -> None:
    """Append the row of the Mixtral block holding ``moe``'s weights to ``timed``, with a
    note of their difference on ``x``; only a note when transformers is missing."""
    block = _mixtral_block(moe)
    if block is None:
        notes.append("transformers is not installed: no Mixtral rows (pip install transformers)")
        return
    block = block.to(device)
    with torch.no_grad():
        diff = (block(x[None])[0] - moe(x)[0]).abs().max().item()
    notes.append(f"{shape}: max |moelab - Mixtral| on the same input = {diff:.2e}")
    timed.append(
        (
            "hf.MixtralSparseMoeBlock",
            *fwd_and_fwdbwd(
                lambda a: block(a[None])[0], list(block.parameters()), x, repeats, warmup
            ),
        )
    )


def run(
    shapes: Sequence[tuple[int, int, int, int, int]] = SHAPES,
    threads: int | None = 1,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    mixtral: bool = True,
    routers: bool = True,
) -> dict:
    """Time the layer (loop and grouped experts), the Mixtral block, the dense bound and
    the router alone, on ``device`` computing in ``dtype`` (autocast on CUDA); ``mixtral``
    and ``routers`` False leave those rows out."""
    device = torch.device(device)
    rows: list[dict] = []
    notes: list[str] = []
    with num_threads(threads):
        used = torch.get_num_threads()
        for i, (T, d, f, E, K) in enumerate(shapes):
            shape = f"T={T},d={d},f={f},E={E},K={K}"
            if progress:
                print(f"[{i + 1}/{len(shapes)}] {shape}", file=sys.stderr, flush=True)
            timed, shape_notes = _time_shape(
                T, d, f, E, K, repeats, warmup, seed, device, dtype, mixtral, routers
            )
            notes += shape_notes
            rows += ratio_rows({name: (fw, fb) for name, fw, fb in timed}, REFERENCE, shape)
            gc.collect()
    notes.append(
        f"ms: median of {repeats} timed calls after {warmup} warm-up calls; ratio: ms over "
        f"the dense bound's for the same shape and pass"
    )
    return {
        "rows": rows,
        "threads": used,
        "torch": torch.__version__,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "notes": notes,
    }


def format_table(result: dict) -> str:
    """One table per pass: implementations down, shapes across, ms and ratio."""
    return pass_tables(result, "impl", "dense bound")
