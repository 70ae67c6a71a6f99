"""The MoE health set of training's metrics rows: per MoE layer, measures of the logged
step's routing and of the logging window's loads, summarised across the layers.

Every measure here is a plain function of tensors, so that a test can check it against
a hand computation; :func:`step_health` puts them together for one forward pass
(collective under torchrun: every number is global, over every rank's tokens).

Of the logged step's batch, per layer (``NAME_layers`` lists in the row):

``load_cv``
    ``std / mean`` (population std) of the computed slots per real expert
    (:func:`moelab.routing.measures.load_cv`).
``maxvio``
    :func:`max_violation`: ``max load / mean load - 1`` (0: perfectly balanced; the
    loss-free balancing paper's MaxVio of a batch).
``drop_rate``
    dropped slots / selected slots (a capacity limit; only with ``capacity_factor``).
``entropy``
    :func:`router_entropy`: the mean over tokens of ``-sum_e p_e log p_e`` of the map's
    values normalised to sum 1 per token (``0 log 0 = 0``), nats.
``top2_gap_q10``, ``top2_gap_q50``, ``top2_gap_q90``
    the 10th, 50th and 90th percentiles (linear interpolation, as ``numpy.quantile``)
    over tokens of the gap between the two largest logits the map received (after the
    temperature): the quantity the sparse maps' thresholds bound. Tokens whose gap is
    not finite (a masked second choice) are left out.
``singleton``, ``discarded``, ``contributors``, ``active``
    the per-token measures of :func:`moelab.routing.measures.token_measures`, mean over
    tokens (``discarded``: only for maps with a fixed total).
``seq_imbalance``
    :func:`sequence_imbalance`: within each sequence, the largest expert's share of the
    sequence's computed slots; the mean over sequences (1/E when every sequence spreads
    evenly, 1 when each sequence uses one expert).
``ep_imbalance``
    under expert parallelism: :func:`ep_imbalance`, the largest number of slots any rank
    received divided by the mean over ranks (1: even).

Of the logging window (the steps since the previous logged row):

``load_share_layers``
    per layer, each real expert's share of the layer's computed slots (a histogram per
    layer in the sinks).
``active_window_layers``
    per layer, the mean number of computed experts per token over every step of the
    window (its computed slots / its tokens; ``window_steps`` says how many steps it
    covers): the SoftMoE paper's Train-AE is their mean over training.
``dead_layers``
    :func:`dead_experts`: experts whose window load is at most ``dead_fraction`` times
    the layer's mean expert load (``dead_fraction`` 0: no token at all).

:func:`summary` gives ``NAME/min``, ``NAME/median`` and ``NAME/max`` of a per-layer list
(the median of an even count is the mean of the middle two), so the scalars of a row
stay the same in number whatever the depth.

Shape suffixes: B, T, E, K, L, R (moelab.shapes).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from moelab.routing.measures import expert_counts, load_cv, token_measures, top2_gap
from moelab.routing.output import RouterOutput

from . import distributed as D

__all__ = [
    "BALANCE_FLOOR",
    "DEAD_STEPS",
    "GAP_QUANTILES",
    "Watch",
    "dead_experts",
    "dead_mask",
    "ep_imbalance",
    "load_cv_of",
    "max_violation",
    "quantiles",
    "router_entropy",
    "sequence_imbalance",
    "step_health",
    "summaries",
    "summary",
]

GAP_QUANTILES = (0.1, 0.5, 0.9)
"""The percentiles of the top-2 gap in a row: ``top2_gap_q10``, ``_q50``, ``_q90``."""


DEAD_STEPS = 100
"""How long an expert must stay dead before :class:`Watch` warns: every logging window
of at least this many steps. One window says little: the sparse maps leave an expert
out of a batch or of a few steps early in training and take it back (the tiny preset
with sparsemax on moelab's own sources, logging every step: 23 warnings in 60 steps
when one window was enough; its experts' dead stretches lasted up to 49 steps, all
within the first 65 steps, and every one of them came back). Twice the longest such
stretch seen."""


BALANCE_FLOOR = 0.01
"""The Switch loss ``E sum_i f_i P_i`` is 1 under balanced load; below this while the
busiest expert takes more than twice the mean load (MaxVio > 1), it no longer sees the
imbalance and :class:`Watch` warns."""


def summary(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{NAME/min, NAME/median, NAME/max}`` of a non-empty per-layer list."""
    vals = [float(v) for v in values]
    return {
        f"{name}/min": min(vals),
        f"{name}/median": float(statistics.median(vals)),
        f"{name}/max": max(vals),
    }


def summaries(row: dict[str, Any]) -> dict[str, float]:
    """The summaries of every per-layer list of numbers ``NAME_layers`` in ``row``
    (``load_share_layers``, a list of lists, is not one)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if not key.endswith("_layers") or not isinstance(value, list) or not value:
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.update(summary(key[: -len("_layers")], value))
    return out


def load_cv_of(load_E: torch.Tensor) -> float:
    """``std(load) / mean(load)`` (population std); 0 when no expert has a token."""
    return float(load_cv(load_E.double()).nan_to_num(0.0))


def max_violation(load_E: torch.Tensor) -> float:
    """MaxVio: ``max(load) / mean(load) - 1``; 0 when no expert has a token."""
    load_E = load_E.double()
    mean = load_E.mean()
    return float(load_E.max() / mean - 1.0) if mean > 0 else 0.0


def dead_mask(load_E: torch.Tensor, fraction: float = 0.0) -> torch.Tensor:
    """Per expert, whether its load is at most ``fraction`` times the mean load
    (``fraction`` 0: no token). A layer with no token at all has every expert dead."""
    load_E = load_E.double()
    return load_E <= fraction * load_E.mean()


def dead_experts(load_E: torch.Tensor, fraction: float = 0.0) -> int:
    """Experts whose load is at most ``fraction`` times the mean load (``fraction`` 0:
    the experts with no token): the count of :func:`dead_mask`."""
    return int(dead_mask(load_E, fraction).sum())


def router_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """Per token, ``-sum_e p_e log p_e`` of the row normalised to sum 1 (``0 log 0 =
    0``; a row with no mass has entropy 0), in nats, float64."""
    p_TE = probs_TE.detach().double().clamp_min(0.0)
    total_T = p_TE.sum(-1, keepdim=True)
    p_TE = torch.where(total_T > 0, p_TE / total_T.clamp_min(1e-300), 0.0)
    return -torch.special.xlogy(p_TE, p_TE).sum(-1)


def quantiles(values: torch.Tensor, qs: Sequence[float] = GAP_QUANTILES) -> list[float]:
    """The ``qs`` quantiles of the finite ``values`` (linear interpolation, as
    ``numpy.quantile``); 0 for each when none is finite."""
    v = values.detach().double().flatten()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return [0.0 for _ in qs]
    return [float(x) for x in torch.quantile(v, torch.tensor(list(qs), dtype=v.dtype))]


def sequence_imbalance(
    ids_TK: torch.Tensor, computed_TK: torch.Tensor, n_experts: int, seq_len: int
) -> torch.Tensor:
    """Per sequence (the T tokens are consecutive sequences of ``seq_len``), the largest
    expert's share of the sequence's computed slots (0 for a sequence with none), float64."""
    T, K = ids_TK.shape
    if T % seq_len:
        raise ValueError(f"{T} tokens are not whole sequences of {seq_len}")
    ids = ids_TK.reshape(T // seq_len, seq_len * K).long()
    mask = computed_TK.reshape(T // seq_len, seq_len * K).double()
    counts_BE = torch.zeros(ids.shape[0], n_experts + 1, dtype=torch.float64)
    counts_BE.scatter_add_(1, torch.where(mask > 0, ids, n_experts), mask)
    counts_BE = counts_BE[:, :n_experts]
    total_B = counts_BE.sum(-1)
    return torch.where(total_B > 0, counts_BE.amax(-1) / total_B.clamp_min(1.0), 0.0)


def ep_imbalance(counts_RE: torch.Tensor, ep: int) -> float:
    """Expert parallelism over groups of ``ep`` ranks (rank ``r`` is position ``r % ep``
    of group ``r // ep``; position ``g`` holds experts ``g E/ep .. (g+1) E/ep - 1``):
    from each rank's slots per expert ``counts_RE``, the slots each rank receives from
    its group, max over the ranks / mean over the ranks (1: even; 1 when no slot)."""
    R, E = counts_RE.shape
    if R % ep or E % ep:
        raise ValueError(f"ep = {ep} must divide the {R} ranks and the {E} experts")
    per_group = counts_RE.double().reshape(R // ep, ep, E).sum(1)  # (groups, E)
    received = per_group.reshape(R // ep, ep, E // ep).sum(-1).flatten()
    mean = received.mean()
    return float(received.max() / mean) if mean > 0 else 1.0


@torch.no_grad()
def step_health(
    outs: Sequence[RouterOutput],
    seq_len: int,
    info: D.DistInfo,
    discarded: bool = True,
    capacity: bool = False,
    ep: int = 1,
) -> dict[str, list[float]]:
    """The per-layer health lists of one forward pass (``NAME_layers``, see the module),
    global over the ranks: collective under torchrun (every rank calls it, each with
    its own batch of the same size). ``discarded``: the map has a fixed total;
    ``capacity``: a capacity limit is set (drop rates); ``ep``: expert-parallel group."""
    if not outs:
        return {}
    n_experts = outs[0].n_experts
    # per-token means: every rank holds the same number of tokens, so their mean of
    # means is the global mean
    means: dict[str, float] = {}
    counts, selected, dropped, gaps = [], [], [], []
    for i, o in enumerate(outs):
        m = token_measures(o, torch.float64)
        computed_TK, selected_TK = m.computed_TK, o.selected_TK.detach()
        means[f"entropy.{i}"] = float(router_entropy(o.probs_TE).mean())
        means[f"singleton.{i}"] = float((m.support_T == 1).double().mean())
        means[f"discarded.{i}"] = float(m.discarded_T.mean())
        means[f"contributors.{i}"] = float(m.contrib_TK.sum(-1).double().mean())
        means[f"active.{i}"] = float(computed_TK.sum(-1).double().mean())
        means[f"seq_imbalance.{i}"] = float(
            sequence_imbalance(o.ids_TK.cpu(), computed_TK.cpu(), n_experts, seq_len).mean()
        )
        counts.append(expert_counts(o.ids_TK, computed_TK, n_experts, torch.float64))
        selected.append(selected_TK.sum().double())
        dropped.append((o.dropped_TK.detach() & selected_TK).sum().double())
        gaps.append(top2_gap(o.logits_TE.detach().float()))
    means = D.all_reduce_mean(means, info)
    counts_RLE = D.all_gather(torch.stack(counts), info)  # (ranks, L, E)
    load_LE = counts_RLE.sum(0).cpu()
    gaps_LT = D.all_gather(torch.stack(gaps), info).transpose(0, 1).flatten(1).cpu()
    L = len(outs)
    health: dict[str, list[float]] = {
        "load_cv_layers": [load_cv_of(load_LE[i]) for i in range(L)],
        "maxvio_layers": [max_violation(load_LE[i]) for i in range(L)],
    }
    if capacity:
        sel = D.all_reduce_sum(torch.stack(selected), info).cpu()
        drop = D.all_reduce_sum(torch.stack(dropped), info).cpu()
        health["drop_rate_layers"] = [
            float(drop[i] / sel[i]) if sel[i] > 0 else 0.0 for i in range(L)
        ]
    health["entropy_layers"] = [means[f"entropy.{i}"] for i in range(L)]
    qs = [quantiles(gaps_LT[i]) for i in range(L)]
    for j, q in enumerate(GAP_QUANTILES):
        health[f"top2_gap_q{round(100 * q):02d}_layers"] = [qs[i][j] for i in range(L)]
    names = ["singleton", "discarded", "contributors", "active", "seq_imbalance"]
    for name in names:
        if name == "discarded" and not discarded:
            continue
        health[f"{name}_layers"] = [means[f"{name}.{i}"] for i in range(L)]
    if ep > 1:
        health["ep_imbalance_layers"] = [ep_imbalance(counts_RLE[:, i].cpu(), ep) for i in range(L)]
    return health


class Watch:
    """The warnings of the metrics rows, each said once when it starts (a thing that
    grows is said again; one that stays, comes and goes or shrinks is not):

    - dead experts: per MoE layer, the experts that have been dead (see
      :func:`dead_mask`) in every logging window of the last :data:`DEAD_STEPS` steps
      or more; said when their number exceeds the number last said for the layer
      (after a drop, a new rise is news again);
    - a balance loss near zero while the loads are skewed (:data:`BALANCE_FLOOR`).

    :meth:`state` and :meth:`restore` carry what it has seen over a checkpoint, so a
    resumed run warns as the run would have without the stop."""

    def __init__(self, n_experts: int, dead_fraction: float, dead_steps: int | None = None) -> None:
        self.n_experts, self.dead_fraction = n_experts, dead_fraction
        self.dead_steps = DEAD_STEPS if dead_steps is None else dead_steps
        self._since: list[list[int | None]] = []  # per layer and expert: its streak's start
        self._said: list[int] = []  # per layer: the dead experts last said
        self._balance: set[int] = set()

    def check(
        self, row: dict[str, Any], since: int, dead_LE: torch.Tensor | None = None
    ) -> list[str]:
        """The warning lines of ``row``, whose logging window holds the steps after
        ``since``; ``dead_LE`` marks each layer's experts dead over that window (None:
        the window counted nothing)."""
        step, lines = row["step"], []
        if dead_LE is not None:
            lines += self._dead_lines(step, since, dead_LE.tolist())
        balance = row.get("balance_loss_layers") or []
        maxvio = row.get("maxvio_layers") or []
        for i, (loss, vio) in enumerate(zip(balance, maxvio, strict=False)):
            if loss is None:  # the layer has no Switch loss (router_layers)
                continue
            if i not in self._balance and loss < BALANCE_FLOOR and vio > 1.0:
                self._balance.add(i)
                lines.append(
                    f"warning: step {step}: MoE layer {i}'s balance loss is {loss:.3g} (1 "
                    f"when balanced) while its busiest expert takes {1 + vio:.2f}x the mean "
                    "load: the loss no longer sees the imbalance (its P_i vanish on the "
                    "loaded experts; try --set router.aux_probs=softmax)"
                )
        return lines

    def _dead_lines(self, step: int, since: int, dead: list[list[bool]]) -> list[str]:
        """Follow each expert's dead streak over the window after ``since``; the lines
        of the layers whose long-dead experts now outnumber what was last said."""
        while len(self._since) < len(dead):
            self._since.append([None] * len(dead[len(self._since)]))
            self._said.append(0)
        lines = []
        what = (
            "no token"
            if self.dead_fraction == 0
            else f"a load at most {self.dead_fraction:g} of the mean"
        )
        for i, dead_E in enumerate(dead):
            starts = self._since[i]
            for e, is_dead in enumerate(dead_E):
                starts[e] = (since if starts[e] is None else starts[e]) if is_dead else None
            spans = [step - s for s in starts if s is not None and step - s >= self.dead_steps]
            if len(spans) > self._said[i]:
                lines.append(
                    f"warning: step {step}: MoE layer {i} has {len(spans)} dead expert(s) of "
                    f"{self.n_experts} ({what} over each of the last {min(spans)} steps or "
                    "more); see docs/training.md, 'Watching a run'"
                )
            self._said[i] = len(spans)
        return lines

    def state(self) -> dict[str, Any]:
        """What the watch has seen, as JSON (a checkpoint's)."""
        return {"dead_since": self._since, "said": self._said, "balance": sorted(self._balance)}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from :meth:`state` (None: from nothing seen, as a checkpoint of a
        moelab before this one)."""
        if not state:
            return
        self._since = [list(layer) for layer in state.get("dead_since", [])]
        self._said = [int(n) for n in state.get("said", [])]
        self._balance = {int(i) for i in state.get("balance", [])}
