"""Evaluate a trained run: the inference-time budget sweep (``moelab eval``) of the
newest checkpoint, or of the one ``load_run(run, step=N)`` (``--step N``) names; the
routing statistics (``moelab stats``) are :mod:`moelab.diagnostics.run_stats`.

    run = load_run("runs/run")                     # model (eval mode, CPU), config, ...
    evaluate("runs/run", [1, 2, 4, 8])             # the DESIGN.md ``eval`` document

Data: the run's validation shard ``RUN/data/val.bin``, visited once in file order
(``batches(..., shuffle=False, epochs=1)``; training's validation loss is the mean over
the first ``eval_batches`` of them): the first ``max_batches`` batches, or all of them
with ``max_batches=None`` (the functions' default; ``moelab eval``, ``stats`` and
``report`` default to 64). Every result says what it covered: ``"tokens"`` and
``"batches"`` (per row), ``"batches_total"`` (the batches of the whole split) and
``"checkpoint_step"``. ``data`` names a second corpus (a folder or file that
:func:`moelab.data.load_corpus` reads); it is tokenised with the run's tokenizer (each
document followed by EOS, as in the shards) and visited the same way.

The budget sweep runs the same frozen weights with each K: ``router.top_k`` is set on
every MoE layer's router and restored afterwards (also on error). ``nll`` is the mean
next-token cross-entropy per target token in nats, ``retained_mass`` is
``1 - discarded_mass`` and ``contributors`` the mean number of selected experts with
positive weight, both from :class:`~moelab.diagnostics.ModelRoutingStats` averaged over
the MoE layers. With ``data`` the document also has ``"results_data"``: the same rows on
that corpus (the ``"results"`` rows stay on the validation split).

Shape suffixes: B, S, T (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moelab.data import TokenShard, batches
from moelab.diagnostics.accumulators import ModelRoutingStats
from moelab.diagnostics.load import (
    LoadedRun,
    as_loaded,
    check_run,
    corpus_shard,
    load_run,
    step_folder,
)
from moelab.diagnostics.replay import RoutingRecord, check_record_fits, record, replay, routers_of
from moelab.model import Transformer
from moelab.routing.output import RouterOutput
from moelab.routing.router import routers_top_k

__all__ = [
    "LoadedRun",
    "ValidationPass",
    "check_run",
    "corpus_shard",
    "evaluate",
    "evaluate_truncation",
    "load_run",
    "refuse_other_sweeps",
    "step_folder",
    "validation_pass",
]


class ValidationPass(NamedTuple):
    """What one ordered pass over a shard measured (:func:`validation_pass`)."""

    nll: float
    """The mean next-token cross-entropy per target token, in nats."""
    tokens: int
    """The target tokens seen."""
    batches: int
    """The batches seen."""
    routing: ModelRoutingStats | None
    """The routing statistics of every MoE layer; None for a dense model."""


def shard_batches(
    shard: TokenShard, loaded: LoadedRun, batch_size: int | None, seq_len: int | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    cfg = loaded.config
    return batches(
        shard,
        cfg.batch_size if batch_size is None else batch_size,
        cfg.seq_len if seq_len is None else seq_len,
        cfg.seed,
        shuffle=False,
        epochs=1,
    )


def require_moe(loaded: LoadedRun, what: str) -> None:
    if not loaded.model.moe_layers:
        raise ValueError(
            f"{loaded.run_dir} is a dense model (no MoE layers); {what} needs an MoE model"
        )


def refuse_other_sweeps(model: Transformer, sweep: str, instead: str) -> None:
    """ValueError, in one line naming the layer, unless every MoE layer's selection rule
    is swept by ``sweep`` (its ``sweep``: "top_k" or "threshold_scale"). With
    ``router_layers`` the layers' rules may differ: a sweep that sets every layer's
    budget alike needs every layer to take that budget. ``instead``: the sweep to try."""
    what = {"top_k": "not top-k", "threshold_scale": "not by a threshold"}[sweep]
    layers = [layer.router.config for layer in model.moe_layers]
    bad = [i for i, rc in enumerate(layers) if rc.selection_rule.sweep != sweep]
    if not bad:
        return
    if len(bad) == len(layers) and len({rc.selection for rc in layers}) == 1:
        raise ValueError(f"the routers select by {layers[0].selection!r}, {what}; {instead}")
    i = bad[0]
    block = model.config.moe_indices[i]
    raise ValueError(
        f"MoE layer {i} (block {block}) selects by {layers[i].selection!r}, {what} "
        f"(router_layers gives the layers different rules); {instead}"
    )


def _top_k(model: Transformer, k: int) -> AbstractContextManager[None]:
    """Route every MoE layer with ``k`` experts per token; restore the old values."""
    return routers_top_k([layer.router for layer in model.moe_layers], k)


@torch.no_grad()
def validation_pass(
    loaded: LoadedRun,
    shard: TokenShard,
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
    on_outputs: Callable[[list[RouterOutput]], None] | None = None,
) -> ValidationPass:
    """One ordered pass over ``shard`` (the first ``max_batches`` batches; None: all):
    its :class:`ValidationPass` (mean NLL per target token, target tokens, batches, routing
    stats, None for a dense model); ``on_outputs`` also sees every batch's router outputs.
    ValueError when there is no batch."""
    model = loaded.model
    rc = model.config.router_config()
    n_moe = len(model.moe_layers)
    layer_maps = [
        (layer.router.config.map, layer.router.config.alpha) for layer in model.moe_layers
    ]
    acc = ModelRoutingStats(n_moe, rc.map, rc.alpha, layer_maps) if n_moe else None
    total, n_tokens, n_batches = 0.0, 0, 0
    for x_BS, y_BS in shard_batches(shard, loaded, batch_size, seq_len):
        if max_batches is not None and n_batches >= max_batches:
            break
        out = model(x_BS, y_BS, collect=acc is not None)
        assert out.loss is not None
        n = int((y_BS != -100).sum())
        total += float(out.loss) * n
        n_tokens += n
        n_batches += 1
        if acc is not None:
            acc.update(out.router_outputs)
        if on_outputs is not None:
            on_outputs(out.router_outputs)
    if n_batches == 0:
        raise ValueError("no batches to evaluate (max_batches must be >= 1)")
    return ValidationPass(total / n_tokens, n_tokens, n_batches, acc)


def _budget_row(
    loaded: LoadedRun,
    shard: TokenShard,
    key: str,
    value: float,
    budget: AbstractContextManager[None],
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
) -> dict[str, Any]:
    """One pass with the routers set to a budget (``budget``, a context that restores
    them): ``{key: value, "nll", "retained_mass", "contributors", "active_experts",
    "tokens", "batches"}``."""
    with budget:
        nll, n_tokens, n_batches, acc = validation_pass(
            loaded, shard, max_batches, batch_size, seq_len
        )
    assert acc is not None
    mean = acc.result()["mean"]
    discarded = mean["discarded_mass"]
    return {
        key: value,
        "nll": nll,
        "retained_mass": None if discarded is None else 1.0 - discarded,
        "contributors": mean["contributors"],
        "active_experts": mean["active_experts"],
        "tokens": n_tokens,
        "batches": n_batches,
    }


def count_batches(
    shard: TokenShard, loaded: LoadedRun, batch_size: int | None, seq_len: int | None
) -> int:
    """How many batches one ordered pass over ``shard`` has (``max_batches=None``)."""
    b = loaded.config.batch_size if batch_size is None else batch_size
    s = loaded.config.seq_len if seq_len is None else seq_len
    # NOTE: the rule of batches(..., shuffle=False, epochs=1): disjoint windows of S + 1
    # tokens from the start of the file, B windows a batch, the rest dropped
    return len(shard) // (s + 1) // b


def _sweep(
    loaded: LoadedRun,
    shard: TokenShard,
    top_ks: Sequence[int],
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
) -> list[dict[str, Any]]:
    return [
        _budget_row(
            loaded, shard, "top_k", k, _top_k(loaded.model, k), max_batches, batch_size, seq_len
        )
        for k in top_ks
    ]


def _increase(rows: list[dict[str, Any]], trained_k: int) -> float | None:
    by_k = {r["top_k"]: r["nll"] for r in rows}
    if trained_k not in by_k:
        return None
    return by_k[max(by_k)] - by_k[trained_k]


def _record_pass(
    loaded: LoadedRun,
    shard: TokenShard,
    path: str | Path,
    trained_k: int,
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
) -> dict[str, Any]:
    """Record the routing of one pass at the trained K into ``path``: ``{"file", "nll",
    "tokens", "batches", "top_k", "routed_tokens"}`` (``routed_tokens``: the T of every
    layer's record, batch and sequence flattened)."""
    inputs: list[torch.Tensor] = []  # the token ids of each forward, (B, S)

    def keep_ids(_module: Any, args: tuple[Any, ...]) -> None:
        inputs.append(args[0].detach().reshape(-1).cpu())

    hook = loaded.model.register_forward_pre_hook(keep_ids)
    try:
        with _top_k(loaded.model, trained_k), record(loaded.model) as rec:
            nll, n_tokens, n_batches, _ = validation_pass(
                loaded, shard, max_batches, batch_size, seq_len
            )
    finally:
        hook.remove()
    ids_T = torch.cat(inputs) if inputs else torch.empty(0, dtype=torch.long)
    if ids_T.numel() == rec.tokens:  # one router call per layer and forward: the rows' tokens
        rec.token_ids = ids_T.to(torch.int64)
    rec.save(path)
    return {
        "file": str(path),
        "nll": nll,
        "tokens": n_tokens,
        "batches": n_batches,
        "top_k": trained_k,
        "routed_tokens": rec.tokens,
    }


def _replay_pass(
    loaded: LoadedRun,
    shard: TokenShard,
    path: str | Path,
    trained_k: int,
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
) -> dict[str, Any]:
    """The NLL with the routing of ``path`` replayed, and with the model's own routing
    on the same batches: ``{"file", "nll", "nll_own", "tokens", "batches", "top_k",
    "changed_fraction", "consumed"}`` (``changed_fraction``: the share of (token, layer)
    states whose chosen set differs from the model's own; ``consumed``: the record's rows
    replayed, of ``routed_tokens``)."""
    rec = RoutingRecord.load(path)
    with _top_k(loaded.model, trained_k), record(loaded.model) as own:
        nll_own, _, _, _ = validation_pass(loaded, shard, max_batches, batch_size, seq_len)
    with _top_k(loaded.model, trained_k), replay(loaded.model, rec):
        nll, n_tokens, n_batches, _ = validation_pass(
            loaded, shard, max_batches, batch_size, seq_len
        )
    return {
        "file": str(path),
        "nll": nll,
        "nll_own": nll_own,
        "tokens": n_tokens,
        "batches": n_batches,
        "top_k": trained_k,
        "changed_fraction": rec.changed_fraction(own),
        "consumed": rec.consumed[0],
        "routed_tokens": rec.tokens,
    }


def _check_replay(path: str | Path, model: Transformer, top_ks: list[int], trained_k: int) -> None:
    """Before any pass: the record of ``path`` fits the model (layers, experts) and its K
    is the run's trained K, the only K of the sweep."""
    rec = RoutingRecord.load(path)
    try:
        check_record_fits(rec, routers_of(model))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    rec_k = rec.top_k
    if rec_k != trained_k:
        raise ValueError(
            f"{path} was recorded with K={rec_k}, the run's trained K is {trained_k}: replay "
            "a record of this run (moelab eval RUN --record FILE)"
        )
    if top_ks != [trained_k]:
        raise ValueError(
            f"--replay evaluates the recorded K={trained_k} only; give --top-k {trained_k} "
            f"(got {' '.join(map(str, top_ks))})"
        )


def evaluate(
    run_dir: str | Path | LoadedRun,
    top_ks: Sequence[int],
    data: str | Path | None = None,
    max_batches: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    record_to: str | Path | None = None,
    replay_from: str | Path | None = None,
) -> dict[str, Any]:
    """The inference-time budget sweep of the run's newest checkpoint.

    Args:
        run_dir: the run folder, or a run :func:`load_run` already loaded.
        top_ks: the K values, each in [1, n_experts] (evaluated in the given order).
        data: an optional second corpus (see the module docstring).
        max_batches: evaluate the first this many batches (None, the default: the
            whole split).
        batch_size, seq_len: None takes the run's own.
        record_to: record the routing of the same batches at the trained K into this
            file (:func:`moelab.diagnostics.record`; one more pass).
        replay_from: evaluate the same batches with the routing recorded in this file
            replayed (:func:`moelab.diagnostics.replay`; two more passes: own and
            replayed); ``top_ks`` must be the trained K alone, the record's K.

    Returns:
        ``{"run", "checkpoint_step", "trained_top_k", "n_experts", "map", "results":
        [{"top_k", "nll", "retained_mass", "contributors", "active_experts", "tokens",
        "batches"}, ...], "batches_total", "nll_increase"}`` (and
        ``"trained_top_k_layers"``, each MoE layer's trained K, when ``router_layers``
        gave the layers different K: ``trained_top_k`` is then layer 0's, and every K
        of the sweep applies to every layer) where ``batches_total`` is
        the number of batches of the whole validation split and
        ``nll_increase`` is the NLL at the largest K minus the NLL at the trained K (None
        when the trained K is not among ``top_ks``); with ``data`` also ``"data"`` and
        ``"results_data"`` (the same rows on that corpus), ``"batches_total_data"`` and
        ``"nll_increase_data"``. With ``record_to`` also ``"record": {"file", "nll",
        "tokens", "batches", "top_k", "routed_tokens"}``; with ``replay_from``,
        ``"replay": {"file", "nll" (replayed), "nll_own" (the model's own routing),
        "tokens", "batches", "top_k", "changed_fraction", "consumed", "routed_tokens"}``
        (``changed_fraction``: the share of (token, layer) states whose chosen expert set
        differs from the model's own; ``consumed``: the recorded tokens replayed, of
        ``routed_tokens``), both on the validation split.

    Raises:
        ValueError: no K, a K outside [1, n_experts], a dense model (no MoE layers), a
            selection rule whose budget is not K (its ``sweep`` is not ``"top_k"``, e.g.
            a truncating rule), or a replay record that does not fit the run (its
            layers, experts, K, or fewer tokens than the batches evaluated).
    """
    loaded = as_loaded(run_dir)
    require_moe(loaded, "the K sweep of eval")
    rc = loaded.model.config.router_config()
    n_experts = loaded.model.config.n_experts
    top_ks = [int(k) for k in top_ks]
    if not top_ks:
        raise ValueError("give at least one K to evaluate")
    bad = [k for k in top_ks if not 1 <= k <= n_experts]
    if bad:
        raise ValueError(
            f"top_k values {bad} are outside [1, {n_experts}]: the model has {n_experts} "
            "experts per MoE layer"
        )
    refuse_other_sweeps(
        loaded.model,
        "top_k",
        "a K sweep does not apply (sweep the threshold instead: evaluate_truncation, "
        "--threshold-scale)",
    )
    trained_k = int(loaded.model.moe_layers[0].router.top_k)
    trained_ks = [int(layer.router.top_k) for layer in loaded.model.moe_layers]
    if replay_from is not None:
        _check_replay(replay_from, loaded.model, top_ks, trained_k)
    # NOTE: the second corpus first: a tokenizer it cannot use fails before the sweep
    shard = None if data is None else corpus_shard(data, loaded.tokenizer)
    val = loaded.val_shard()
    rows = _sweep(loaded, val, top_ks, max_batches, batch_size, seq_len)
    result: dict[str, Any] = {
        "run": str(loaded.run_dir),
        "checkpoint_step": loaded.step,
        "trained_top_k": trained_k,
        "n_experts": n_experts,
        "map": rc.map,
        "results": rows,
        "batches_total": count_batches(val, loaded, batch_size, seq_len),
        "nll_increase": _increase(rows, trained_k),
    }
    if len(set(trained_ks)) > 1:  # router_layers: the layers were trained with their own K
        result["trained_top_k_layers"] = trained_ks
    if shard is not None:
        rows_data = _sweep(loaded, shard, top_ks, max_batches, batch_size, seq_len)
        result["data"] = str(data)
        result["results_data"] = rows_data
        result["batches_total_data"] = count_batches(shard, loaded, batch_size, seq_len)
        result["nll_increase_data"] = _increase(rows_data, trained_k)
    passes = (max_batches, batch_size, seq_len)
    if record_to is not None:
        result["record"] = _record_pass(loaded, val, record_to, trained_k, *passes)
    if replay_from is not None:
        result["replay"] = _replay_pass(loaded, val, replay_from, trained_k, *passes)
    return result


@contextmanager
def _threshold_scale(model: Transformer, scale: float) -> Iterator[None]:
    """Multiply every MoE router's cut on p (``truncation``) by ``scale``; restore after."""
    routers = [layer.router for layer in model.moe_layers]
    old = [r.truncation for r in routers]
    try:
        for r, t in zip(routers, old, strict=True):
            r.truncation = t * scale
        yield
    finally:
        for r, t in zip(routers, old, strict=True):
            r.truncation = t


def _truncation_rows(
    loaded: LoadedRun,
    shard: TokenShard,
    scales: Sequence[float],
    max_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
) -> list[dict[str, Any]]:
    return [
        _budget_row(
            loaded,
            shard,
            "threshold_scale",
            scale,
            _threshold_scale(loaded.model, scale),
            max_batches,
            batch_size,
            seq_len,
        )
        for scale in scales
    ]


def evaluate_truncation(
    run_dir: str | Path | LoadedRun,
    scales: Sequence[float],
    data: str | Path | None = None,
    max_batches: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> dict[str, Any]:
    """The inference-time sweep of a truncating router (a selection rule whose ``sweep``
    is ``"threshold_scale"``: selection = "threshold"), the analogue of the K sweep: the
    same weights with every layer's cut on p (``truncation``) multiplied by each of
    ``scales`` (1 is the trained one, 0 keeps every expert up to the cap), as in the
    SoftMoE paper's truncation ablation.

    ``max_batches``: the first this many batches (None, the default: all of them).

    Returns ``{"run", "checkpoint_step", "map", "n_experts", "thresholds" (the trained
    ones, per layer), "results": [{"threshold_scale", "nll", "retained_mass",
    "contributors", "active_experts", "tokens", "batches"}, ...], "batches_total"}`` on
    the validation split; with ``data`` also ``"data"``, ``"results_data"`` and
    ``"batches_total_data"``.

    Raises:
        ValueError: no scale, a negative scale, a dense model, or a rule that is not
            swept by a threshold scale, such as top-k (use :func:`evaluate`).
    """
    loaded = as_loaded(run_dir)
    require_moe(loaded, "the truncation sweep of eval")
    rc = loaded.model.config.router_config()
    scales = [float(x) for x in scales]
    if not scales:
        raise ValueError("give at least one threshold scale to evaluate")
    bad = [x for x in scales if not x >= 0]
    if bad:
        raise ValueError(f"threshold scales must be >= 0, got {bad}")
    refuse_other_sweeps(loaded.model, "threshold_scale", "sweep K instead (--top-k)")
    # NOTE: the second corpus first: a tokenizer it cannot use fails before the sweep
    shard = None if data is None else corpus_shard(data, loaded.tokenizer)
    val = loaded.val_shard()
    rows = _truncation_rows(loaded, val, scales, max_batches, batch_size, seq_len)
    result: dict[str, Any] = {
        "run": str(loaded.run_dir),
        "checkpoint_step": loaded.step,
        "map": rc.map,
        "n_experts": loaded.model.config.n_experts,
        "thresholds": [layer.router.truncation for layer in loaded.model.moe_layers],
        "results": rows,
        "batches_total": count_batches(val, loaded, batch_size, seq_len),
    }
    if shard is not None:
        result["data"] = str(data)
        result["results_data"] = _truncation_rows(
            loaded, shard, scales, max_batches, batch_size, seq_len
        )
        result["batches_total_data"] = count_batches(shard, loaded, batch_size, seq_len)
    return result
