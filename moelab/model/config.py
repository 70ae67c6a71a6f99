"""Configuration of the model: one small dataclass, checked on construction with messages
that say what to change, and the analytic parameter count of the model it describes."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    """Overrides of RouterConfig (map, top_k, alpha, ...); d_model and n_experts come from
    the model."""
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
        if not self.k_lr_scale > 0:
            raise ValueError(f"k_lr_scale must be > 0, got {self.k_lr_scale}")
        if self.k_lr_scale != 1.0 and self.k_total is None:
            raise ValueError("k_lr_scale scales the learned allocation's lr; it needs k_total")
        if self.k_total is not None:
            self._check_allocation()
        if self.moe_indices:
            # fail now, not when the model is built, on a bad router or MoE override
            self.moe_config()

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

    def router_config(self) -> RouterConfig:
        """The RouterConfig of each MoE layer (every layer gets its own router); d_model,
        n_experts and vocab_size (the token ids a hash rule routes by) are the model's."""
        return RouterConfig(
            d_model=self.d_model,
            n_experts=self.n_experts,
            vocab_size=self.vocab_size,
            **self.router,
        )

    def moe_config(self) -> MoEConfig:
        """The MoEConfig of each MoE layer: its router, experts of width expert_d_ff and
        the shared experts."""
        assert self.expert_d_ff is not None
        return MoEConfig(
            self.d_model,
            self.expert_d_ff,
            self.router_config(),
            n_shared_experts=self.n_shared_experts,
            shared_gate=self.shared_gate,
            gate_on=self.gate_on,
        )


def null_expert_params(rc: RouterConfig) -> int:
    """Parameters of one MoE layer's null experts: 3 D per constant expert (v_m and W_m,
    :class:`moelab.moe.null.ConstantExperts`), none for zero and identity ones."""
    return 3 * rc.d_model * rc.n_null_experts if rc.null_expert == "constant" else 0


def param_counts(config: ModelConfig) -> dict[str, int]:
    """Parameter counts of the model `config` describes, computed without building it.

    Returns:
        {"total": every parameter, "active": the parameters one token uses (embeddings,
        attention, norms, dense feed-forwards and routers, plus the experts it reaches
        in each MoE layer, and its shared experts), "router": the router weights}, and
        for a truncating router (its selection rule ``truncates``, e.g.
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
    rc = c.router_config() if n_moe else None
    n_scored = c.n_experts if rc is None else rc.n_scored  # E (+ M null experts)
    # router weights, plus the allocator's eta (one per MoE layer) under learned allocation
    router = n_moe * n_scored * d + (n_moe if c.k_total is not None else 0)
    # shared experts: used by every token, with the gate's (D,) vector
    shared_ff = c.n_shared_experts * expert + (d if c.shared_gate else 0)
    shared_ff += null_expert_params(rc) if rc is not None else 0
    shared = embed + c.n_layers * (attn + norms) + n_dense * dense_ff + router
    shared += n_moe * shared_ff
    counts = {"total": shared + n_moe * c.n_experts * expert, "router": router}
    if rc is None:
        counts["active"] = shared
        return {key: counts[key] for key in ("total", "active", "router")}
    counts["active"] = shared + round(n_moe * rc.expected_experts * expert)
    if not (rc.selection_rule.truncates or rc.n_null_experts):
        return {key: counts[key] for key in ("total", "active", "router")}
    counts["active_at_cap"] = shared + n_moe * rc.slots * expert
    return {key: counts[key] for key in ("total", "active", "router", "active_at_cap")}
