"""The inference-time budget sweep on a Hugging Face MoE model: the same weights run
with K experts per token, for each K, over a text; NLL, retained mass and contributors.

K is changed on the model's own routers (:func:`~moelab.integrations.hf.families.top_k`
sets their ``top_k`` attribute), so with K = the model's own top-k the pass is the
unmodified model's. Not every router reads that attribute (PhiMoE's always chooses 2; a
layer that routes by token id has a fixed table): the sweep checks what it measured. The
hooks that collect the statistics also record the experts each router chose
(:class:`~moelab.integrations.hf.stats.Seen`), and a K that some MoE layer did not take
(K distinct experts for every token) is refused with an UnsupportedModelError naming the
family and the layers: first on a probe of the text's first :data:`PROBE_TOKENS` tokens
at every K but the model's own, before any pass, then on each pass's whole capture. A
forward that fails in the model's own code at another K is run again at its own K: a
model whose own forward fails is refused with what failed, blaming no K
(:class:`~moelab.integrations.hf.stats.ModelCodeError`), and a K at which the model's
code fails while its own K runs (LongCat-Flash's K = 1 in transformers 5.24) is refused
naming that K and the error. With router keys (``map``, ``alpha``, ...) the routers are
first replaced by moelab Routers through
:func:`moelab.integrations.hf.swap.swap_routers` (on a copy when the caller passed the
model), and each K is set on the swapped Routers; the statistics are then those of the
swapped Routers' own outputs and map. A swapped model, or a folder saved from one
(``moelab_routers.json``, loaded with its Routers by
:func:`~moelab.integrations.hf.stats.load_hf`), is swept the same way on the Routers it
holds; router keys are refused for it (its routers are moelab's already).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moelab.diagnostics.accumulators import ModelRoutingStats
from moelab.integrations.hf.families import UnsupportedModelError, first_rule, moe_routers, top_k
from moelab.integrations.hf.stats import (
    ModelCodeError,
    Seen,
    check_max_tokens,
    collect,
    collect_swapped,
    load_hf,
    nll_pass,
    read_texts,
    seq_len_for,
    swapped_rule,
    token_bar,
    token_batches,
)
from moelab.routing.router import routers_top_k

__all__ = ["PROBE_TOKENS", "hf_eval"]

PROBE_TOKENS = 32
"""Tokens of the probe forward that checks every K before the first pass."""


def _row(k: int, total: float, n: int, mean: dict[str, Any] | None) -> dict[str, Any]:
    discarded = None if mean is None else mean["discarded_mass"]
    return {
        "top_k": k,
        "nll": total / n,
        "retained_mass": None if discarded is None else 1.0 - discarded,
        "contributors": None if mean is None else mean["contributors"],
        "active_experts": None if mean is None else mean["active_experts"],
        "tokens": n,
    }


def _swap(model: torch.nn.Module, router_keys: dict[str, Any]) -> list[Any]:
    """Swap the routers of ``model`` in place for moelab Routers (the swap module)."""
    if "top_k" in router_keys:
        raise ValueError("top_k is what the sweep varies: give it with --top-k, not as a key")
    try:
        from moelab.integrations.hf.swap import swap_routers
    except ImportError as err:  # pragma: no cover - the swap ships with moelab
        raise ValueError(
            "--map/--alpha on a Hugging Face model need the router swap "
            "(moelab.integrations.hf.swap), which this moelab lacks"
        ) from err
    return swap_routers(model, **router_keys)


def _k_set(
    model: torch.nn.Module, swapped: Sequence[Any], k: int
) -> contextlib.AbstractContextManager[Any]:
    """K = ``k`` inside the block: on the swapped moelab Routers when there are, else on
    the model's own routers (:func:`~moelab.integrations.hf.families.top_k`); restored
    after."""
    return routers_top_k(swapped, k) if swapped else top_k(model, k)


def _applied(
    model: torch.nn.Module, batches: Any, k: int, own: int, progress: Any = None,
    swapped: Sequence[Any] = (), probe: torch.Tensor | None = None,
) -> tuple[float, int, ModelRoutingStats]:  # fmt: skip
    """``(summed NLL, targets, statistics)`` of ``batches`` with K = ``k`` on the model's
    own routers, or on its ``swapped`` moelab Routers; UnsupportedModelError unless every
    MoE layer of the model's own chose k distinct experts for every token
    (:meth:`Seen.check_k`), or when the model's own code fails at K = ``k``
    (:func:`_k_failure`, which tries its own K on ``probe``)."""
    seen = None if swapped else Seen(model)
    collecting = collect_swapped(swapped) if swapped else collect(model, seen=seen)
    failed = None
    with _k_set(model, swapped, k), collecting as acc:
        try:
            total, n = nll_pass(model, batches, progress)
        except ModelCodeError as err:
            if k == own:
                raise
            failed = err
    if failed is not None:
        raise _k_failure(model, failed, k, own, swapped, probe) from None
    if n and seen is not None:
        seen.check_k(k, own)
    return total, n, acc


def _k_failure(
    model: torch.nn.Module, err: ModelCodeError, k: int, own: int, swapped: Sequence[Any],
    probe: torch.Tensor | None,
) -> UnsupportedModelError:  # fmt: skip
    """The error for a forward of the model's own code that failed at K = ``k``: the
    model's own K is run on ``probe`` first; if it fails too, that failure (no K is to
    blame: the model does not run), else the K = ``k`` one, saying what failed."""
    runs = ""
    if probe is not None:
        try:
            with _k_set(model, swapped, own):
                nll_pass(model, [probe])
        except ModelCodeError as own_err:
            return own_err
        runs = f" but runs with its own top_k = {own}"
    # NOTE: a family's own code may not run at another K (LongCat-Flash's experts at
    # K = 1 in transformers 5.24): say so, with what failed
    model_type = getattr(model.config, "model_type", None)
    return UnsupportedModelError(
        f"this {model_type!r} model's own code fails with top_k = {k} ({err.what}){runs}; "
        f"the sweep cannot set K = {k} on this model: sweep other K (its own is {own})"
    )


def _probe(
    model: torch.nn.Module, tokenizer: Any, files: Any, top_ks: Sequence[int], own: int,
    max_tokens: int | None, swapped: Sequence[Any] = (),
) -> torch.Tensor | None:  # fmt: skip
    """Refuse a K that the routers do not take or the model's code fails with, on the
    text's first PROBE_TOKENS tokens (one short forward per K other than the model's own,
    which its pass checks), before any pass; returns those tokens (None: too few)."""
    n = PROBE_TOKENS if max_tokens is None else min(PROBE_TOKENS, max_tokens)
    first = next(iter(token_batches(tokenizer, files, n, 1, n)), None)
    if first is None:
        return None  # fewer than 2 tokens: the pass says so
    for k in dict.fromkeys(top_ks):
        if k != own:
            _applied(model, [first], k, own, swapped=swapped, probe=first)
    return first


def _check_saved(
    model_dir: str | Path, routers: list[Any], router_keys: dict[str, Any] | None,
    top_ks: Sequence[int],
) -> None:  # fmt: skip
    """ValueError for router keys or a K out of range on routers that are moelab's already
    (a swapped model, or a folder saved from one)."""
    from moelab.integrations.hf.saved import ROUTERS_JSON

    if router_keys:
        raise ValueError(
            f"--hf {model_dir}: its routers are moelab Routers already (a swapped model, "
            f"as {ROUTERS_JSON} holds it: map {routers[0].router.config.map}); --map, "
            "--alpha and --router swap a model's own routers: sweep these without them"
        )
    n_experts = routers[0].num_experts
    for k in top_ks:
        if not 1 <= k <= n_experts:
            raise ValueError(f"--top-k {k}: the model has {n_experts} experts, give 1..{n_experts}")


def hf_eval(
    model_dir: str | Path,
    data: str | Path,
    top_ks: Sequence[int],
    router_keys: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
    loaded: tuple[Any, Any] | None = None,
    *,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The budget sweep of the model in ``model_dir`` on the text ``data``.

    Returns the ``moelab eval`` JSON shape: ``{"run": model_dir, "model_type",
    "family", "rule", "map", "alpha", "trained_top_k", "n_experts", "data",
    "router_keys", "results": [{"top_k", "nll", "retained_mass", "contributors",
    "active_experts", "tokens"}, ...], "nll_increase"}`` (the NLL change from the model's
    own K to the largest K swept; null when its own K is not swept). ``nll`` is the mean
    next-token NLL in nats per target token; ``retained_mass`` = 1 - discarded mass (see
    :mod:`moelab.integrations.hf.stats` for the distribution it reads). A swapped model
    (or a folder saved from one) is swept on its moelab Routers, its K restored after.
    ``trust_remote_code``: let a folder that names its own code run it
    (:func:`~moelab.integrations.hf.stats.load_hf`; it runs that Python with your
    permissions).
    """
    from moelab.integrations.hf.swap import swapped_routers

    if not top_ks:
        raise ValueError("give at least one value of --top-k")
    check_max_tokens(max_tokens)
    files = read_texts(data)
    model, tokenizer = (
        load_hf(model_dir, trust_remote_code=trust_remote_code, swapped=True)
        if loaded is None
        else loaded
    )
    L = seq_len_for(model, seq_len)
    swapped: list[Any] = swapped_routers(model)
    if swapped:  # moelab's Routers already (a folder saved from a swapped model)
        _check_saved(model_dir, swapped, router_keys, top_ks)
        own, family, n_experts = swapped[0].top_k, swapped[0].family, swapped[0].num_experts
        rule, own_map = swapped_rule(swapped), swapped[0].router.config.map
    else:
        sites = moe_routers(model)
        own, family, n_experts = sites[0].top_k, sites[0].family.name, sites[0].n_experts
        rule = first_rule(sites)
        own_map = sites[0].family.map
        for k in top_ks:  # every K is checked before the first pass
            with top_k(model, k):
                pass
        if router_keys:
            if loaded is not None:  # the caller's model stays as it is
                model = copy.deepcopy(model)
            swapped = _swap(model, router_keys)
            rule = None  # the head line names the keys
    first = _probe(model, tokenizer, files, top_ks, own, max_tokens, swapped)
    rows = []
    bar = token_bar(None if max_tokens is None else max_tokens * len(top_ks), progress)
    with bar:
        for k in top_ks:
            batches = token_batches(tokenizer, files, L, batch_size, max_tokens)
            total, n, acc = _applied(model, batches, k, own, bar, swapped, first)
            if n == 0:
                raise ValueError(f"--data {data}: fewer than 2 tokens of text")
            rows.append(_row(k, total, n, acc.result()["mean"]))
    by_k = {r["top_k"]: r["nll"] for r in rows}
    base = by_k.get(own)
    config = swapped[0].router.config if swapped else None
    return {
        "run": str(model_dir),
        "model_type": getattr(model.config, "model_type", None),
        "family": family,
        "rule": rule,
        "map": config.map if config is not None else own_map,
        "alpha": config.alpha if config is not None else None,
        "trained_top_k": own,
        "n_experts": n_experts,
        "data": str(data),
        "router_keys": dict(router_keys or {}),
        "results": rows,
        "nll_increase": None if base is None else by_k[max(by_k)] - base,
    }
