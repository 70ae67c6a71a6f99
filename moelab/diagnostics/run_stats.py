"""The routing statistics of a trained run (``moelab stats``): one ordered pass over the
validation split (or a corpus) with the newest checkpoint, or the one
``load_run(run, step=N)`` (``--step N``) names, with its trained K.

    stats("runs/run")                              # the DESIGN.md ``stats`` document

Each MoE layer's streaming statistics (:mod:`moelab.diagnostics.accumulators`) with the
router's certification fields (:class:`~moelab.diagnostics.certify.CertificationStats`),
its own ``lapsum_k`` and ``truncation`` and the expert parameters a token uses. The data
and what a result says it covered are those of :mod:`moelab.diagnostics.evaluate`.

Shape suffixes: T, E, L (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab import maps
from moelab.data import TokenShard
from moelab.diagnostics.accumulators import active_params
from moelab.diagnostics.certify import CERT_FIELDS, CertificationStats
from moelab.diagnostics.evaluate import count_batches, require_moe, validation_pass
from moelab.diagnostics.load import LoadedRun, as_loaded, corpus_shard
from moelab.model import Transformer
from moelab.routing.certification import spectral_norm
from moelab.routing.measures import top2_gap
from moelab.routing.output import RouterOutput

__all__ = ["stats"]


def _router_fields(model: Transformer) -> list[dict[str, Any]]:
    """Per MoE layer, what the router itself holds: ``selection`` (its rule's name: the
    layers' rules may differ under ``router_layers``), ``top_k`` (its K), ``lapsum_k``
    (the layer's LapSum budget, learned or fixed; None for other maps) and
    ``truncation`` (the cut on the map's values of a truncating router, None for
    top-k)."""
    k_L = model.layer_budgets()
    fields = []
    for i, layer in enumerate(model.moe_layers):
        router, rc = layer.router, layer.router.config
        k = float(k_L[i].detach()) if k_L is not None else rc.lapsum_k
        cut = router.effective_truncation(k)  # None: the rule has no cut on p
        fields.append(
            {
                "selection": rc.selection,
                "top_k": int(router.top_k),
                "lapsum_k": k if maps.info(rc.map).needs_k else None,
                "truncation": cut,
            }
        )
    return fields


def _certified_pass(
    loaded: LoadedRun,
    shard: TokenShard,
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
    gaps: bool,
    radii: bool,
) -> tuple[
    float, int, int, dict[str, Any], list[CertificationStats], list[np.ndarray], list[np.ndarray]
]:
    """:func:`validation_pass` with every router's certification stats (the router's
    input norms kept by a forward pre-hook, removed afterwards): (nll, tokens, batches,
    the routing stats' result, the CertificationStats per MoE layer, the top-2 gap chunks
    if ``gaps``, the relative radius chunks if ``radii``)."""
    routers = [layer.router for layer in loaded.model.moe_layers]
    certs = [
        CertificationStats(r.temperature.value, float(spectral_norm(r.weight.detach())))
        for r in routers
    ]
    x_norms: list[torch.Tensor | None] = [None] * len(routers)
    gap_chunks: list[np.ndarray] = []
    radius_chunks: list[np.ndarray] = []

    def keep_norm(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x_norms[i] = args[0].detach().float().norm(dim=-1)

        return hook

    def on_outputs(outs: list[RouterOutput]) -> None:
        for i, ro in enumerate(outs):
            norm_T = x_norms[i]
            assert norm_T is not None  # the router's pre-hook ran in this forward pass
            r_T = certs[i].radii(ro)
            rel_T = certs[i].relative(r_T, norm_T)
            certs[i].add(r_T, rel_T)
            if radii:
                radius_chunks.append(rel_T.cpu().numpy())
            if gaps:
                gap_T = top2_gap(ro.logits_TE.float())  # NaN: every expert masked
                gap_chunks.append(gap_T[~gap_T.isnan()].cpu().numpy())

    handles = [r.register_forward_pre_hook(keep_norm(i)) for i, r in enumerate(routers)]
    try:
        nll, n_tokens, n_batches, acc = validation_pass(
            loaded, shard, max_batches, batch_size, seq_len, on_outputs
        )
    finally:
        for h in handles:
            h.remove()
    assert acc is not None
    return nll, n_tokens, n_batches, acc.result(), certs, gap_chunks, radius_chunks


def _stats_layers(
    model: Transformer,
    res: dict[str, Any],
    certs: list[CertificationStats],
    used: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ``layers`` rows of :func:`stats` (routing stats, block, certification fields,
    the router's own fields, active expert parameters) and their ``mean``."""
    blocks = model.config.moe_indices
    own = _router_fields(model)
    layers = [
        {
            **lay,
            "block": blocks[lay["layer"]],
            **certs[i].result(),
            **own[i],
            "active_expert_params": used["layers"][i],
        }
        for i, lay in enumerate(res["layers"])
    ]
    mean = dict(res["mean"])
    for name in (*CERT_FIELDS, "lapsum_k", "truncation"):
        vals = [lay[name] for lay in layers if lay[name] is not None]
        mean[name] = sum(vals) / len(vals) if vals else None
    return layers, mean


def stats(
    run_dir: str | Path | LoadedRun,
    data: str | Path | None = None,
    max_batches: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    gaps: bool = False,
    radii: bool = False,
) -> dict[str, Any]:
    """Routing statistics of the run's newest checkpoint with its trained K, on the
    validation split (or on the corpus ``data``).

    Every layer also gets the temperature and certification fields of
    :class:`~moelab.diagnostics.certify.CertificationStats` (``tau``, ``weight_norm``,
    ``lipschitz``, certified top-1 radii ``radius_*`` and, relative to the norm of the
    token the router saw, ``radius_rel_*``) and the router's own ``lapsum_k`` (the learned
    k_l under learned allocation) and ``truncation`` (the cut of a truncating router).
    With ``gaps``, the result also holds ``"gaps"``: a numpy array of every top-2 logit
    gap seen (rows whose top logit is -inf left out); with ``radii``, ``"radii"``: every
    relative certified radius; both for plotting.

    ``max_batches``: the first this many batches (None, the default: all of them).

    Returns ``{"run", "checkpoint_step", "map", "alpha", "top_k", "selection" (the
    rule's name; "topk": top_k applies), "truncating" (the rule's ``truncates``: a
    token-dependent number of experts; any layer's), "uniform_routers" (false when
    ``router_layers`` gives layers routers of their own: "map", "alpha", "top_k" and
    "selection" are then the shared router's or layer 0's, and each layer's row names its
    own "selection" and "top_k", and its "map" and "alpha" where the maps differ),
    "schedule", "learned_allocation", "nll", "tokens", "batches", "batches_total" (of the
    whole split or corpus), "active_params", "mean":
    {field: ...}, "layers": [{"layer", "block", field: ..., "active_expert_params"}, ...]}``
    (``layer`` counts the MoE layers from 0, ``block`` is the transformer block; means are
    over the layers) and ``"data"`` when a corpus was given. ``active_params`` is the
    measured mean of the parameters one token uses (every non-expert parameter plus each
    layer's ``active_expert_params`` = its ``active_experts`` x the parameters of one
    expert; :func:`moelab.diagnostics.accumulators.active_params`). Raises ValueError for a dense
    model."""
    loaded = as_loaded(run_dir)
    require_moe(loaded, "stats")
    model = loaded.model
    shard = loaded.val_shard() if data is None else corpus_shard(data, loaded.tokenizer)
    routers = [layer.router for layer in model.moe_layers]
    nll, n_tokens, n_batches, res, certs, gap_chunks, radius_chunks = _certified_pass(
        loaded, shard, max_batches, batch_size, seq_len, gaps, radii
    )
    used = active_params(model, [lay["active_experts"] for lay in res["layers"]])
    layers, mean = _stats_layers(model, res, certs, used)
    rc = model.config.router_config()
    result: dict[str, Any] = {
        "run": str(loaded.run_dir),
        "checkpoint_step": loaded.step,
        "map": res["map"],
        "alpha": res["alpha"],
        "top_k": int(routers[0].top_k),
        "selection": rc.selection,
        "truncating": any(lay.router.config.selection_rule.truncates for lay in model.moe_layers),
        "uniform_routers": model.config.uniform_routers,
        "schedule": rc.schedule,
        "learned_allocation": model.allocator is not None,
        "nll": nll,
        "tokens": n_tokens,
        "batches": n_batches,
        "batches_total": count_batches(shard, loaded, batch_size, seq_len),
        "active_params": used["active_params"],
        "mean": mean,
        "layers": layers,
    }
    if data is not None:
        result["data"] = str(data)
    if gaps:
        result["gaps"] = np.concatenate(gap_chunks) if gap_chunks else np.zeros(0)
    if radii:
        result["radii"] = np.concatenate(radius_chunks) if radius_chunks else np.zeros(0)
    return result
