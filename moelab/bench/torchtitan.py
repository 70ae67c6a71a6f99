"""``moelab bench torchtitan``: what a moelab router costs inside torchtitan's ``MoE``.

For each shape (T tokens as B = T / L sequences of L tokens, width d, expert width f, E
experts, top-K) it builds one torchtitan ``MoE`` module (``models.common.moe``, as
torchtitan's DeepSeek-V3 ``debugmodel`` makes it: a softmax ``TokenChoiceTopKRouter``,
top-K without renormalisation, grouped experts, the local token dispatcher, no shared
experts, no expert bias) and two copies with the same weights whose routers
:func:`moelab.integrations.torchtitan.swap_routers` replaced:

``engine``
    torchtitan's own router (the reference of the ratios);
``moelab softmax``
    ``swap_routers(moe)``: the moelab Router that reproduces it (the cost of the swap
    itself);
``moelab entmax 1.5``
    ``swap_routers(moe, map="entmax", alpha=1.5)``.

It times forward (no grad) and forward+backward (the backward of ``(y * g).sum()`` into
the input and every parameter) of each module, and forward+backward of its router alone
(pass ``router``: the backward of the sum of the K gate weights), which is the part that
differs. The three take turns call by call, after
``warmup`` rounds, so the machine's load falls on all alike; each figure is the median of
``repeats`` calls (each round starts with another arm), and a ratio is a time over the
engine's in the same pass. torchtitan's
grouped experts multiply in bfloat16 (``GroupedExperts.forward`` casts), on the CPU too:
the figures are the module as the engine runs it. The CPU (model, vector flags, torch's
kernel set) and the thread count are in the result.

Shape suffixes: B, L, K (moelab.shapes).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moelab.bench import TORCHTITAN_SHAPES
from moelab.bench.timing import num_threads, significant
from moelab.train.provenance import cpu_info

__all__ = ["ARMS", "SEQ_LEN", "SHAPES", "format_table", "run", "torchtitan_moe"]

SHAPES: tuple[tuple[int, int, int, int, int], ...] = TORCHTITAN_SHAPES
"""(T, d, f, E, K) timed by default (:data:`moelab.bench.TORCHTITAN_SHAPES`)."""
SEQ_LEN = 512
"""Tokens per sequence (L): T = B * L (a shape's T below L is one sequence of T)."""
ARMS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("engine", None),
    ("moelab softmax", {}),
    ("moelab entmax 1.5", {"map": "entmax", "alpha": 1.5}),
)
"""(name, swap_routers keys; None: torchtitan's own router)."""
REFERENCE = "engine"
PASSES = ("fwd", "fwdbwd", "router")
"""The module's forward, its forward+backward, its router's forward+backward."""


def torchtitan_moe(d: int, f: int, n_experts: int, top_k: int, seed: int = 0) -> torch.nn.Module:
    """A torchtitan ``MoE`` (softmax top-K router, no renormalisation, no shared experts,
    no expert bias) with normal(0, 0.02) gate and expert weights, in train mode."""
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    def normal(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, std=0.02)

    experts = dict.fromkeys(("w1_EFD", "w2_EDF", "w3_EFD"), normal)
    cfg = make_moe_config(
        num_experts=n_experts,
        router=make_router_config(
            dim=d, num_experts=n_experts, gate_param_init={"weight": normal}, top_k=top_k,
            score_func="softmax",
        ),
        routed_experts=make_routed_experts_config(
            dim=d, hidden_dim=f, num_experts=n_experts, top_k=top_k, param_init=experts,
            comm_backend="standard",
        ),
        load_balance_coeff=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    moe = cfg.build()
    moe.init_states()
    return moe.train()


def _arms(d: int, f: int, n_experts: int, top_k: int) -> dict[str, torch.nn.Module]:
    from moelab.integrations.torchtitan import swap_routers

    base = torchtitan_moe(d, f, n_experts, top_k)
    arms: dict[str, torch.nn.Module] = {}
    for name, keys in ARMS:
        moe = copy.deepcopy(base)
        if keys is not None:
            swap_routers(moe, **keys)
        arms[name] = moe
    return arms


def _passes(
    moe: torch.nn.Module, x: torch.Tensor, g: torch.Tensor
) -> tuple[Callable[[], object], Callable[[], object]]:
    params = [p for p in moe.parameters() if p.requires_grad]

    def fwd() -> None:
        with torch.no_grad():
            moe(x)

    def fwdbwd() -> None:
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_(True)
        (moe(xg) * g).sum().backward()

    return fwd, fwdbwd


def _router_pass(moe: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    params = [p for p in moe.router.parameters() if p.requires_grad]

    def fwdbwd() -> None:
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_(True)
        weights_BLK, _, _ = moe.router(xg, getattr(moe, "expert_bias_E", None))
        weights_BLK.sum().backward()

    return fwdbwd


def _interleaved(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict:
    """Median ms of each call, the calls taking turns ``warmup + repeats`` times; round
    ``i`` starts with call ``i mod n``, so that no call always follows the same one."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(warmup + repeats):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            start = time.perf_counter()
            calls[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _check_shape(shape: Sequence[int]) -> None:
    t, d, f, e, k = shape
    if min(t, d, f, e, k) < 1 or k > e:
        raise ValueError(f"a shape T,d,f,E,K needs every number >= 1 and K <= E, got {shape}")
    if t > SEQ_LEN and t % SEQ_LEN:
        raise ValueError(f"T = {t} is not a whole number of {SEQ_LEN}-token sequences")


def run(
    shapes: Sequence[tuple[int, int, int, int, int]] = SHAPES,
    threads: int | None = 1,
    repeats: int = 7,
    warmup: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every arm of :data:`ARMS` on every shape (module docstring)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"bench torchtitan needs repeats >= 1 and warmup >= 0, got "
                         f"{repeats}, {warmup}")  # fmt: skip
    for shape in shapes:
        _check_shape(shape)
    rows: list[dict[str, Any]] = []
    with num_threads(threads):
        used = torch.get_num_threads()
        for t, d, f, e, k in shapes:
            label = f"T={t} d={d} f={f} E={e} K={k}"
            if progress:
                print(f"bench torchtitan: {label}", file=sys.stderr, flush=True)
            seq = min(t, SEQ_LEN)
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(t // seq, seq, d, generator=gen)
            g = torch.randn(t // seq, seq, d, generator=gen)
            arms = _arms(d, f, e, k)
            passes = {
                name: (*_passes(moe, x, g), _router_pass(moe, x)) for name, moe in arms.items()
            }
            for j, p in enumerate(PASSES):
                ms = _interleaved({n: c[j] for n, c in passes.items()}, repeats, warmup)
                for name, value in ms.items():
                    rows.append({
                        "impl": name, "shape": label, "pass": p, "ms": significant(value),
                        "ratio": significant(value / ms[REFERENCE]),
                    })  # fmt: skip
    import torchtitan

    return {
        "rows": rows,
        "threads": used,
        "repeats": repeats,
        "warmup": warmup,
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", None) or _version("torchtitan"),
        "notes": [
            "ratio = time / torchtitan's own router in the same pass; the arms take turns",
            "torchtitan's grouped experts multiply in bfloat16 (GroupedExperts.forward)",
        ],
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def format_table(result: dict[str, Any]) -> str:
    """One Markdown table per pass: arms down, shapes across, "ms (ratio)" cells; the
    CPU and versions above, the notes below."""
    from moelab.bench.timing import pass_tables

    cpu = result["cpu"]
    flags = " ".join(cpu.get("flags", [])) or "-"
    head = (
        f"cpu: {cpu.get('model')} ({cpu.get('arch')}; {flags}; torch kernels "
        f"{cpu.get('torch_capability', '?')})  torchtitan={result['torchtitan']}"
    )
    tables = pass_tables(result, "router", "engine")
    body, _, notes = tables.partition("\n\nnote: ")
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    cell = {(r["impl"], r["shape"]): r for r in result["rows"] if r["pass"] == "router"}
    out = [body, "", "the router alone, forward+backward:"]
    out.append("| router | " + " | ".join(shapes) + " |")
    out.append("|:--|" + "--:|" * len(shapes))
    for impl in dict.fromkeys(r["impl"] for r in result["rows"]):
        vals = [cell.get((impl, sh)) for sh in shapes]
        shown = [f"{v['ms']:.2f} ms ({v['ratio']:.2f}x)" if v else "-" for v in vals]
        out.append(f"| {impl} | " + " | ".join(shown) + " |")
    return head + "\n" + "\n".join(out) + ("\n\nnote: " + notes if notes else "")
