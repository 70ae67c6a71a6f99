"""The checks that span two stages: settings of one stage that another stage's variant
cannot work with. Each stage checks only its own config (``__post_init__`` of
:class:`~moelab.routing.mapping.MapConfig`, ...); the pairings are checked here, where
``RouterConfig`` (the front that builds every stage's config) and the Router's wiring
call them, so that no stage reads another stage's settings. The messages name the
``RouterConfig`` keys to change.
"""

from __future__ import annotations

from moelab import maps
from moelab.routing import relu_l1
from moelab.routing.gates import Gate
from moelab.routing.mapping import MapConfig
from moelab.routing.selection import Selection

__all__ = [
    "adaptive_l1",
    "bias_needs_a_learned_choice",
    "null_experts",
    "one_slot_gate",
    "one_slot_gate_in_training",
    "quantile_balancing",
    "relative_cut_needs_a_budget",
]


def one_slot_gate(rule: type[Selection], gate: type[Gate], top_k: int) -> None:
    """Gate x selection: a gate that is constant with one slot (renorm) and a rule that
    learns its choice only through the gate (top-K) give the router no gradient at
    K = 1."""
    if rule.learns_through_gate and gate.constant_at_one_slot and top_k == 1:
        raise ValueError(
            "renorm with top_k=1 makes every gate weight 1: the router gets no gradient. "
            "Use top_k >= 2, renorm=False, or straight_through=True."
        )


def one_slot_gate_in_training(refused: bool, top_k: int, training: bool) -> None:
    """:func:`one_slot_gate` for the K of one router call (``Router.top_k`` may change
    after construction), in training only; ``refused``: the router's gate and rule are
    such a pair."""
    if training and refused and top_k == 1:
        raise ValueError("renorm with top_k=1 gives the router no gradient; train with K>=2")


def bias_needs_a_learned_choice(rule: type[Selection], bias_rate: float) -> None:
    """Balancing x selection: the balancing bias moves a choice made by the scores, which
    a rule without a learned choice (hash routing) does not make."""
    if bias_rate and not rule.learned_choice:
        raise ValueError(
            f"selection={rule.name!r} has no learned choice for bias_rate to act on: "
            "set bias_rate=0"
        )


def quantile_balancing(
    rule: type[Selection], n_groups: int | None, null_target: float | None
) -> None:
    """Balancing x selection: quantile balancing (``bias_update="quantile"``) solves for
    the bias at which each token's top K of score + bias gives every expert its share,
    so it needs a rule that takes each token's top K of its own ranking scores (a fixed
    count, a learned choice, no other token read) and no group limits (Megatron-Core
    refuses them too); the null experts' budget control (``null_target``) moves their
    bias by the sign update."""
    if rule.truncates or not rule.learned_choice or rule.reads_batch:
        raise ValueError(
            f"bias_update='quantile' sets the bias at which each token's top-K of score + "
            f"bias gives every expert its share; selection={rule.name!r} does not choose "
            "so: use selection='topk' (or bias_update='sign')"
        )
    if n_groups not in (None, 1):
        raise ValueError(
            "bias_update='quantile' solves for the bias of ungrouped top-K; group-limited "
            "choice moves the cutoffs it reads: set n_groups=None or bias_update='sign'"
        )
    if null_target is not None:
        raise ValueError(
            "null_target steers the null experts by the sign update (bias_rate); quantile "
            "balancing gives every scored expert, null ones included, its share: set "
            "null_target=None or bias_update='sign'"
        )


def relative_cut_needs_a_budget(truncation_relative: bool, map_config: MapConfig) -> None:
    """Selection x map: a cut read in units of k / E (``truncation_relative``) needs a
    map with a budget k."""
    if truncation_relative and not maps.info(map_config.name).needs_k:
        with_k = " or ".join(f"map={n!r}" for n, i in maps.registry().items() if i.needs_k)
        raise ValueError(
            "truncation_relative (threshold_relative) reads the cut in units of k / E, "
            f"the mean value of a map with a budget k; it needs {with_k}, not "
            f"{map_config.name!r}"
        )


def adaptive_l1(
    l1_target: float,
    map_config: MapConfig,
    *,
    renorm: bool,
    straight_through: bool,
    n_null_experts: int,
    slots: int,
    selection: str,
) -> None:
    """Balancing x map, gate, scorer and selection: ReLU routing's adaptive L1
    (``l1_target``) needs a map whose L1 norm can shrink to exact zeros, the gates as the
    map gives them (neither ``renorm`` nor ``straight_through``), no null experts, and a
    rule (``selection``) whose ``slots`` hold ``l1_target`` experts."""
    why = relu_l1.unfit(map_config.name, map_config.params)
    if why is not None:
        raise ValueError(
            f"l1_target (ReLU routing's adaptive L1) needs a map with exact zeros whose L1 "
            f"norm can shrink; map={map_config.name!r} cannot, {why}: use map in "
            f"{relu_l1.l1_maps()}"
        )
    if renorm or straight_through:
        raise ValueError(
            "l1_target: the L1 penalty shrinks the gate values, which renorm and "
            "straight_through take out of the output; set renorm=False and "
            "straight_through=False (ReMoE's gates are the ReLU values themselves)"
        )
    if n_null_experts:
        raise ValueError(
            "l1_target: ReLU gates already give each token a variable number of experts, "
            "and the sparsity the L1 steers counts the E real experts only; set "
            "n_null_experts=0 (or drop l1_target)"
        )
    if l1_target > slots:
        raise ValueError(
            f"l1_target = {l1_target} exceeds the {slots} experts a token can keep under "
            f"selection={selection!r} (its slots: top_k, or ceil(l1_target * "
            "token_cap_factor) for a cut on p); raise them or lower l1_target"
        )


def null_experts(
    rule: type[Selection],
    *,
    null_target: float | None,
    top_k: int,
    bias_rate: float,
    n_groups: int | None,
    l1_target: float | None,
) -> None:
    """Null experts (there are some) x selection and balancing: ``null_target`` in
    (0, ``top_k``) and reached by the bias (``bias_rate`` > 0), a rule of a fixed count
    (not ``truncates``), no group-limited choice, no adaptive L1."""
    if null_target is not None:
        if not 0 < null_target < top_k:
            raise ValueError(
                f"null_target is the mean number of real experts per token, in (0, "
                f"top_k={top_k}); got {null_target}"
            )
        if not bias_rate > 0:
            raise ValueError(
                "null_target is reached by moving the null experts' selection bias: "
                "set bias_rate > 0 (e.g. 1e-3) or null_target=None"
            )
    if rule.truncates:
        raise ValueError(
            f"null experts make top-K token-adaptive; selection={rule.name!r} "
            "already chooses a token-dependent set, in which a null expert would take "
            "a place among the E real ones (or pick tokens): use selection='topk' "
            "with n_null_experts, or n_null_experts=0"
        )
    if n_groups not in (None, 1):
        raise ValueError(
            "group-limited routing splits the E real experts into groups, and null "
            "experts belong to none: set n_null_experts=0 or n_groups=None"
        )
    if l1_target is not None:
        raise ValueError(
            "ReLU routing's adaptive L1 (l1_target) steers the number of active experts "
            "itself; null experts would count among them: set n_null_experts=0 or "
            "l1_target=None"
        )
