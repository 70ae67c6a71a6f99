"""What the ``temperature`` study (:mod:`moelab.studies.temperature`) measures on each
trained run (:func:`measure`, cached in ``RUN/analysis``): perplexity, load, dropped
slots and dropped tokens, tau, ||W||_2, certified radii, and the numerical check of the
paper's Theorem 1 (the gate ``softmax(W x / tau)`` is ``||W||_2 / (2 tau)``-Lipschitz) on the token
representations the trained routers see.

Shape suffixes: B, S, T, D, E, W, Y (moelab.shapes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "ANALYSIS_KEY",
    "MAX_BATCHES",
    "MAX_TOKENS",
    "NEIGHBOUR_TOKENS",
    "RANDOM_PAIRS",
    "collect_router_inputs",
    "gate",
    "lipschitz_check",
    "measure",
    "sample_pairs",
]

MAX_TOKENS = 4096
"""Router inputs kept per MoE layer for the theorem check (an even stride over the pass)."""
RANDOM_PAIRS = 20000
"""Random pairs of token representations per MoE layer in the theorem check."""
NEIGHBOUR_TOKENS = 1024
"""Tokens paired with their nearest neighbour per MoE layer in the theorem check."""

MAX_BATCHES = {"quick": 2, "cpu": 16, "paper": 64}
"""Validation batches of the analysis per scale (``--max-batches`` overrides)."""
RADII_KEPT = 5000
"""Certified radii per run kept for the histogram (an even stride)."""
ANALYSIS_KEY = "temperature-v3"
"""Name of the cached analysis of a run (``RUN/analysis/temperature-v3-N.json`` for N
validation batches; the version changes when the analysis does)."""

# NOTE: a tolerance for float64 rounding when a ratio equals the bound (the theorem is
# tight for two experts at a tie), not a slack on the bound itself
_RATIO_TOL = 1e-9


# ------------------------------------------------------------------- the theorem check


def gate(x_TD: torch.Tensor, weight_ED: torch.Tensor, tau: float) -> torch.Tensor:
    """The paper's gate ``g_tau(x) = softmax(W x / tau)`` (eq. 1) of each row of ``x_TD``,
    in float64."""
    z_TE = x_TD.to(torch.float64) @ weight_ED.to(torch.float64).t() / float(tau)
    return torch.softmax(z_TE, dim=-1)


def sample_pairs(
    x_TD: torch.Tensor,
    n_random: int = RANDOM_PAIRS,
    n_neighbours: int = NEIGHBOUR_TOKENS,
    seed: int = 0,
) -> torch.Tensor:
    """Index pairs ``(Y, 2)`` of rows of ``x_TD`` for the theorem check: ``n_random`` pairs
    drawn uniformly (a seeded generator) and, for ``n_neighbours`` of the rows (an even
    stride), each with its nearest other row (Euclidean), where the gate changes least
    predictably. Pairs of two identical rows are left out (their ratio is undefined)."""
    n = x_TD.shape[0]
    if n < 2:
        raise ValueError(f"the theorem check needs at least 2 token representations, got {n}")
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, n, (n_random,), generator=gen)
    b = torch.randint(0, n - 1, (n_random,), generator=gen)
    b = b + (b >= a).long()  # a different row
    pairs = [torch.stack([a, b], dim=1)]
    if n_neighbours > 0:
        rows = torch.arange(0, n, max(1, n // n_neighbours))[:n_neighbours]
        d_WT = torch.cdist(x_TD[rows].to(torch.float64), x_TD.to(torch.float64))
        d_WT[torch.arange(len(rows)), rows] = math.inf  # not itself
        pairs.append(torch.stack([rows, d_WT.argmin(dim=1)], dim=1))
    out = torch.cat(pairs)
    x64 = x_TD.to(torch.float64)
    keep = (x64[out[:, 0]] - x64[out[:, 1]]).norm(dim=-1) > 0
    return out[keep]


def lipschitz_check(
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    tau: float,
    pairs_Y2: torch.Tensor,
    constant: float | None = None,
) -> dict[str, Any]:
    """Check ``||g(x) - g(y)||_2 <= C ||x - y||_2`` on the pairs of rows ``pairs_Y2`` of
    ``x_TD``, with ``g`` the gate ``softmax(W x / tau)`` and ``C`` the paper's constant
    ``||W||_2 / (2 tau)`` (Theorem 1; ``constant`` replaces it, e.g. to show that a wrong
    constant is caught). Everything in float64.

    Returns ``{"pairs", "constant", "weight_norm", "tau", "max_ratio", "median_ratio",
    "violations"}``: the ratios ``||g(x) - g(y)|| / (C ||x - y||)`` (at most 1 where the
    bound holds) and the number of pairs above 1 (beyond float64 rounding)."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    w = weight_ED.detach().to(torch.float64)
    weight_norm = float(torch.linalg.matrix_norm(w, ord=2))
    c = weight_norm / (2.0 * float(tau)) if constant is None else float(constant)
    if not c > 0:
        raise ValueError(f"the Lipschitz constant must be > 0, got {c}")
    x = x_TD.detach().to(torch.float64)
    xa, xb = x[pairs_Y2[:, 0]], x[pairs_Y2[:, 1]]
    dx_Y = (xa - xb).norm(dim=-1)
    dg_Y = (gate(xa, w, tau) - gate(xb, w, tau)).norm(dim=-1)
    ratio_Y = dg_Y / (c * dx_Y)
    if not len(ratio_Y):
        raise ValueError("no pair of distinct token representations to check")
    return {
        "pairs": len(ratio_Y),
        "constant": c,
        "weight_norm": weight_norm,
        "tau": float(tau),
        "max_ratio": float(ratio_Y.max()),
        "median_ratio": float(ratio_Y.quantile(0.5)),
        "violations": int((ratio_Y > 1.0 + _RATIO_TOL).sum()),
    }


@torch.no_grad()
def collect_router_inputs(
    model: torch.nn.Module,
    xy_batches: Any,
    max_batches: int,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[torch.Tensor], float, int]:
    """One pass over ``xy_batches`` (at most ``max_batches``): the inputs each MoE layer's
    router saw (a forward pre-hook; at most ``max_tokens`` rows per layer, an even stride
    over the pass) and the mean next-token NLL per target token and the number of target
    tokens (for every model, dense ones included)."""
    routers = [layer.router for layer in model.moe_layers]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]

    def keep(i: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            seen[i].append(args[0].detach().float().cpu())

        return hook

    handles = [r.register_forward_pre_hook(keep(i)) for i, r in enumerate(routers)]
    total, n_tokens, n_batches = 0.0, 0, 0
    try:
        for x_BS, y_BS in xy_batches:
            if n_batches >= max_batches:
                break
            out = model(x_BS, y_BS)
            n = int((y_BS != -100).sum())
            total += float(out.loss) * n
            n_tokens += n
            n_batches += 1
    finally:
        for h in handles:
            h.remove()
    if n_batches == 0:
        raise ValueError("no validation batch to evaluate: the run's validation split is empty")
    inputs = []
    for chunks in seen:
        x_TD = torch.cat(chunks)
        step = max(1, math.ceil(len(x_TD) / max_tokens))
        inputs.append(x_TD[::step][:max_tokens].contiguous())
    return inputs, total / n_tokens, n_tokens


# ------------------------------------------------------------------- one run


def measure(run: Path, max_batches: int) -> dict[str, Any]:
    """Everything the study reads from one trained run (JSON-ready, cached)."""
    from moelab.data import batches
    from moelab.diagnostics import load_run, stats

    loaded = load_run(run)
    cfg = loaded.config
    val = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    inputs, nll, n_tokens = collect_router_inputs(loaded.model, val, max_batches)
    res: dict[str, Any] = {"nll": nll, "ppl": math.exp(nll), "tokens": n_tokens}
    if not loaded.model.moe_layers:
        return res
    st = stats(loaded, max_batches=max_batches, radii=True)
    checks = []
    for i, (layer, x_TD) in enumerate(zip(loaded.model.moe_layers, inputs, strict=True)):
        router = layer.router
        pairs = sample_pairs(x_TD, seed=i)
        checks.append(
            {"layer": i, **lipschitz_check(x_TD, router.weight, router.temperature.value, pairs)}
        )
    radii = np.asarray(st["radii"], dtype=np.float64)
    stride = max(1, math.ceil(radii.size / RADII_KEPT))
    mean = st["mean"]
    res.update(
        stats_nll=st["nll"],
        load_cv=mean["nominal_cv"],
        computed_load_cv=mean["load_cv"],
        dropped=mean["dropped_fraction"],
        dropped_tokens=mean["dropped_tokens"],
        tau=mean["tau"],
        weight_norm=mean["weight_norm"],
        lipschitz=mean["lipschitz"],
        radius_rel_p50=mean["radius_rel_p50"],
        load_shares=[lay["load_shares"] for lay in st["layers"]],
        radii=[float(f"{r:.6g}") for r in radii[::stride]],
        theorem=checks,
        max_ratio=max(c["max_ratio"] for c in checks),
        violations=sum(c["violations"] for c in checks),
        pairs=sum(c["pairs"] for c in checks),
    )
    return res
