"""Configuration of the router: one flat dataclass, the public front, checked on
construction with messages that say what to change.

Each stage takes a small config of its own (``scorer_config``, ``temperature_config``,
``map_config``, ``selection_config``, ``gate_config``, ``balancing_config``), which
``RouterConfig`` builds from its flat keys and so checks; the checks that span two
stages are :mod:`moelab.routing.pairings`'s.

Old key names stay accepted (:data:`ALIASES`): as keyword arguments, as ``--set
router.NAME`` keys and in the ``config.json`` of runs written before the rename, and
they read and write the new field as attributes."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from moelab.routing import gates, losses, pairings, selection
from moelab.routing import temperature as schedules
from moelab.routing.mapping import MapConfig
from moelab.routing.scorer import ScorerConfig

ALIASES: dict[str, str] = {
    "threshold": "truncation",
    "threshold_relative": "truncation_relative",
    "cap_factor": "token_cap_factor",
}
"""Old router key -> its current name. ``threshold`` was the cut on p, which the maps'
singleton *gap* threshold (``maps.threshold``, the ``threshold`` statistic) shares a word
with; ``cap_factor`` was the per-token cap on kept experts, easily read as the
per-expert token capacity ``capacity_factor``."""


CHANGED_DEFAULTS: dict[str, str] = {
    "aux_weight": "0 (no balance loss) before the Switch loss was on by default",
    "top_p_cap": "the run's top_k before top-p took its prefix among all E experts",
}
"""Router keys whose default (or whose existence) changed, with the value runs written
before the change used. A saved config that lacks such a key loads with the old value
(:func:`implied_by_saved`), and a resumed run keeps its own value of these keys when the
resume command leaves them at today's default."""


def implied_by_saved(saved: Mapping[str, Any], config: RouterConfig) -> dict[str, Any]:
    """The values of :data:`CHANGED_DEFAULTS` keys that a saved router (``saved``: the
    router keys as the run's config.json and preset wrote them, ``config``: the router
    they build today) routed with, for the keys it lacks because it was written before
    the change; ``{}`` for a run that records them (every run that saves the resolved
    model does)."""
    saved = canonical_keys(saved)
    out: dict[str, Any] = {}
    if "aux_weight" not in saved:
        out["aux_weight"] = 0.0
    if "top_p_cap" not in saved and config.selection_rule.takes_top_p_cap:
        out["top_p_cap"] = config.top_k
    return out


def canonical_key(name: str) -> str:
    """The current name of a router key (an old name from :data:`ALIASES`, or ``name``)."""
    return ALIASES.get(name, name)


def canonical_keys(router: Mapping[str, Any]) -> dict[str, Any]:
    """Router settings with old key names replaced by the current ones.

    Raises:
        ValueError: an old and a new name of one key with different values.
    """
    out = {k: v for k, v in router.items() if k not in ALIASES}
    for old, new in ALIASES.items():
        if old in router:
            if new in router and router[new] != router[old]:
                raise ValueError(
                    f"router.{old} is the old name of router.{new}; give one of them, not "
                    f"both ({old}={router[old]!r}, {new}={router[new]!r})"
                )
            out[new] = router[old]
    return out


def _accepts_aliases(cls: type) -> type:
    """Let the dataclass ``__init__`` take the old key names too."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **canonical_keys(kwargs))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def _alias(new: str) -> property:
    """An attribute under an old name that reads and writes field ``new``."""

    def get(self: Any) -> Any:
        return getattr(self, new)

    def set_(self: Any, value: Any) -> None:
        setattr(self, new, value)

    return property(get, set_, doc=f"Old name of ``{new}`` (an alias).")


NULL_EXPERTS = ("zero", "identity", "constant")


@_accepts_aliases
@dataclass
class RouterConfig:
    """Router = linear scorer (optionally with a bias) -> temperature -> map -> selection
    -> gate."""

    d_model: int
    """Width of the token representations."""
    n_experts: int
    """Number of experts E."""
    top_k: int = 2
    """K: experts per token of a top-K rule; changeable at inference (``Router.top_k``)."""
    map: str = "softmax"
    """Probability map, a name of moelab.maps.available()."""
    alpha: float | None = None
    """alpha of entmax / normmax (defaults: 1.5 and 2.0)."""
    lapsum_k: float | None = None
    """k of the LapSum map (sum of the soft top-k weights); required for map="lapsum"."""
    renorm: bool = False
    """Renormalise the gate weights over the selected experts."""
    straight_through: bool = False
    """Gate weight 1 forward, gradient of log p backward (excludes renorm)."""
    gate: str | None = None
    """The gate rule, a name of ``moelab.routing.gates.available()``: "map" (the map's
    values), "renorm", "straight_through" or a registered one; None: chosen by the flat
    keys renorm / straight_through (which a gate of those names sets)."""
    selection: str = "topk"
    """The selection rule, a name of ``moelab.routing.selection.available()``: "topk"
    (the top_k experts), or "threshold": keep experts with p > truncation (a
    token-dependent count)."""
    truncation: float = 0.0
    """The cut on the map's values of a truncating rule (selection="threshold"): experts
    with p > truncation are kept (alias: ``threshold``)."""
    truncation_relative: bool = False
    """Read `truncation` in units of k / E, the mean LapSum value: the router keeps
    p > truncation * k / E (the SoftMoE paper's effective threshold), so the cut follows
    a learned per-layer k. LapSum only (alias: ``threshold_relative``)."""
    top_p: float = 0.4
    """The cumulative-probability target of selection="top_p", in (0, 1]: a token keeps
    the shortest prefix of its ranked experts whose p sums to at least top_p (the
    paper's p: 0.4), among all E experts unless ``top_p_cap`` caps it."""
    top_p_cap: int | None = None
    """selection="top_p": the most experts a token keeps, in [1, E] (None: no cap, the
    rule's definition). It is the router's K (``Router.top_k``, the width of ids_TK),
    which the K sweep of ``moelab eval`` varies. ``top_k`` does not apply to top-p.
    A run saved before this key existed capped at its ``top_k`` and loads so."""
    token_cap_factor: float | None = None
    """Per-token cap ceil(k * token_cap_factor) on the experts a truncating rule keeps
    (None: up to every expert). Not the per-expert capacity, ``capacity_factor``
    (alias: ``cap_factor``)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the router weight."""
    temperature: float = 1.0
    """Fixed temperature, and the start value of the schedules."""
    schedule: str = "fixed"
    """"fixed", "lipschitz" (tau = max(tau_min, sigma / (2 L*))) or "cosine" anneal."""
    lipschitz_target: float = 1.0
    """L*: the gate Lipschitz constant ||W||_2 / (2 tau) that the schedule holds."""
    tau_min: float = 0.05
    """Lower bound of the Lipschitz schedule."""
    tau_final: float = 1.0
    """End value of the cosine anneal (from `temperature`)."""
    anneal_steps: int = 1000
    """Length of the cosine anneal in training steps."""
    noise_std: float = 0.0
    """Exploration: Gaussian noise of this std on the logits (training only)."""
    jitter: float = 0.0
    """Input jitter eps in [0, 1) (training only; 0: off): the router's input is
    multiplied entrywise by factors drawn from U(1 - eps, 1 + eps) before the scores,
    so it moves the selection and the gate alike (Switch Transformer; Megatron-Core's
    ``moe_input_jitter_eps``). Unlike ``noise_std``, which only perturbs the ranking."""
    sample_extra: int = 0
    """Exploration: sample top_k of the top top_k + c experts by probability (training only)."""
    aux_weight: float = 0.01
    """Weight of the Switch balancing loss alpha * E * sum_i f_i P_i (0: off). On by
    default, as in every peer framework: without it a short run leaves experts dead.
    Runs saved before this default read 0 (:data:`CHANGED_DEFAULTS`)."""
    aux_probs: str = "map"
    """P_i of the Switch loss from the router's own map ("map"), a softmax of the logits
    ("softmax"), or the map's values divided by their sum per token ("normalized",
    DeepSeek-V3's a / sum_e a for sigmoid affinities)."""
    aux_count: str = "all"
    """Which slots f_i of the Switch loss counts: "all" (every selected slot, K per token
    for top-K) or "top1" (each token's top-1 expert only, the slot of its largest map
    value: Switch's f_i, the fraction of tokens whose top-1 expert is i, as the
    temperature-gating paper's eq. 6 counts it for its top-2 models)."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2)."""
    entropy_loss_weight: float = 0.0
    """Weight of the dynamic loss of top-p routing, the mean entropy -sum_e p_e log p_e
    of the map's values (0: off); any selection rule may use it."""
    bias_rate: float = 0.0
    """Auxiliary-loss-free balancing: sign-update rate of the selection bias (0: off)."""
    bias_update: str = "sign"
    """How the selection bias moves at each ``router.step(out)``: "sign" (auxiliary-loss-
    free balancing, +-``bias_rate`` toward the mean load; off while bias_rate is 0) or
    "quantile" (quantile balancing, Megatron-Core: set to the bias that gives each
    expert its share T K / E of the last global batch's slots, from a quantile of the
    ranking scores, :func:`moelab.routing.balancing.quantile_bias`; bias_rate stays 0).
    Quantile balancing needs a top-K rule without group limits."""
    bias_ema: float = 0.0
    """Quantile balancing: the old bias's weight in b <- ema b + (1 - ema) b_quantile, in
    [0, 1) (Megatron-Core's ``moe_router_quantile_balancing_ema``; 0: the last batch's
    quantile alone)."""
    capacity_factor: float | None = None
    """Per-expert token capacity, the Switch capacity factor: each expert takes at most
    ceil(cf * T * K / E) slots, the rest are dropped; None: dropless."""

    # group-limited routing (DeepSeek-V3; moelab.routing.selection.groups)
    n_groups: int | None = None
    """G: the experts form G groups of E / G; each token keeps its ``topk_groups`` groups
    of largest score (the sum of a group's two best map values plus bias) and its
    selection rule chooses among their experts. None or 1: off."""
    topk_groups: int | None = None
    """M: the groups kept per token, in [1, n_groups]; required with n_groups > 1."""
    routed_scaling: float = 1.0
    """Factor on the routed experts' gate weights, after renorm (DeepSeek-V3's routed
    scaling factor; 1: off)."""

    # balance-loss scope (moelab.routing.balancing.scoped_switch_loss)
    aux_scope: str = "micro_batch"
    """The tokens f_i of the Switch loss counts over: "micro_batch" (the router call's
    T tokens), "sequence" (each sequence on its own, the loss averaged over sequences,
    DeepSeek-V3) or "global" (f_i summed over the data-parallel ranks, Qiu et al. 2025)."""

    # ReLU routing with adaptive L1 (ReMoE; moelab.routing.relu_l1)
    l1_target: float | None = None
    """k of ReLU routing: the mean number of active experts per token the adaptive L1
    coefficient steers to (None: off). Adds lambda * L_reg (``losses["l1"]``) to the
    aux loss; needs a non-negative, unnormalised map with exact zeros (map="relu"), and
    with selection="threshold" turns the calibration of the cut off (every positive
    gate is kept, truncation stays as set: 0 for ReMoE)."""
    l1_rate: float = 1.2
    """gamma of the adaptive L1: lambda is multiplied (too dense) or divided (too sparse)
    by it once per optimiser step (ReMoE: 1.2); > 1."""
    l1_init: float = 1e-8
    """lambda_0, the L1 coefficient at the start (ReMoE: 1e-8); > 0. It grows by
    l1_rate per step while tokens use too many experts, so a short run may start
    higher."""

    # null experts (AdaMoE; MoE++'s zero-computation experts)
    n_null_experts: int = 0
    """M: null experts added to the E real ones. The router scores E + M experts and
    top-K over them gives a token 0..K real experts; a null expert takes no dispatch
    and no FLOPs, and the balance losses count it as an expert (AdaMoE). 0: off."""
    null_expert: str = "zero"
    """What a null expert outputs: "zero" (AdaMoE), "identity" (x times its gate
    weight, MoE++'s copy expert, LongCat-Flash's zero-computation expert) or "constant"
    (MoE++'s constant expert: its gate weight times a1 x + a2 v_m, with a learned
    v_m in R^D and [a1, a2] = softmax(W_m x), W_m a learned (2, D) matrix; the MoE
    layer holds v and W, ``moelab.moe.null.ConstantExperts``)."""
    null_target: float | None = None
    """Bias-driven control of the null experts (LongCat-Flash): the mean number of
    REAL experts per token, in (0, top_k), that auxiliary-loss-free balancing steers
    to. With it (and bias_rate > 0) each step moves every null expert's selection bias
    by +bias_rate while tokens reach more real experts than this and by -bias_rate
    while they reach fewer; the real experts keep their own balancing among
    themselves. None: the null experts are balanced as experts (their load toward
    the mean of the E + M)."""
    rank_by: str = "logits"
    """What the selection ranks experts by, before the balancing bias (and noise) is
    added: "logits" (the detached logits, default) or "probs" (the map's values,
    detached: LongCat-Flash and DeepSeek-V3 choose by softmax / sigmoid value + bias).
    Without a bias and noise both give the same top-K for a monotone map; group-limited
    choice (n_groups > 1) always ranks by the map's values."""

    # Sinkhorn-balanced and hash selection (moelab.routing.selection.sinkhorn, .hash)
    sinkhorn_iters: int = 8
    """selection="sinkhorn": the row-then-column normalisations of exp(ranking scores)
    in training (fixed, so no host sync; >= 1)."""
    vocab_size: int | None = None
    """V, the token ids the router may see; the model sets it from ModelConfig.vocab_size
    (selection="hash" needs it; None: unknown)."""
    hash_table: str = "random"
    """selection="hash": the token id -> experts table, "random" (drawn at construction
    from torch's RNG), "balanced" (ids assigned by training-data frequency to the least
    loaded experts) or "file:PATH[#KEY]" (a (V, top_k) table of expert ids read from a
    .safetensors / .npy / .pt file, e.g. DeepSeek-V4's ``tid2eid``; KEY names the tensor
    in a file of several)."""

    # scorer bias (GPT-OSS's router; moelab.integrations.hf.swap initialises it)
    scorer_bias: bool = False
    """A learned (E + M,) bias added to the scores x W^T (off: a linear scorer without
    bias, and no ``scorer_bias`` key in the router's state dict)."""

    threshold = _alias("truncation")
    threshold_relative = _alias("truncation_relative")
    cap_factor = _alias("token_cap_factor")

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_experts <= 0:
            raise ValueError("d_model and n_experts must be positive")
        # the map stage's checks; the map's default alpha is written back when not given
        self.alpha = self.map_config.alpha
        self.renorm, self.straight_through = gates.flags(
            self.gate, self.renorm, self.straight_through
        )
        # the selection stage's checks, then the pairings of the selection with the other
        # stages' settings (pairings.py)
        _ = self.selection_config
        rule = self.selection_rule
        pairings.one_slot_gate(rule, gates.get(self.gate_rule), self.top_k)
        pairings.bias_needs_a_learned_choice(rule, self.bias_rate)
        if self.bias_update == "quantile":
            pairings.quantile_balancing(rule, self.n_groups, self.null_target)
        pairings.relative_cut_needs_a_budget(self.truncation_relative, self.map_config)
        # each stage's config is built, so checked: the temperature, balancing and gate
        # stages (the map, the gate's name and the selection are checked above)
        _ = self.temperature_config
        _ = self.balancing_config
        _ = self.gate_config
        # the settings that span the stages: null experts, ReLU routing's adaptive L1
        self._check_null_experts(rule)
        if self.l1_target is not None:
            pairings.adaptive_l1(
                self.l1_target,
                self.map_config,
                renorm=self.renorm,
                straight_through=self.straight_through,
                n_null_experts=self.n_null_experts,
                slots=self.slots,
                selection=self.selection,
            )
        _ = self.scorer_config

    def _check_null_experts(self, rule: type[selection.Selection]) -> None:
        """n_null_experts and null_expert, and the settings of the stages they cannot pair
        with (:func:`moelab.routing.pairings.null_experts`)."""
        if self.n_null_experts < 0:
            raise ValueError(f"n_null_experts must be >= 0 (0: off), got {self.n_null_experts}")
        if self.null_expert not in NULL_EXPERTS:
            raise ValueError(f"null_expert must be one of {NULL_EXPERTS}, got {self.null_expert!r}")
        if not self.n_null_experts:
            if self.null_expert != "zero":
                raise ValueError(
                    f"null_expert={self.null_expert!r} says what the null experts output, "
                    "and there are none: set n_null_experts >= 1"
                )
            if self.null_target is not None:
                raise ValueError(
                    "null_target steers how often tokens choose null experts, and there are "
                    "none: set n_null_experts >= 1 or null_target=None"
                )
            return
        pairings.null_experts(
            rule,
            null_target=self.null_target,
            top_k=self.top_k,
            bias_rate=self.bias_rate,
            n_groups=self.n_groups,
            l1_target=self.l1_target,
        )

    # ------------------------------------------ each stage's own config, from the flat keys

    @property
    def temperature_config(self) -> schedules.TemperatureConfig:
        """The temperature stage's settings."""
        return schedules.TemperatureConfig(
            d_model=self.d_model,
            schedule=self.schedule,
            temperature=self.temperature,
            lipschitz_target=self.lipschitz_target,
            tau_min=self.tau_min,
            tau_final=self.tau_final,
            anneal_steps=self.anneal_steps,
        )

    @property
    def scorer_config(self) -> ScorerConfig:
        """The scorer stage's settings."""
        return ScorerConfig(
            self.d_model, self.n_scored, self.init_std, self.scorer_bias, self.jitter
        )

    @property
    def balancing_config(self) -> losses.BalancingConfig:
        """The balancing stage's settings: the keys of the same names."""
        keys = (f.name for f in fields(losses.BalancingConfig))
        return losses.BalancingConfig(**{key: getattr(self, key) for key in keys})

    @property
    def map_config(self) -> MapConfig:
        """The map stage's settings."""
        return MapConfig(self.map, self.n_experts, self.alpha, self.lapsum_k)

    @property
    def gate_rule(self) -> str:
        """The gate stage's rule (:mod:`moelab.routing.gates`): ``gate``, or from the flat
        keys "renorm", "straight_through" or "map" (the map's values)."""
        if self.gate is not None:
            return self.gate
        return gates.flag_name(self.renorm, self.straight_through)

    @property
    def gate_config(self) -> gates.GateConfig:
        """The gate stage's settings."""
        return gates.GateConfig(self.gate_rule, self.routed_scaling)

    @property
    def null_outputs(self) -> bool:
        """The null experts produce output ("identity", "constant"): the gate weighs
        (and renorm normalises over) their slots too."""
        return bool(self.n_null_experts) and self.null_expert != "zero"

    @property
    def n_scored(self) -> int:
        """E + M: the experts the router scores, the real ones and the null ones."""
        return self.n_experts + self.n_null_experts

    @property
    def map_params(self) -> dict[str, Any]:
        """The map's own parameters as this config sets them (``{"alpha": 1.5}``,
        ``{"k": 2.0}``; the map's defaults for the others), keyed as ``fn`` takes them."""
        return self.map_config.params

    @property
    def selection_config(self) -> selection.SelectionConfig:
        """The selection stage's settings: the keys of the same names."""
        keys = (f.name for f in fields(selection.SelectionConfig))
        return selection.SelectionConfig(**{key: getattr(self, key) for key in keys})

    @property
    def selection_rule(self) -> type[selection.Selection]:
        """The selection rule's class: what it is (``truncates``, ``sweep``,
        ``calibrates``) and what it implies (``slots``, ``expected_experts``)."""
        return selection.get(self.selection)

    @property
    def router_top_k(self) -> int:
        """The K a router of this config starts with (``Router.top_k``): the rule's
        :meth:`~moelab.routing.selection.Selection.router_top_k`."""
        return self.selection_rule.router_top_k(self.selection_config)

    @property
    def slots(self) -> int:
        """K: selection slots per token (top_k, or the cap of a truncating rule)."""
        return self.selection_rule.slots(self.selection_config)

    @property
    def expected_experts(self) -> float:
        """The real experts a token is expected to reach per layer (a truncating rule:
        its nominal k, lapsum_k else top_k). With M null experts, the rule's count times
        E / (E + M): under balanced load (what the balance loss aims at) a share
        M / (E + M) of the slots goes to null experts; with ``null_target``, that
        target (what the null experts' bias steers to)."""
        expected = self.selection_rule.expected_experts(self.selection_config)
        if not self.n_null_experts:
            return expected
        if self.null_target is not None:
            return float(self.null_target)
        return expected * self.n_experts / self.n_scored
