"""Speed benchmark of the selection rules.

For each rule it times forward and forward+backward of the router's stages after the
scorer on float32 scores of shape (rows, E):

    scores --map--> probs --selection--> ids, selected --gate--> weights

(the scorer's matmul is left out: it costs the same for every rule and would only dilute
the ratios). Forward+backward differentiates the sum of the gate weights with respect to
the scores. Every row is reported as a ratio to ``topk`` (softmax, top-K) measured in the
same process. Rules that read the whole batch (expert choice, Sinkhorn) run in training
mode, as they would in training; Sinkhorn's cost per normalisation iteration is reported
separately, from the difference between two iteration counts, and so is quantile
balancing's bias solve (once per step, outside the forward: it routes as ``topk``).

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from moelab.bench.timing import fwd_and_fwdbwd, median_ms, num_threads, pass_tables, ratio_rows
from moelab.routing import RouterConfig
from moelab.routing.balancing import quantile_bias
from moelab.routing.router import apply_map, gate_weights
from moelab.routing.selection import Budget

REFERENCE = "topk"
VOCAB = 4096
"""Vocabulary of the random token ids the hash rule routes by."""


def arms(n_experts: int, top_k: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, RouterConfig keys) of every rule timed, the reference first."""
    k = dict(top_k=top_k)
    out: list[tuple[str, dict[str, Any]]] = [
        ("topk", k),
        ("topk+renorm", {**k, "renorm": True}),
        ("threshold", {"selection": "threshold", "truncation": 1.0 / n_experts}),
        ("top_p (cap K)", {"selection": "top_p", "top_p": 0.4, "top_p_cap": top_k}),
        ("top_p", {"selection": "top_p", "top_p": 0.4}),  # uncapped: among all E
        ("expert_choice", {**k, "selection": "expert_choice"}),
    ]
    # DeepSeek-V3's shape: 8 groups, the best 4 kept (fewer groups for a small E)
    for g in (8, 4, 2):
        if n_experts % g == 0 and n_experts // g >= 2 and top_k <= n_experts // 2:
            groups = {"n_groups": g, "topk_groups": g // 2, "map": "sigmoid", "renorm": True}
            out.append((f"topk ({g} groups, best {g // 2})", {**k, **groups}))
            break
    out.append(("sinkhorn", {**k, "selection": "sinkhorn"}))
    out.append(("hash", {**k, "selection": "hash", "vocab_size": VOCAB}))
    return out


def _route(config: RouterConfig, rows: int, seed: int):
    """The stages after the scorer as a function of the scores, and its token ids."""
    rule = config.selection_rule(config.selection_config)
    bias_E = torch.zeros(config.n_experts)
    gen = torch.Generator().manual_seed(seed)
    ids_T = torch.randint(VOCAB, (rows,), generator=gen)
    training = True  # the batch-reading rules route as in training

    def route(scores_TE: torch.Tensor) -> torch.Tensor:
        k = config.router_top_k  # what a Router would start with
        budget = Budget(k, None, config.truncation, training, None, ids_T, None)
        probs_TE = apply_map(config, scores_TE)
        ids_TK, selected_TK = rule(scores_TE, probs_TE, bias_E, budget)
        probs_TK = probs_TE.gather(-1, ids_TK)
        return gate_weights(
            probs_TK, selected_TK, config.renorm, config.straight_through, config.routed_scaling
        )

    return route


def run(
    rows: int = 65536,
    experts: Sequence[int] = (64,),
    top_k: int = 8,
    threads: int | None = 1,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
    seed: int = 0,
) -> dict:
    """Time every rule on (rows, E) scores for each E of ``experts``."""
    if rows < 1 or top_k < 1 or not experts or min(experts) < 2:
        raise ValueError(
            f"bench selection needs rows >= 1, top_k >= 1 and every E >= 2, got rows={rows}, "
            f"top_k={top_k}, experts={list(experts)}"
        )
    if top_k > min(experts):  # a rule cannot pick more experts than there are
        raise ValueError(
            f"bench selection: top_k={top_k} is above E={min(experts)} (the smallest of "
            f"experts={list(experts)}); give --top-k {min(experts)} or less, or larger --experts"
        )
    result_rows: list[dict] = []
    notes: list[str] = []
    with num_threads(threads):
        used = torch.get_num_threads()
        for E in experts:
            K = top_k
            shape = f"{rows}x{E},K={K}"
            x_TE = torch.randn(rows, E, generator=torch.Generator().manual_seed(seed))
            timed: dict[str, tuple[float, float]] = {}
            configs = arms(E, K)
            for i, (label, keys) in enumerate(configs):
                if progress:
                    print(f"[{shape}] {i + 1}/{len(configs)} {label}", file=sys.stderr, flush=True)
                config = RouterConfig(d_model=1, n_experts=E, **keys)
                timed[label] = fwd_and_fwdbwd(_route(config, rows, seed), [], x_TE, repeats, warmup)
            result_rows += ratio_rows(timed, REFERENCE, shape)
            notes.append(_sinkhorn_per_iteration(E, K, x_TE, rows, repeats, warmup, seed))
            notes.append(_quantile_solve(E, K, x_TE, rows, repeats, warmup, seed))
            gc.collect()
    notes.append(
        f"ms: median of {repeats} timed calls after {warmup} warm-up calls; ratio: ms over "
        f"{REFERENCE}'s (softmax, top-K) for the same shape and pass"
    )
    return {"rows": result_rows, "threads": used, "torch": torch.__version__, "notes": notes}


def _sinkhorn_per_iteration(
    E: int, K: int, x_TE: torch.Tensor, rows: int, repeats: int, warmup: int, seed: int
) -> str:
    """Sinkhorn's forward cost per normalisation iteration, from 1 and n iterations."""
    base = RouterConfig(d_model=1, n_experts=E, top_k=K, selection="sinkhorn")
    many = max(base.sinkhorn_iters, 2) * 4
    ms = {}
    for n in (1, many):
        route = _route(replace(base, sinkhorn_iters=n), rows, seed)
        ms[n] = fwd_and_fwdbwd(route, [], x_TE, repeats, warmup)[0]
    per = (ms[many] - ms[1]) / (many - 1)
    topk = RouterConfig(d_model=1, n_experts=E, top_k=K)
    ref = fwd_and_fwdbwd(_route(topk, rows, seed), [], x_TE, repeats, warmup)[0]
    return (
        f"sinkhorn on {rows}x{E}: {per:.3f} ms per iteration ({per / ref:.3f}x top-K's forward), "
        f"default sinkhorn_iters={base.sinkhorn_iters}"
    )


def _quantile_solve(
    E: int, K: int, x_TE: torch.Tensor, rows: int, repeats: int, warmup: int, seed: int
) -> str:
    """The cost of quantile balancing's bias solve (``bias_update="quantile"``), which runs
    once per optimiser step and layer on the step's scores, not in the forward: its
    routing is top-K on scores + bias, timed as ``topk``."""
    bias_E = torch.zeros(E)
    ms = median_ms(lambda: quantile_bias(x_TE, bias_E, K), repeats, warmup)
    topk = RouterConfig(d_model=1, n_experts=E, top_k=K)
    ref = fwd_and_fwdbwd(_route(topk, rows, seed), [], x_TE, repeats, warmup)[0]
    return (
        f"quantile balancing on {rows}x{E}: its bias solve takes {ms:.3f} ms per step and "
        f"layer ({ms / ref:.3f}x top-K's forward); it routes as topk"
    )


def format_table(result: dict) -> str:
    """One table per pass: rules down, shapes across, ms and ratio to top-K."""
    return pass_tables(result, "rule", "top-K's")
