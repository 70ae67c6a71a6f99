"""What the ``gate-norm`` study measures on a trained run (:mod:`moelab.studies.gate_norm`):
its loss and routing, how often training-time routing leaves the top-k, and the router's
gradient through a K = 1 renormalised gate.

Shape suffixes: B, S, T, D, E, K (moelab.shapes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MAX_BATCHES = {"quick": 2, "cpu": 32}
"""Validation batches of the analysis at each scale (``--max-batches`` overrides)."""


def measure(run: str | Path, max_batches: int | None) -> dict[str, Any]:
    """The study's numbers for one trained run, from one pass of
    :func:`moelab.diagnostics.stats` over the first ``max_batches`` validation batches:
    ``val_loss`` (the mean NLL per token, nats), ``ppl`` (its exp), ``active_experts``,
    ``contributors``, ``load_cv`` (means over the MoE layers), ``discarded_mass`` (as
    ``stats`` gives it: None for sigmoid and ReLU, whose values are no distribution),
    ``gate_sum``
    (the mean over tokens, then layers, of the sum of a token's gate weights, as the
    experts' outputs are weighted in the forward pass), ``map`` and ``tokens``."""
    from moelab.diagnostics import load_run, stats

    loaded = load_run(run)
    routers = [layer.router for layer in loaded.model.moe_layers]
    sums = [[0.0, 0] for _ in routers]  # per layer: sum of gate weights, tokens

    def keep(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            w_TK = out.weights_TK.detach().double()
            sums[i][0] += float(w_TK.sum())
            sums[i][1] += int(w_TK.shape[0])

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        doc = stats(loaded, max_batches=max_batches)
    finally:
        for h in handles:
            h.remove()
    mean = doc["mean"]
    per_layer = [s / n for s, n in sums if n]
    return {
        "map": doc["map"],
        "val_loss": doc["nll"],
        "ppl": math.exp(doc["nll"]),
        "active_experts": mean["active_experts"],
        "contributors": mean["contributors"],
        "discarded_mass": mean["discarded_mass"],
        "gate_sum": sum(per_layer) / len(per_layer) if per_layer else None,
        "load_cv": mean["load_cv"],
        "tokens": doc["tokens"],
    }


def selected_TE(out: Any) -> torch.Tensor:
    """bool (T, E): the experts each token's selected slots hold (a RouterOutput)."""
    sel_TE = torch.zeros(out.probs_TE.shape[0], out.n_experts, dtype=torch.bool)
    real_TK = out.selected_TK & (out.ids_TK < out.n_experts)
    return sel_TE.scatter_(-1, torch.where(real_TK, out.ids_TK, 0), real_TK)


@torch.no_grad()
def exploration(run: str | Path, max_batches: int | None, seed: int = 0) -> float | None:
    """How far the trained routers' training-time choice strays from their evaluation-time
    choice: the share of the (token, expert) pairs selected in evaluation mode that
    training mode (noise on the scores, sampling from the top K + c, drawn with a
    generator seeded ``seed``) does not select, over the MoE layers and the tokens of the
    first ``max_batches`` validation batches. 0 for a router without exploration."""
    from moelab.data import batches
    from moelab.diagnostics import load_run

    loaded = load_run(run)
    cfg = loaded.config
    routers = [layer.router for layer in loaded.model.moe_layers]
    inputs: list[torch.Tensor | None] = [None] * len(routers)

    def keep(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            inputs[i] = args[0].detach()

        return hook

    g = torch.Generator().manual_seed(seed)
    missed, total = 0, 0
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    for b, (x_BS, _) in enumerate(data):
        if max_batches is not None and b >= max_batches:
            break
        handles = [r.register_forward_pre_hook(keep(i)) for i, r in enumerate(routers)]
        try:
            loaded.model(x_BS, collect=False)
        finally:
            for h in handles:
                h.remove()
        for router, x_TD in zip(routers, inputs, strict=True):
            assert x_TD is not None  # the router ran in this forward pass
            plain_TE = selected_TE(router(x_TD))
            router.train()
            try:
                explored_TE = selected_TE(router(x_TD, generator=g))
            finally:
                router.eval()
            missed += int((plain_TE & ~explored_TE).sum())
            total += int(plain_TE.sum())
    return missed / total if total else None


def k1_refusal(router: Any) -> str | None:
    """The message with which moelab refuses ``router`` (a RouterConfig) changed to
    K = 1 with the renormalised gate; None if it were accepted."""
    try:
        dataclasses.replace(router, top_k=1, gate="renorm", renorm=True, straight_through=False)
    except ValueError as err:
        return str(err)
    return None


def gate_gradient(gate: str, top_k: int, n_experts: int = 8, n_tokens: int = 64) -> float:
    """The largest |dL/ds| the router's scores s get through the gate ``gate`` (a name of
    :mod:`moelab.routing.gates`) with softmax top-``top_k`` selection, for
    L = sum_t sum_k w_tk c_tk with random s and c (seeded): 0 means the gate gives
    the router no gradient."""
    from moelab.routing import gates

    g = torch.Generator().manual_seed(0)
    s_TE = torch.randn(n_tokens, n_experts, generator=g, dtype=torch.float64)
    c_TK = torch.randn(n_tokens, top_k, generator=g, dtype=torch.float64)
    s_TE.requires_grad_(True)
    p_TE = torch.softmax(s_TE, -1)
    ids_TK = p_TE.detach().topk(top_k, -1).indices
    p_TK = p_TE.gather(-1, ids_TK)
    w_TK = gates.get(gate)()(p_TK, torch.ones_like(p_TK, dtype=torch.bool))
    (w_TK * c_TK).sum().backward()
    assert s_TE.grad is not None
    return float(s_TE.grad.abs().max())


def k1_checkpoint_gradient(run: str | Path) -> dict[str, float]:
    """The routers' gradient through the gate weights of a trained run with K forced to 1:
    every MoE layer's router routes top-1 (its ``top_k`` attribute; the config that
    moelab refuses is never built), the gate is re-normalised (``"renorm"``) or the
    map's value as it is (``"map"``, the control), and ``L`` is the next-token
    cross-entropy of the first validation batch (no auxiliary loss, so the only path
    from L to the router weight W is the gate weight). Gives, for each gate, ``‖∂L/∂W‖``
    over the routers' weights together (float32, as the router computes)."""
    from moelab.data import batches
    from moelab.diagnostics import load_run
    from moelab.routing import gates

    loaded = load_run(run)
    cfg, model = loaded.config, loaded.model
    routers = [layer.router for layer in model.moe_layers]
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    x_BS, y_BS = next(iter(data))
    out: dict[str, float] = {}
    for gate in ("renorm", "map"):
        for router in routers:
            router.top_k = 1
            router.gate = gates.get(gate)(router.config.routed_scaling)
        model.zero_grad(set_to_none=True)
        loss = model(x_BS, y_BS, collect=False).loss
        assert loss is not None  # targets were given
        loss.backward()
        squares = [
            float(r.weight.grad.double().pow(2).sum()) for r in routers if r.weight.grad is not None
        ]
        out[gate] = math.sqrt(sum(squares))
    return out
