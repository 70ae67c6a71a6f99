"""What the ``gate-norm`` study measures on a trained run (:mod:`moelab.studies.gate_norm`):
its loss and routing, how often training-time routing leaves the top-k, the router's
gradient through a K = 1 renormalised gate, and the loss oracle: each expert's loss on
sampled tokens beside the router's ranking (W: the sampled tokens).

Shape suffixes: B, S, T, D, E, K, V, W (moelab.shapes).
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


# ------------------------------------------------------------------- the loss oracle

ORACLE_TOKENS = 128
"""Validation tokens of the loss oracle per run (an even stride over the first batch)."""
ORACLE_LAYER = -1
"""The MoE layer the oracle replaces (index into ``model.moe_layers``: the last)."""


@torch.no_grad()
def expert_losses(
    model: torch.nn.Module,
    x_BS: torch.Tensor,
    y_BS: torch.Tensor,
    positions_W2: torch.Tensor,
    layer: int = ORACLE_LAYER,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The essay's l(e_i) on trained weights: for each token ``(b, t)`` of
    ``positions_W2``, the next-token loss at ``t`` (cross-entropy against ``y_BS[b, t]``,
    nats, float64) if MoE layer ``layer``'s output at that token were expert i's output
    alone, with weight 1 (the shared experts' output, if any, kept), for every expert i;
    every other token and layer as the model computes it. Since attention is causal, the
    loss at t reads positions <= t only, so each token's E variants run as one batch of
    the sequence's first t + 1 positions. Also the router's map values at those tokens
    (its ranking of the experts, before any selection bias).

    Returns ``(losses_WE, scores_WE)``, both float64."""
    moe = model.moe_layers[layer]
    n_experts = moe.config.n_experts
    seen: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        seen["probs_TE"] = output[1].probs_TE.detach()

    handle = moe.register_forward_hook(keep)
    try:
        model(x_BS, collect=False)
    finally:
        handle.remove()
    B, S = x_BS.shape
    probs_BSE = seen["probs_TE"].reshape(B, S, -1)[..., :n_experts]
    losses, scores = [], []
    for b, t in positions_W2.tolist():

        def replace(module: torch.nn.Module, args: Any, output: Any, t: int = t) -> Any:
            y_ESD, out = output
            x_ED = args[0][:, t, :]
            y_ESD = y_ESD.clone()
            for e in range(n_experts):
                y_ED = module.experts.forward_expert(e, x_ED[e : e + 1])
                if module.shared is not None:
                    y_ED = y_ED + module.shared(x_ED[e : e + 1])
                y_ESD[e, t] = y_ED[0].to(y_ESD.dtype)
            return y_ESD, out

        handle = moe.register_forward_hook(replace)
        try:
            prefix_ES = x_BS[b, : t + 1].unsqueeze(0).expand(n_experts, -1)
            logits_EV = model(prefix_ES, collect=False).logits_BSV[:, t].double()
        finally:
            handle.remove()
        target = torch.full((n_experts,), int(y_BS[b, t]), dtype=torch.long)
        losses.append(torch.nn.functional.cross_entropy(logits_EV, target, reduction="none"))
        scores.append(probs_BSE[b, t].double())
    if not losses:
        raise ValueError("no token to measure the loss oracle on")
    return torch.stack(losses), torch.stack(scores)


def _ranks(v_WE: torch.Tensor) -> torch.Tensor:
    """Ranks 1..E of each row's values, ties given their average rank (as Spearman's)."""
    order = v_WE.argsort(dim=-1, stable=True)
    sorted_WE = v_WE.gather(-1, order)
    first = torch.ones_like(sorted_WE, dtype=torch.bool)
    first[:, 1:] = sorted_WE[:, 1:] != sorted_WE[:, :-1]
    group_WE = first.long().cumsum(-1) - 1  # tie group of each sorted entry
    pos_WE = torch.arange(1, v_WE.shape[-1] + 1, dtype=torch.float64).expand_as(sorted_WE)
    total = torch.zeros_like(sorted_WE).scatter_add_(-1, group_WE, pos_WE)
    count = torch.zeros_like(sorted_WE).scatter_add_(-1, group_WE, torch.ones_like(pos_WE))
    avg_WE = (total / count.clamp_min(1)).gather(-1, group_WE)
    return torch.empty_like(avg_WE).scatter_(-1, order, avg_WE)


def oracle_agreement(losses_WE: torch.Tensor, scores_WE: torch.Tensor) -> dict[str, Any]:
    """How far the router ranks experts as their losses do (the essay's
    argmax rho = argmin l): ``top1`` the share of tokens whose highest-scored expert
    (first on ties) is an expert of least loss; ``spearman`` the mean over tokens of
    Spearman's rank correlation between the scores and the negated losses (average ranks
    for ties; a token whose scores or losses are all equal has none and is left out,
    ``None`` if every one is); ``regret`` the mean loss of the router's top-1 expert
    minus the least loss (nats); ``chance`` 1 / E, the top-1 agreement of a router
    that ranks at random; ``tokens``."""
    if losses_WE.shape != scores_WE.shape or losses_WE.dim() != 2:
        raise ValueError(
            f"losses and scores must be (tokens, experts) of one shape, got "
            f"{tuple(losses_WE.shape)} and {tuple(scores_WE.shape)}"
        )
    losses = losses_WE.double()
    scores = scores_WE.double()
    best_W = scores.argmax(-1)
    least_W = losses.min(-1).values
    chosen_W = losses.gather(-1, best_W.unsqueeze(-1)).squeeze(-1)
    r_s, r_l = _ranks(scores), _ranks(-losses)
    r_s = r_s - r_s.mean(-1, keepdim=True)
    r_l = r_l - r_l.mean(-1, keepdim=True)
    den_W = (r_s.square().sum(-1) * r_l.square().sum(-1)).sqrt()
    ok_W = den_W > 0
    rho_W = (r_s * r_l).sum(-1)[ok_W] / den_W[ok_W]
    return {
        "top1": float((chosen_W == least_W).double().mean()),
        "spearman": float(rho_W.mean()) if len(rho_W) else None,
        "regret": float((chosen_W - least_W).mean()),
        "chance": 1.0 / losses.shape[-1],
        "tokens": int(losses.shape[0]),
    }


def oracle(
    run: str | Path, n_tokens: int = ORACLE_TOKENS, layer: int = ORACLE_LAYER
) -> dict[str, Any]:
    """:func:`oracle_agreement` of a trained run at MoE layer ``layer`` on ``n_tokens``
    tokens of the first validation batch (an even stride over its B x S positions with a
    target), from :func:`expert_losses`."""
    from moelab.data import batches
    from moelab.diagnostics import load_run

    loaded = load_run(run)
    cfg, model = loaded.config, loaded.model
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    x_BS, y_BS = next(iter(data))
    valid = (y_BS != -100).nonzero()
    stride = max(1, len(valid) // n_tokens)
    positions = valid[::stride][:n_tokens]
    losses_WE, scores_WE = expert_losses(model, x_BS, y_BS, positions, layer)
    return {"layer": layer, **oracle_agreement(losses_WE, scores_WE)}
