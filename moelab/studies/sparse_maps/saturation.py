"""Gradient saturation past the singleton threshold (the sparse-maps paper's Figures 3
and 5), measured on a trained run of the ``sparse-maps`` study
(:mod:`moelab.studies.sparse_maps`).

A sparse map is locally constant where the top-2 score gap ``g = z(1) − z(2)`` of a
token reaches the map's threshold θ (1 for sparsemax and 2-normmax, 2 for 1.5-entmax):
the token's support is its top-1 expert alone, its gate weights are (1, 0) whatever the
scores do nearby, and the map's Jacobian is 0. The gradient the language-modelling loss
sends to the token's gate weights then reaches neither the router's scores nor its
weights: it is lost. For every MoE layer, on the tokens of a few validation batches:

``u_t``
    ``∂L/∂w_t(1)``: the gradient of the mean LM loss (no balance loss) with respect to
    the gate weight of the token's top-1 expert (the slot every token computes; the
    runner-up of a token past θ is a filler whose expert is not run). ``|u_t|`` is how
    much the loss asks of this token's routing.
``lost_share``
    ``Σ_{t: g_t ≥ θ} |u_t| / Σ_t |u_t|``: the share of that signal on tokens past the
    threshold, which the map passes on to nothing. Unweighted (every ``|u_t| = 1``) it
    is ``token_share_past``, the share of tokens past θ (= the singleton rate).
``passed_share_past``
    ``Σ_{t: g_t ≥ θ} ‖∂L/∂z_t‖₂ / Σ_t ‖∂L/∂z_t‖₂`` with ``z_t`` the router's logits: the
    share of the score gradient the router does get from tokens past θ; 0 where the map
    saturates as the threshold law says (the finding ``saturation_M``).
``aux_share_past``
    the same share for the balance loss's gradient: 0 when the loss is computed on the
    map's probabilities (they saturate too), positive when it is computed on their
    softmax (``router.aux_probs=softmax``): what the softmax-balanced arms keep.

Every sum is float64; ``layers`` gives each MoE layer's shares (named by block) and
``mean`` the shares pooled over layers (sums over every token-layer state). A map
without a threshold (softmax) gives None.

Shape suffixes: B, S, T, E, K (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moelab import maps
from moelab.routing.measures import top2_gap
from moelab.routing.output import RouterOutput

__all__ = ["BATCHES", "SUMS", "measure", "shares", "sums"]

BATCHES = {"quick": 1, "cpu": 4, "paper": 4}
"""Validation batches of the measure at each scale (each a backward pass)."""

SUMS = ("tokens", "past", "u", "u_past", "gz", "gz_past", "ga", "ga_past")
"""The float64 sums of one layer (:func:`sums`)."""


def sums(
    outs: Sequence[RouterOutput],
    loss: torch.Tensor,
    aux: torch.Tensor | None,
    threshold: float,
) -> list[dict[str, float]]:
    """The sums of :data:`SUMS` for each router output of one forward pass: ``loss`` the
    LM loss, ``aux`` the balance loss (None: no balance loss; both scalars whose graphs
    reach the outputs' ``weights_TK`` and ``logits_TE``), ``threshold`` the map's θ.
    Tokens ``past`` θ: top-2 logit gap ≥ θ."""
    ws = [o.weights_TK for o in outs]
    zs = [o.logits_TE for o in outs]
    grads = torch.autograd.grad(loss, ws + zs, retain_graph=aux is not None, allow_unused=True)
    g_aux: Sequence[torch.Tensor | None] = [None] * len(outs)
    if aux is not None and aux.requires_grad:
        g_aux = torch.autograd.grad(aux, zs, allow_unused=True)
    out = []
    for i, o in enumerate(outs):
        z_TE = o.logits_TE.detach()
        past_T = top2_gap(z_TE) >= threshold
        # the top-1 slot: the selected slot whose logit is largest
        slot_z_TK = z_TE.gather(-1, o.ids_TK).masked_fill(~o.selected_TK, float("-inf"))
        top_T1 = slot_z_TK.argmax(-1, keepdim=True)
        gw_TK = grads[i] if grads[i] is not None else torch.zeros_like(o.weights_TK)
        u_T = gw_TK.detach().double().gather(-1, top_T1).squeeze(-1).abs()
        gz_TE = grads[len(outs) + i]
        gz_T = (
            torch.zeros_like(u_T)
            if gz_TE is None
            else gz_TE.detach().double().nan_to_num().norm(dim=-1)
        )
        ga_TE = g_aux[i]
        ga_T = (
            torch.zeros_like(u_T)
            if ga_TE is None
            else ga_TE.detach().double().nan_to_num().norm(dim=-1)
        )
        out.append(
            {
                "tokens": float(past_T.numel()),
                "past": float(past_T.sum()),
                "u": float(u_T.sum()),
                "u_past": float(u_T[past_T].sum()),
                "gz": float(gz_T.sum()),
                "gz_past": float(gz_T[past_T].sum()),
                "ga": float(ga_T.sum()),
                "ga_past": float(ga_T[past_T].sum()),
            }
        )
    return out


def shares(s: dict[str, float]) -> dict[str, float | None]:
    """The shares of one layer's (or pooled) sums: ``token_share_past``, ``lost_share``,
    ``passed_share_past``, ``aux_share_past`` (None where the denominator is 0)."""

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    return {
        "token_share_past": ratio(s["past"], s["tokens"]),
        "lost_share": ratio(s["u_past"], s["u"]),
        "passed_share_past": ratio(s["gz_past"], s["gz"]),
        "aux_share_past": ratio(s["ga_past"], s["ga"]),
    }


def measure(run: str | Path, n_batches: int) -> dict[str, Any] | None:
    """The shares (module docstring) of the run's newest checkpoint on its first
    ``n_batches`` validation batches, in file order: ``{"threshold", "tokens",
    "layers": [{"block", shares...}], "mean": pooled shares}``; None for a map without
    a threshold."""
    from moelab.data import batches
    from moelab.diagnostics import load_run

    loaded = load_run(run)
    cfg = loaded.config
    model = loaded.model
    rcfg = model.moe_layers[0].router.config
    theta = maps.threshold(rcfg.map, rcfg.alpha)
    if theta is None:
        return None
    blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
    total = [dict.fromkeys(SUMS, 0.0) for _ in blocks]
    model.eval()
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    for b, (x_BS, y_BS) in enumerate(data):
        if b >= n_batches:
            break
        model.zero_grad(set_to_none=True)
        out = model(x_BS, y_BS)
        aux = out.aux_loss if out.aux_loss.requires_grad else None
        for acc, s in zip(total, sums(out.router_outputs, out.loss, aux, theta), strict=True):
            for k in SUMS:
                acc[k] += s[k]
    pooled = {k: sum(t[k] for t in total) for k in SUMS}
    return {
        "threshold": theta,
        "tokens": pooled["tokens"] / max(len(blocks), 1),
        "layers": [{"block": blk, **shares(t)} for blk, t in zip(blocks, total, strict=True)],
        "mean": shares(pooled),
    }
