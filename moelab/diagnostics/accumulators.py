"""Routing statistics of MoE routers, per MoE layer and averaged over layers.

Definitions follow *How Sparse Probability Maps Shape Mixture-of-Experts Routing*
(Tables 2, 5-8); the JSON field names are the contract of DESIGN.md section 3. A
*state* is one token at one MoE layer. All statistics are computed from
:class:`~moelab.routing.RouterOutput` objects:

``discarded_mass``
    mean over states of ``1 - sum_{i selected} probs_TE[i]`` (the map applied to
    all E logits), divided by the row total: 1 on the simplex, k for ``lapsum``
    (``1 - selected mass / k``). Defined only for maps with such a fixed total
    (``maps.info(name).fixed_total``): for the elementwise ``sigmoid``, ``relu`` and
    ``sqrtsoftplus``, whose values are no distribution, it and ``discarded_mass_support_ge3`` are
    ``None`` (printed "-"), in every statistic, log and study. With null experts the map
    covers E + M columns and only the selected *real* experts count as kept: the mass
    on a null expert reaches no expert, so it is discarded, selected or not. The per-token measures
    are those of :mod:`moelab.routing.measures`, which training's logs use too.
``contributors``
    mean number of selected slots with positive weight (K+; fillers, i.e. selected
    slots of weight exactly 0, do not count; capacity-dropped slots do).
``active_experts``
    mean number of *computed* slots per state (selected, not dropped, non-zero
    weight): equal to ``contributors`` unless a capacity limit drops slots.
``active_hist`` (per layer only, like ``load_shares``)
    the distribution of the number of experts a token computes at the layer (the SoftMoE
    paper's Figure 1): ``active_hist[n]`` counts the states with exactly n computed
    slots (selected, not dropped, non-zero weight), n = 0 .. K_max, K_max the most slots
    per token the layer's calls had (K of top-K, the cap of a truncating rule). Its sum
    is ``states`` and its mean ``sum_n n active_hist[n] / states`` is
    ``active_experts``. :func:`active_histograms` reads it from a statistics document.
``singleton_rate``, ``pair_rate``
    fraction of states whose support ``{i: probs_TE[i] > 0}`` has exactly 1 / 2
    elements; ``discarded_mass_support_ge3`` is the mean discarded mass over the
    states with support >= 3 (``None`` when there is none).
``nominal_cv``, ``contrib_cv``, ``load_cv``
    coefficient of variation (population std / mean over the E experts) of the
    per-expert load counting every selected slot / only positive-weight selected
    slots / only computed slots. ``contrib_sd`` is the population std of the
    contributor load shares (count / total count). ``load_shares`` (per expert),
    ``load_rel_var`` (var / mean^2), ``load_max_mean`` (max / mean) and
    ``dead_experts`` (experts with zero load) describe the computed load.
``active_params`` (:func:`active_params`, reported by ``moelab stats``)
    the parameters one token uses on average, measured (the SoftMoE paper's
    "Active-Param" at inference): every parameter outside the experts (embeddings,
    attention, norms, dense feed-forwards, routers) plus, per MoE layer, its
    ``active_experts`` times the parameters of one of its experts. For a top-k router
    without drops or zero-weight slots it equals the ``active`` count of ``moelab
    params``; for a truncating router it is the measured counterpart of its nominal k.
``dropped_fraction``
    dropped slots / selected slots.
``dropped_tokens``
    dropped tokens / states: a token is dropped when the capacity limit refused every
    expert it was routed to (at least one slot dropped and none computed), so it passes
    the layer through the residual only (the temperature paper's "Drop"). For top-1
    routing, where every state has one selected slot, it equals ``dropped_fraction``;
    for top-2 a token with one of its two slots dropped counts in ``dropped_fraction``
    only. 0 without a capacity limit.
``null_fraction``
    null slots / chosen slots (selected real ones plus null ones): the share of the
    slots that went to null experts (``RouterConfig.n_null_experts``, AdaMoE; for top-K,
    the mean share of a token's K slots). 0 for a router without null experts.

Null experts: every statistic of experts and slots (``contributors``,
``active_experts``, the loads and their CVs, ``dead_experts``, ``dropped_fraction``,
``dropped_tokens``,
``unrouted_fraction``, which then counts the tokens whose every slot went to a null
expert) counts the E real experts only (``RouterOutput.n_experts``; a null slot is never
``selected_TK``). The statistics of the map and its scores (support sizes,
``singleton_rate``, ``score_rms``, the top-2 gaps) read all E + M columns, as the map
sees them.
``unrouted_fraction``
    fraction of states with no selected slot, which reach no expert and pass through
    the residual only (:func:`moelab.routing.measures.unrouted`): 0 for top-k, possibly
    positive for expert choice (an expert picks tokens) and a cut on p.
``score_rms``
    root mean square of the per-token centred scores ``z - mean_e(z)``, with z the
    ``logits_TE`` (the scores the map sees, after temperature); non-finite
    (masked, -inf) entries are left out of both the mean and the RMS.
``gap_p50``, ``gap_p90``, ``gap_p99``
    percentiles of the top-2 logit gap ``z(1) - z(2)``, the same linear
    interpolation as ``numpy.percentile``, from a streaming histogram (below).
``frac_gap_ge1``, ``frac_gap_ge2``, ``frac_gap_ge_threshold``
    exact fractions of gaps >= 1, >= 2 and >= the map's singleton threshold
    (``None`` without one). For a sparse map the singleton rate equals the fraction
    at its own threshold.
``threshold``
    :func:`moelab.maps.threshold` of the map (``None`` for softmax, lapsum, ...).

Streaming: :class:`RoutingStats` keeps only exact integer counts, float64 sums and
a histogram of the gaps, so accumulating over chunks (or merging accumulators of
different chunks / ranks with :meth:`RoutingStats.merge`) gives the counts and
means of the one-shot computation exactly (float sums up to rounding).

Gap histogram and percentile error: the gaps go to a
:class:`~moelab.diagnostics.quantiles.BinnedQuantiles` with bins of width
``GAP_BIN = 0.001`` over ``[0, GAP_MAX)`` that keep their exact minima and maxima; gaps
``>= GAP_MAX`` (and infinite gaps of masked rows) are kept exactly. The interpolated
percentile is within ``GAP_BIN / 2 = 0.0005`` gap units of ``numpy.percentile`` on the
same gaps (the tests check < 0.001).

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from moelab import maps
from moelab.diagnostics.quantiles import BinnedQuantiles
from moelab.routing.measures import expert_counts, load_cv, token_measures, top2_gap, unrouted
from moelab.routing.output import RouterOutput

GAP_BIN = 0.001
"""Width of the gap-histogram bins (percentile error <= GAP_BIN / 2)."""
GAP_MAX = 64.0
"""Gaps at or above this are stored exactly instead of binned."""

FIELDS = (
    "discarded_mass",
    "contributors",
    "singleton_rate",
    "pair_rate",
    "discarded_mass_support_ge3",
    "nominal_cv",
    "contrib_cv",
    "contrib_sd",
    "score_rms",
    "gap_p50",
    "gap_p90",
    "gap_p99",
    "frac_gap_ge1",
    "frac_gap_ge2",
    "frac_gap_ge_threshold",
    "threshold",
    "active_experts",
    "load_cv",
    "dropped_fraction",
    "dropped_tokens",
    "unrouted_fraction",
    "null_fraction",
    "load_rel_var",
    "load_max_mean",
    "dead_experts",
)
"""Scalar fields of a layer result, averaged over layers by ModelRoutingStats."""


def _cv(load: np.ndarray) -> float | None:
    cv = float(load_cv(torch.from_numpy(load)))
    return None if math.isnan(cv) else cv  # NaN: no load


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


class RoutingStats:
    """Streaming routing statistics of one MoE layer.

    ``update(out)`` adds a batch of T tokens; ``result()`` gives the fields (see the
    module docstring), ``None`` where a field is undefined (no states yet, no
    threshold, zero load, ...). ``merge(other)`` adds another accumulator of the
    same layer (other chunks or ranks).
    """

    def __init__(self, map_name: str | None = None, alpha: float | None = None) -> None:
        self.map_name = map_name
        self.alpha = alpha
        self.threshold = None if map_name is None else maps.threshold(map_name, alpha)
        self.n_experts: int | None = None
        self.n_states = 0
        self.sum_discarded = 0.0
        self.n_contrib = 0
        self.n_computed = 0
        self.n_selected = 0
        self.n_dropped = 0
        self.n_dropped_tokens = 0
        self.n_unrouted = 0
        self.n_null = 0
        self.n_chosen = 0
        self.n_support1 = 0
        self.n_support2 = 0
        self.n_support_ge3 = 0
        self.sum_discarded_ge3 = 0.0
        self.sum_sq_centred = 0.0
        self.n_score_entries = 0
        self.nominal_load: np.ndarray | None = None
        self.contrib_load: np.ndarray | None = None
        self.computed_load: np.ndarray | None = None
        self.n_gaps = 0
        self.n_gap_ge1 = 0
        self.n_gap_ge2 = 0
        self.n_gap_ge_threshold = 0
        self.gaps = BinnedQuantiles(0.0, GAP_BIN, GAP_MAX)
        self.active_counts = np.zeros(0, dtype=np.int64)  # states by computed slots

    @property
    def overflow(self) -> list[float]:
        """Gaps >= GAP_MAX, kept exactly."""
        return self.gaps.overflow

    # -- accumulation ---------------------------------------------------------

    def _init_experts(self, n_experts: int) -> None:
        if self.n_experts is None:
            self.n_experts = n_experts
            self.nominal_load = np.zeros(n_experts, dtype=np.int64)
            self.contrib_load = np.zeros(n_experts, dtype=np.int64)
            self.computed_load = np.zeros(n_experts, dtype=np.int64)
        elif self.n_experts != n_experts:
            raise ValueError(f"expected {self.n_experts} experts, got {n_experts}")

    def _add_active(self, counts: np.ndarray) -> None:
        """Add per-count state counts (index n: states with n computed slots), the
        histogram growing to the longer of the two."""
        if counts.size > self.active_counts.size:
            grown = np.zeros(counts.size, dtype=np.int64)
            grown[: self.active_counts.size] = self.active_counts
            self.active_counts = grown
        self.active_counts[: counts.size] += counts

    def _add_gaps(self, gaps: np.ndarray) -> None:
        gaps = gaps[~np.isnan(gaps)]
        self.n_gaps += int(gaps.size)
        self.n_gap_ge1 += int((gaps >= 1.0).sum())
        self.n_gap_ge2 += int((gaps >= 2.0).sum())
        if self.threshold is not None:
            self.n_gap_ge_threshold += int((gaps >= self.threshold).sum())
        self.gaps.add(gaps)

    @torch.no_grad()
    def update(self, out: RouterOutput) -> RoutingStats:
        """Add the T tokens of ``out``; returns self."""
        m = token_measures(out, torch.float64)
        logits = out.logits_TE.detach().to(torch.float64)
        T, E = out.probs_TE.shape[0], out.n_experts  # E real experts (no null ones)
        self._init_experts(E)
        ids = out.ids_TK.detach().long()
        selected = out.selected_TK.detach().bool()
        dropped = out.dropped_TK.detach().bool() & selected
        computed, contrib = m.computed_TK, m.contrib_TK

        # discarded mass and support sizes
        discarded, support = m.discarded_T, m.support_T
        ge3 = support >= 3
        self.n_states += T
        self.sum_discarded += float(discarded.sum())
        self.n_support1 += int((support == 1).sum())
        self.n_support2 += int((support == 2).sum())
        self.n_support_ge3 += int(ge3.sum())
        self.sum_discarded_ge3 += float(discarded[ge3].sum())

        # slot counts and per-expert loads
        self.n_contrib += int(contrib.sum())
        self.n_computed += int(computed.sum())
        per_token = computed.sum(-1).long().cpu()  # computed slots of each state, 0..K
        self._add_active(torch.bincount(per_token, minlength=ids.shape[1] + 1).numpy())
        self.n_selected += int(selected.sum())
        self.n_dropped += int(dropped.sum())
        # a dropped token: a slot refused by the capacity limit and none computed
        self.n_dropped_tokens += int((dropped.any(-1) & ~computed.any(-1)).sum())
        self.n_unrouted += int(unrouted(selected).sum())
        self.n_chosen += int(out.chosen_TK.sum())
        if out.null_TK is not None:
            self.n_null += int(out.null_TK.sum())
        for load, mask in (
            (self.nominal_load, selected),
            (self.contrib_load, contrib),
            (self.computed_load, computed),
        ):
            load += expert_counts(ids, mask, E, torch.int64).cpu().numpy()

        # centred scores (finite entries only)
        finite = torch.isfinite(logits)
        z = torch.where(finite, logits, 0.0)
        n_fin = finite.sum(-1, keepdim=True)
        mean = z.sum(-1, keepdim=True) / n_fin.clamp_min(1)
        centred = torch.where(finite, logits - mean, 0.0)
        self.sum_sq_centred += float((centred**2).sum())
        self.n_score_entries += int(finite.sum())

        # top-2 gaps
        if logits.shape[-1] >= 2:  # the E (+ M null) columns the map sees
            self._add_gaps(top2_gap(logits).cpu().numpy())  # NaN: every expert masked
        return self

    def merge(self, other: RoutingStats) -> RoutingStats:
        """Add the counts of ``other`` (same map and expert count); returns self."""
        if other.map_name != self.map_name or other.alpha != self.alpha:
            raise ValueError("cannot merge statistics of different maps")
        if other.n_experts is not None:
            self._init_experts(other.n_experts)
            assert self.nominal_load is not None and other.nominal_load is not None
            assert self.contrib_load is not None and other.contrib_load is not None
            assert self.computed_load is not None and other.computed_load is not None
            self.nominal_load += other.nominal_load
            self.contrib_load += other.contrib_load
            self.computed_load += other.computed_load
        for name in (
            "n_states",
            "sum_discarded",
            "n_contrib",
            "n_computed",
            "n_selected",
            "n_dropped",
            "n_dropped_tokens",
            "n_unrouted",
            "n_null",
            "n_chosen",
            "n_support1",
            "n_support2",
            "n_support_ge3",
            "sum_discarded_ge3",
            "sum_sq_centred",
            "n_score_entries",
            "n_gaps",
            "n_gap_ge1",
            "n_gap_ge2",
            "n_gap_ge_threshold",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.gaps.merge(other.gaps)
        self._add_active(other.active_counts)
        return self

    # -- results ----------------------------------------------------------------

    def gap_percentile(self, q: float) -> float | None:
        """q-th percentile (0-100) of the top-2 gaps, linear interpolation as in
        numpy.percentile; within GAP_BIN / 2 of the exact value."""
        return self.gaps.percentile(q)

    def result(self) -> dict[str, Any]:
        """The statistics (see the module docstring) as a JSON-ready dict."""
        n = self.n_states
        res: dict[str, Any] = {
            "states": n,
            "discarded_mass": _ratio(self.sum_discarded, n),
            "contributors": _ratio(self.n_contrib, n),
            "singleton_rate": _ratio(self.n_support1, n),
            "pair_rate": _ratio(self.n_support2, n),
            "discarded_mass_support_ge3": _ratio(self.sum_discarded_ge3, self.n_support_ge3),
            "score_rms": (
                math.sqrt(self.sum_sq_centred / self.n_score_entries)
                if self.n_score_entries
                else None
            ),
            "gap_p50": self.gap_percentile(50),
            "gap_p90": self.gap_percentile(90),
            "gap_p99": self.gap_percentile(99),
            "frac_gap_ge1": _ratio(self.n_gap_ge1, self.n_gaps),
            "frac_gap_ge2": _ratio(self.n_gap_ge2, self.n_gaps),
            "frac_gap_ge_threshold": (
                None if self.threshold is None else _ratio(self.n_gap_ge_threshold, self.n_gaps)
            ),
            "threshold": self.threshold,
            "active_experts": _ratio(self.n_computed, n),
            "dropped_fraction": _ratio(self.n_dropped, self.n_selected),
            "dropped_tokens": _ratio(self.n_dropped_tokens, n),
            "unrouted_fraction": _ratio(self.n_unrouted, n),
            "null_fraction": _ratio(self.n_null, self.n_chosen),
            "active_hist": [int(c) for c in self.active_counts] if n else None,
        }
        if self.map_name is not None and not maps.info(self.map_name).fixed_total:
            res.update(discarded_mass=None, discarded_mass_support_ge3=None)
        if self.n_experts is None:
            res.update(
                nominal_cv=None,
                contrib_cv=None,
                contrib_sd=None,
                load_cv=None,
                load_rel_var=None,
                load_max_mean=None,
                dead_experts=None,
                load_shares=None,
            )
            return res
        assert self.nominal_load is not None and self.contrib_load is not None
        assert self.computed_load is not None
        contrib_total = int(self.contrib_load.sum())
        load = self.computed_load.astype(np.float64)
        load_total = float(load.sum())
        load_cv = _cv(load)
        res.update(
            nominal_cv=_cv(self.nominal_load.astype(np.float64)),
            contrib_cv=_cv(self.contrib_load.astype(np.float64)),
            contrib_sd=(
                float((self.contrib_load / contrib_total).std()) if contrib_total else None
            ),
            load_cv=load_cv,
            load_rel_var=None if load_cv is None else load_cv**2,
            load_max_mean=_ratio(float(load.max()), float(load.mean())),
            dead_experts=int((self.computed_load == 0).sum()),
            load_shares=(load / load_total).tolist() if load_total else None,
        )
        return res


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


class ModelRoutingStats:
    """One :class:`RoutingStats` per MoE layer; ``result()`` gives
    ``{"map", "alpha", "mean": {field: layer average}, "layers": [{"layer": i, ...}]}``.

    The mean of a field is over the layers where it is defined (``None`` if none);
    ``threshold`` is the map's threshold. Per-expert ``load_shares`` and the histogram of
    active experts per token ``active_hist`` are reported per layer only.
    """

    def __init__(
        self,
        n_layers: int,
        map_name: str,
        alpha: float | None = None,
        layer_maps: Sequence[tuple[str, float | None]] | None = None,
    ) -> None:
        """``layer_maps``: each layer's (map, alpha) where the layers' maps differ
        (``ModelConfig.router_layers``); each layer's result then names its own, and
        ``map_name`` / ``alpha`` are the shared router's. None: every layer's is
        ``(map_name, alpha)``."""
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        if layer_maps is not None and len(layer_maps) != n_layers:
            raise ValueError(f"layer_maps has {len(layer_maps)} entries, not n_layers = {n_layers}")
        self.map_name = map_name
        self.alpha = alpha
        self.layer_maps = None
        if layer_maps is not None and set(layer_maps) != {(map_name, alpha)}:
            self.layer_maps = [tuple(m) for m in layer_maps]
        pairs = self.layer_maps or [(map_name, alpha)] * n_layers
        self.layers = [RoutingStats(name, a) for name, a in pairs]

    def update(self, router_outputs: Sequence[RouterOutput]) -> ModelRoutingStats:
        """Add one batch: one RouterOutput per MoE layer, in layer order."""
        if len(router_outputs) != len(self.layers):
            raise ValueError(
                f"expected {len(self.layers)} router outputs (one per MoE layer), "
                f"got {len(router_outputs)}"
            )
        for acc, out in zip(self.layers, router_outputs, strict=True):
            acc.update(out)
        return self

    def merge(self, other: ModelRoutingStats) -> ModelRoutingStats:
        """Add another accumulator of the same model (other chunks or ranks)."""
        if len(other.layers) != len(self.layers):
            raise ValueError("cannot merge statistics of different layer counts")
        for acc, o in zip(self.layers, other.layers, strict=True):
            acc.merge(o)
        return self

    def result(self) -> dict[str, Any]:
        layers = [{"layer": i, **acc.result()} for i, acc in enumerate(self.layers)]
        if self.layer_maps is not None:  # the layers route with maps of their own
            for lay, (name, alpha) in zip(layers, self.layer_maps, strict=True):
                lay["map"], lay["alpha"] = name, alpha
        mean: dict[str, Any] = {f: _mean([lay[f] for lay in layers]) for f in FIELDS}
        mean["threshold"] = self.layers[0].threshold
        mean["states"] = sum(lay["states"] for lay in layers)
        return {"map": self.map_name, "alpha": self.alpha, "mean": mean, "layers": layers}


def routing_stats(
    outputs: Sequence[RouterOutput | Sequence[RouterOutput]],
    map_name: str,
    alpha: float | None = None,
) -> dict[str, Any]:
    """One-shot :class:`ModelRoutingStats` result. ``outputs[i]`` is layer i's
    RouterOutput, or a sequence of them (chunks of tokens of that layer)."""
    stats = ModelRoutingStats(len(outputs), map_name, alpha)
    for acc, item in zip(stats.layers, outputs, strict=True):
        for out in [item] if isinstance(item, RouterOutput) else item:
            acc.update(out)
    return stats.result()


def active_histograms(doc: Mapping[str, Any], shares: bool = False) -> list[list[Any]]:
    """The histogram of active experts per token of every MoE layer (the SoftMoE paper's
    Figure 1) from a statistics document: what :func:`moelab.diagnostics.stats`
    returns (``moelab stats --json``, also ``--hf``), :meth:`ModelRoutingStats.result`
    or :func:`routing_stats`. Row l, entry n: the tokens that compute exactly n experts
    at MoE layer l, an int (``shares``: a float, divided by the layer's tokens), every
    row padded with zeros to one length, 1 + the largest K of the layers.

    Raises:
        ValueError: a layer without ``active_hist`` (statistics of an older moelab, or
            of a layer that saw no tokens).
    """
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError("not a routing statistics document: it has no 'layers'")
    rows = []
    for lay in layers:
        hist = lay.get("active_hist") if isinstance(lay, Mapping) else None
        if not hist:
            where = lay.get("layer", "?") if isinstance(lay, Mapping) else "?"
            raise ValueError(
                f"layer {where} of the statistics has no 'active_hist' (statistics of an "
                "older moelab, or no tokens): measure them again with moelab stats"
            )
        rows.append([int(c) for c in hist])
    width = max(len(r) for r in rows)
    padded: list[list[Any]] = [r + [0] * (width - len(r)) for r in rows]
    if not shares:
        return padded
    return [[c / sum(r) for c in r] for r in padded]


def active_params(model: torch.nn.Module, active_experts: Sequence[float | None]) -> dict[str, Any]:
    """Measured parameters per token of ``model`` (a :class:`moelab.model.Transformer`,
    or any module with ``moe_layers`` whose ``experts`` have ``n_experts``), from each
    MoE layer's mean number of computed experts ``active_experts`` (layer order, e.g.
    the ``active_experts`` of :meth:`ModelRoutingStats.result`'s layers).

    Returns ``{"active_params": non_expert + sum_l active_experts[l] * expert_params[l]
    (None when a layer's count is None), "layers": that product per layer (the expert
    parameters a token uses there), "expert_params": [parameters of one expert, per
    layer], "non_expert_params": every parameter outside the experts}``.
    """
    experts = [layer.experts for layer in model.moe_layers]  # type: ignore[union-attr]
    if len(experts) != len(active_experts):
        raise ValueError(
            f"expected {len(experts)} active-expert counts (one per MoE layer), "
            f"got {len(active_experts)}"
        )
    in_experts = [sum(p.numel() for p in e.parameters()) for e in experts]
    per_expert = [n // e.n_experts for n, e in zip(in_experts, experts, strict=True)]
    non_expert = sum(p.numel() for p in model.parameters()) - sum(in_experts)
    layers = [
        None if a is None else float(a) * n for a, n in zip(active_experts, per_expert, strict=True)
    ]
    return {
        "active_params": None if None in layers else non_expert + sum(layers),  # type: ignore[arg-type]
        "layers": layers,
        "expert_params": per_expert,
        "non_expert_params": non_expert,
    }


__all__ = [
    "FIELDS",
    "GAP_BIN",
    "GAP_MAX",
    "ModelRoutingStats",
    "RoutingStats",
    "active_histograms",
    "active_params",
    "routing_stats",
]
