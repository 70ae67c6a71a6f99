"""Configuration of the model: one small dataclass, checked on construction with messages
that say what to change, and the analytic parameter count of the model it describes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from moelab import maps
from moelab.moe.layer import MoEConfig
from moelab.routing import selection
from moelab.routing.config import RouterConfig, canonical_keys

MOE_LAYER_CHOICES = ("every_second", "all", "none")


@dataclass
class ModelConfig:
    """A decoder-only transformer whose feed-forward is an MoE layer in some blocks."""

    n_layers: int
    """Number of transformer blocks."""
    d_model: int
    """Width D of the residual stream."""
    n_heads: int
    """Query heads H; the head width is d_model // n_heads."""
    n_kv_heads: int
    """Key/value heads G (grouped-query attention); must divide n_heads."""
    d_ff: int
    """Hidden width of the dense SwiGLU feed-forward."""
    vocab_size: int
    """Vocabulary size V (input and output embeddings are separate matrices)."""
    max_seq_len: int
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    moe_layers: str | list[int] = "every_second"
    """Blocks whose feed-forward is an MoE layer: "every_second" (0-based 1, 3, 5, ...),
    "all", "none", or an explicit list of 0-based block indices."""
    n_experts: int = 8
    """Experts E per MoE layer."""
    expert_d_ff: int | None = None
    """Hidden width of each expert; None: the dense d_ff."""
    n_shared_experts: int = 0
    """Shared experts per MoE layer (DeepSeekMoE): always-on experts of width expert_d_ff
    beside the E routed ones (``MoEConfig.n_shared_experts``); 0: none."""
    shared_gate: bool = False
    """Scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE;
    ``MoEConfig.shared_gate``)."""
    gate_on: str = "output"
    """Where the routed experts' gate weight applies (``MoEConfig.gate_on``): "output"
    (w expert(x)) or "input" (expert(w x), Llama 4)."""
    router: dict[str, Any] = field(default_factory=dict)
    """Overrides of RouterConfig (map, top_k, alpha, ...), shared by every MoE layer;
    d_model and n_experts come from the model."""
    router_preset: str | None = None
    """A named router preset (:mod:`moelab.model.router_presets`: "deepseek-v3",
    "deepseek-v4", "gpt-oss", "kimi-k2"): its router keys sit beneath ``router`` and its
    per-layer overrides beneath ``router_layers`` (what this config sets wins). None:
    no preset."""
    router_layers: list[dict[str, Any] | None] | dict[str, Any] | None = None
    """Per-MoE-layer overrides of the shared ``router`` (:func:`layer_overrides`): a list
    (entry i: RouterConfig field overrides of MoE layer i, counted from 0; null or {}:
    as the shared config; a list shorter than the MoE layers leaves the rest shared) or
    one rule ``{"first": N, "set": {...}}`` (also ``"last": N`` or ``"layers": [i,
    ...]``) that applies ``set`` to those MoE layers. Resolved on construction to the
    list form, one entry per MoE layer (None: no layer differs). Dotted overrides
    address one layer: ``--set model.router_layers.0.selection=hash``."""
    norm_eps: float = 1e-5
    """epsilon of the RMSNorms."""
    k_total: float | None = None
    """Learned allocation across layers: the global budget K of active experts that one
    LayerAllocator spreads over the L MoE layers, k_l = softmax(eta)_l (K - L) + 1, each
    k_l feeding its layer's LapSum k (e.g. K = 2 L for the compute of top-2). Needs
    router.map = "lapsum" and a selection rule whose cut on p is calibrated to k
    (``calibrates``: router.selection = "threshold"); router.lapsum_k defaults to K / L
    (every layer's k at initialisation) and router.truncation_relative to true, so the
    truncation follows k_l. None: a fixed k per layer."""
    k_lr_scale: float = 1.0
    """Under learned allocation: the learning rate of the allocator's eta (the k_l
    logits) as a multiple of the run's lr (its schedule follows lr's). 1: the same lr
    as every other parameter (one optimiser group, as before the option existed)."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}; "
                "choose n_heads among the divisors of d_model"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"the head width d_model / n_heads = {self.head_dim} must be even for the "
                "rotary embedding; change d_model or n_heads"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.n_kv_heads}; "
                "each key/value head serves the same number of query heads, so choose "
                "n_kv_heads among the divisors of n_heads"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if isinstance(self.moe_layers, str):
            if self.moe_layers not in MOE_LAYER_CHOICES:
                raise ValueError(
                    f"moe_layers must be one of {MOE_LAYER_CHOICES} or a list of block "
                    f"indices, got {self.moe_layers!r}"
                )
        else:
            self.moe_layers = [int(i) for i in self.moe_layers]
            bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(
                    f"moe_layers {bad} lie outside the blocks 0..{self.n_layers - 1} "
                    "(indices count from 0)"
                )
            if len(set(self.moe_layers)) != len(self.moe_layers):
                raise ValueError(f"moe_layers lists a block twice: {self.moe_layers}")
        if self.n_experts <= 0:
            raise ValueError(f"n_experts must be positive, got {self.n_experts}")
        if self.expert_d_ff is None:
            self.expert_d_ff = self.d_ff
        if self.expert_d_ff <= 0:
            raise ValueError(f"expert_d_ff must be positive, got {self.expert_d_ff}")
        for key in ("d_model", "n_experts", "vocab_size"):
            if key in self.router:
                raise ValueError(
                    f"router.{key} is set from the model; set ModelConfig.{key} instead"
                )
        self._resolve_router_layers()
        if not self.k_lr_scale > 0:
            raise ValueError(f"k_lr_scale must be > 0, got {self.k_lr_scale}")
        if self.k_lr_scale != 1.0 and self.k_total is None:
            raise ValueError("k_lr_scale scales the learned allocation's lr; it needs k_total")
        if self.k_total is not None:
            if self.router_layers is not None:
                raise ValueError(
                    "k_total (learned allocation) spreads one budget over layers that share "
                    "their router; drop router_layers (or router_preset) or k_total"
                )
            self._check_allocation()
        if self.moe_indices:
            # fail now, not when the model is built, on a bad router or MoE override
            self.moe_config()
            if self.router_layers is not None:  # each layer's own, where they differ
                self.router_configs()

    def _resolve_router_layers(self) -> None:
        """Put the router preset beneath ``router`` and ``router_layers``, and
        ``router_layers`` in its list form (None when no layer differs)."""
        n_moe = len(self.moe_indices)
        preset_layers: list[dict[str, Any]] = [{} for _ in range(n_moe)]
        if self.router_preset is not None:
            from moelab.model.router_presets import router_preset

            preset = router_preset(self.router_preset)
            self.router = {**canonical_keys(preset.router), **canonical_keys(self.router)}
            preset_layers = layer_overrides(preset.router_layers, n_moe, "the preset's ")
        ours = layer_overrides(self.router_layers, n_moe)
        merged = [{**p, **o} for p, o in zip(preset_layers, ours, strict=True)]
        self.router_layers = [m or None for m in merged] if any(merged) else None

    def _check_allocation(self) -> None:
        """Validate learned allocation and fill the router defaults it implies."""
        n_moe = len(self.moe_indices)
        if n_moe == 0:
            raise ValueError("k_total (learned allocation) needs MoE layers; moe_layers is none")
        rule = selection.get(self.router.get("selection", RouterConfig.selection))
        budget_map = maps.info(self.router.get("map", RouterConfig.map)).needs_k
        if not budget_map or not rule.calibrates:
            calibrating = [n for n in selection.available() if selection.get(n).calibrates]
            raise ValueError(
                "k_total (learned allocation across layers) feeds each layer's LapSum k and "
                "needs truncating LapSum routers: set router.map=lapsum and "
                f"router.selection={' or '.join(calibrating)}"
            )
        k_init = float(self.k_total) / n_moe
        self.router = dict(self.router)
        given = self.router.setdefault("lapsum_k", k_init)
        if given is None or abs(float(given) - k_init) > 1e-9 * max(1.0, k_init):
            raise ValueError(
                f"with k_total = {self.k_total} over {n_moe} MoE layers every layer starts at "
                f"k = K / L = {k_init:g}, but router.lapsum_k = {given}; drop router.lapsum_k "
                "or set it to K / L"
            )
        if "truncation_relative" not in canonical_keys(self.router):
            # NOTE: under its old name, an alias RouterConfig reads, so that code reading
            # ModelConfig.router by that key keeps working
            self.router["threshold_relative"] = True
        # the allocator's own checks (K > L, K - L + 1 < E), with its messages
        from moelab.routing.allocation import LayerAllocator

        LayerAllocator(n_moe, float(self.k_total), self.n_experts)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, d_model // n_heads."""
        return self.d_model // self.n_heads

    @property
    def moe_indices(self) -> list[int]:
        """0-based indices of the blocks whose feed-forward is an MoE layer, ascending."""
        if self.moe_layers == "every_second":
            return list(range(1, self.n_layers, 2))
        if self.moe_layers == "all":
            return list(range(self.n_layers))
        if self.moe_layers == "none":
            return []
        return sorted(self.moe_layers)

    @property
    def uniform_routers(self) -> bool:
        """Every MoE layer routes with the shared ``router`` (no ``router_layers``)."""
        return self.router_layers is None

    def router_config(self, layer: int | None = None) -> RouterConfig:
        """The RouterConfig of MoE layer ``layer`` (counted from 0 among the MoE layers:
        the shared ``router`` with that layer's ``router_layers`` entry on top), or with
        ``layer=None`` the shared one (every layer's when ``uniform_routers``). Every
        layer gets its own router; d_model, n_experts and vocab_size (the token ids a
        hash rule routes by) are the model's.

        Raises:
            ValueError: a layer's override that RouterConfig refuses, in one line that
                names the layer, its block and the field.
        """
        keys = dict(self.router)
        if layer is not None:
            n_moe = len(self.moe_indices)
            if not 0 <= layer < n_moe:
                raise ValueError(f"MoE layer {layer} does not exist: the model has {n_moe}")
            own = (self.router_layers or [None] * n_moe)[layer] or {}
            keys = {**canonical_keys(keys), **canonical_keys(own)}
            try:
                return RouterConfig(
                    d_model=self.d_model,
                    n_experts=self.n_experts,
                    vocab_size=self.vocab_size,
                    **keys,
                )
            except (TypeError, ValueError) as err:
                block = self.moe_indices[layer]
                raise ValueError(
                    f"router_layers[{layer}] (MoE layer {layer}, block {block}; sets "
                    f"{', '.join(sorted(own)) or 'nothing'}): {err}"
                ) from None
        return RouterConfig(
            d_model=self.d_model,
            n_experts=self.n_experts,
            vocab_size=self.vocab_size,
            **keys,
        )

    def router_configs(self) -> list[RouterConfig]:
        """The RouterConfig of each MoE layer, in order (:meth:`router_config`)."""
        return [self.router_config(layer) for layer in range(len(self.moe_indices))]

    def moe_config(self, layer: int | None = None) -> MoEConfig:
        """The MoEConfig of MoE layer ``layer`` (None: with the shared router): its router
        (:meth:`router_config`), experts of width expert_d_ff and the shared experts."""
        assert self.expert_d_ff is not None
        return MoEConfig(
            self.d_model,
            self.expert_d_ff,
            self.router_config(layer),
            n_shared_experts=self.n_shared_experts,
            shared_gate=self.shared_gate,
            gate_on=self.gate_on,
        )


RULE_SELECTORS = ("first", "last", "layers")
"""The keys of a ``router_layers`` rule that say which MoE layers its ``set`` applies to."""


def layer_overrides(
    router_layers: list[dict[str, Any] | None] | dict[str, Any] | None,
    n_moe: int,
    whose: str = "",
) -> list[dict[str, Any]]:
    """``ModelConfig.router_layers`` as one dict of RouterConfig overrides per MoE layer
    ({} where the layer takes the shared config), checked.

    Forms: None (no overrides); a list of at most ``n_moe`` entries, each a dict of
    RouterConfig fields or None; a rule, a dict of one selector among
    :data:`RULE_SELECTORS` (``"first": N`` the first N MoE layers, ``"last": N`` the
    last N, ``"layers": [i, ...]`` those) and ``"set"``, the overrides. Keys are checked
    against RouterConfig's fields here (the values when the layer's RouterConfig is
    built, :meth:`ModelConfig.router_config`); old names of
    :data:`moelab.routing.config.ALIASES` are read as the current ones.

    Raises:
        ValueError: in one line naming the entry: a form of neither kind, a list longer
            than the MoE layers, a selector out of range, an unknown router field, or
            d_model / n_experts / vocab_size (the model's).
    """
    name = f"{whose}router_layers"
    if router_layers is None:
        return [{} for _ in range(n_moe)]
    if isinstance(router_layers, dict):
        return _rule_overrides(router_layers, n_moe, name)
    if not isinstance(router_layers, list):
        raise ValueError(
            f"{name} must be a list (one dict of router overrides per MoE layer) or a rule "
            f'{{"first": N, "set": {{...}}}}, got {router_layers!r}'
        )
    if len(router_layers) > n_moe:
        raise ValueError(
            f"{name} has an entry for MoE layer {len(router_layers) - 1} but the model has "
            f"{n_moe} MoE layers (0..{n_moe - 1}, counted from 0 among the MoE layers)"
        )
    out = []
    for i, entry in enumerate(router_layers):
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(
                f"{name}[{i}] must be a dict of router overrides or null, got {entry!r}"
            )
        out.append(_checked_keys(entry or {}, f"{name}[{i}]"))
    return out + [{} for _ in range(n_moe - len(out))]


def _rule_overrides(rule: dict[str, Any], n_moe: int, name: str) -> list[dict[str, Any]]:
    selectors = [key for key in RULE_SELECTORS if key in rule]
    unknown = sorted(set(rule) - {*RULE_SELECTORS, "set"})
    if unknown or len(selectors) != 1 or not isinstance(rule.get("set"), dict):
        raise ValueError(
            f"{name} as a rule takes one of {', '.join(RULE_SELECTORS)} and a dict 'set' "
            f'(e.g. {{"first": 3, "set": {{"selection": "hash"}}}}), got {rule!r}'
        )
    key = selectors[0]
    value = rule[key]
    if key == "layers":
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            raise ValueError(f"{name}.layers must be a list of MoE layer indices, got {value!r}")
        bad = [i for i in value if not 0 <= i < n_moe]
        if bad:
            raise ValueError(
                f"{name}.layers {bad} lie outside the MoE layers 0..{n_moe - 1} "
                "(counted from 0 among the MoE layers)"
            )
        chosen = set(value)
    else:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= n_moe:
            raise ValueError(
                f"{name}.{key} must be a whole number in [0, {n_moe}] (the model's MoE "
                f"layers), got {value!r}; for more MoE layers raise n_layers or set "
                "moe_layers (e.g. all)"
            )
        chosen = set(range(value)) if key == "first" else set(range(n_moe - value, n_moe))
    keys = _checked_keys(rule["set"], f"{name}.set")
    return [dict(keys) if i in chosen else {} for i in range(n_moe)]


_LAYER_KEYS = {f.name for f in fields(RouterConfig)} - {"d_model", "n_experts", "vocab_size"}


def _checked_keys(overrides: dict[str, Any], where: str) -> dict[str, Any]:
    keys = canonical_keys(overrides)
    for key in keys:
        if key in ("d_model", "n_experts", "vocab_size"):
            raise ValueError(f"{where}.{key} is set from the model; set ModelConfig.{key}")
        if key not in _LAYER_KEYS:
            raise ValueError(
                f"{where}.{key} is not a router field; router fields: "
                f"{', '.join(sorted(_LAYER_KEYS))}"
            )
    return keys


def null_expert_params(rc: RouterConfig) -> int:
    """Parameters of one MoE layer's null experts: 3 D per constant expert (v_m and W_m,
    :class:`moelab.moe.null.ConstantExperts`), none for zero and identity ones."""
    return 3 * rc.d_model * rc.n_null_experts if rc.null_expert == "constant" else 0


def param_counts(config: ModelConfig) -> dict[str, int]:
    """Parameter counts of the model `config` describes, computed without building it.

    Returns:
        {"total": every parameter, "active": the parameters one token uses (embeddings,
        attention, norms, dense feed-forwards and routers, plus the experts it reaches
        in each MoE layer, and its shared experts), "router": the router weights and
        scorer biases}, and for a truncating router (its selection rule ``truncates``, e.g.
        router.selection = "threshold") or one with null experts also "active_at_cap".

        The experts a token reaches: the rule's ``expected_experts`` per MoE layer. A
        top-k router computes top_k experts. A truncating router computes a
        token-dependent number: "active" counts its nominal k per layer
        (router.lapsum_k, else router.top_k: the mean that a calibrated cut aims at;
        under learned allocation the layers' k sum to k_total), rounded to a whole
        parameter count, and "active_at_cap" the most a token can reach, its ``slots``:
        min(E, ceil(k * token_cap_factor)) experts per layer (every expert without
        router.token_cap_factor; under learned allocation, at the initial k = K / L).
        The mean measured at inference is ``active_params`` of ``moelab stats``.

        Shared experts (n_shared_experts = N): N experts of width expert_d_ff per MoE
        layer that every token uses, so they count in "total" and "active" alike, with
        the shared gate's vector (D weights per MoE layer) under shared_gate. Null
        experts (router.n_null_experts = M): the router scores E + M experts ("router"
        counts its E + M rows), and a token reaches 0..top_k real experts; "active"
        counts top_k * E / (E + M) per layer, the mean under balanced load over the
        E + M experts (what the balance loss aims at), "active_at_cap" top_k, the most
        a token can reach (with router.null_target, "active" counts that target instead).
        Zero and identity null experts have no parameters; constant ones (MoE++) have
        3 D each per MoE layer (v_m and the (2, D) W_m), counted in "total" and
        "active" (every token computes W_m x), not in "router".

    With ``router_layers`` each MoE layer counts with its own RouterConfig (its K, its
    null experts), and the sums run over the layers.

    Tests check these formulas against ``sum(p.numel())`` of built models.
    """
    c = config
    d, hd = c.d_model, c.head_dim
    attn = d * c.n_heads * hd * 2 + d * c.n_kv_heads * hd * 2  # q, o; k, v
    norms = 2 * d  # attention and feed-forward RMSNorm weights
    dense_ff = 3 * d * c.d_ff  # SwiGLU gate, up, down
    assert c.expert_d_ff is not None
    expert = 3 * d * c.expert_d_ff
    n_moe = len(c.moe_indices)
    n_dense = c.n_layers - n_moe
    embed = 2 * c.vocab_size * d + d  # input, output, final RMSNorm
    rcs = c.router_configs()  # one per MoE layer (the same config when uniform)
    # router weights (E + M rows per layer) and scorer biases (E + M, scorer_bias), plus
    # the allocator's eta (one per MoE layer) under learned allocation
    router = sum(rc.n_scored * (d + rc.scorer_bias) for rc in rcs)
    router += n_moe if c.k_total is not None else 0
    # shared experts: used by every token, with the gate's (D,) vector
    shared_ff = c.n_shared_experts * expert + (d if c.shared_gate else 0)
    shared = embed + c.n_layers * (attn + norms) + n_dense * dense_ff + router
    shared += n_moe * shared_ff + sum(null_expert_params(rc) for rc in rcs)
    counts = {"total": shared + n_moe * c.n_experts * expert, "router": router}
    if not rcs:
        counts["active"] = shared
        return {key: counts[key] for key in ("total", "active", "router")}
    counts["active"] = shared + round(sum(rc.expected_experts for rc in rcs) * expert)
    if not any(rc.selection_rule.truncates or rc.n_null_experts for rc in rcs):
        return {key: counts[key] for key in ("total", "active", "router")}
    counts["active_at_cap"] = shared + sum(rc.slots for rc in rcs) * expert
    return {key: counts[key] for key in ("total", "active", "router", "active_at_cap")}
