"""A moelab :class:`~moelab.routing.router.Router` inside OLMo-core's MoE blocks.

:class:`MoelabRouter` is a subclass of OLMo-core's ``MoERouter`` that runs a moelab
Router and keeps the engine's router contract: ``forward(x, loss_div_factor=...)``
returns ``(expert_weights, expert_indices, batch_size_per_expert, aux_loss)`` of shapes
``(B, S, K)``, ``(B, S, K)``, ``(E,)`` and a scalar or None, so that OLMo-core's
``MoE`` / ``DroplessMoE`` block dispatches, attaches the aux loss
(``olmo_core.ops.attach_auxiliary_loss``) and reports metrics as with its own router.

OLMo-core's router settings and the moelab Router keys that reproduce them
(:func:`equivalent_keys`; keys given to :func:`swap_routers` override them):

==============================  ================================================================
OLMo-core                       moelab
==============================  ================================================================
``gating_function``             ``map`` = "softmax" / "sigmoid" (OLMo-core's sigmoid adds 1e-7 to
                                every score: the engine gate below adds it to the weights)
``top_k``                       ``top_k``; the block dispatches K slots per token, so a moelab
                                rule with more slots is refused, one with fewer is padded
``normalize_expert_weights=p``  ``renorm=True`` (K = 1: ``straight_through``); while the map is
                                the engine's and no gate key is given, the Router's gate is
                                :class:`EngineGate`, w = s / ||s||_p exactly as OLMo-core
choice by the scores            ``rank_by="probs"``: top-K by the map's values (+ bias)
``bias_gamma``, ``score_bias``  the Router's selection ``bias`` = ``score_bias``; OLMo-core's
                                ``post_batch`` moves it (DeepSeek-V3's sign update, reduced
                                over the router's process group) and copies it to the Router
``lb_loss_weight``              ``aux_weight`` (the block's weight, already divided by the
                                layers); sigmoid: ``aux_probs="normalized"`` as OLMo-core
``lb_loss_granularity``         ``aux_scope`` = "micro_batch" (local_batch), "sequence" (instance)
``z_loss_weight``               ``z_loss_weight``
``jitter_eps``                  kept: OLMo-core's own input jitter runs before the Router
                                (with ``router.jitter`` as well: refused, one jitter only)
``uniform_expert_assignment``   kept: :class:`UniformAssignment`, ids = arange % E
``random_expert_assignment``    refused (a benchmarking mode that routes by random scores)
==============================  ================================================================

Auxiliary losses: the Router's ``aux_loss`` (Switch, z-loss, ReLU's L1, LapSum's
budget ... as the keys set them) is the fourth output, which OLMo-core's block attaches
to the routed activations, so its gradient reaches the router in the backward of the
training loss; with a ``loss_div_factor`` (OLMo-core's token count for micro-batches)
it is scaled by T / loss_div_factor, as the engine's losses are. ``compute_metrics``
reports each moelab loss ("moelab <name>", unweighted, summed over the calls since the
last reset as the engine sums its own) beside the engine's "load imbalance".

Variable-k rules (``selection="threshold"`` with a cap, ``"top_p"``, capacity drops, null
experts): a slot that is not computed keeps a valid expert index (its own, or 0 for a
null expert) and weight 0. Refused: expert choice (a token's experts depend on the
batch), hash routing (OLMo-core's block does not pass token ids to its router),
identity / constant null experts (the block's experts cannot add them).

Shape suffixes: T, D, E, K, J (moelab.shapes). OLMo-core's own B, S names stand where its
tensors are held.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from olmo_core.nn.moe.loss import MoELoadBalancingLossGranularity
from olmo_core.nn.moe.router import MoERouter, MoERouterConfig, MoERouterGatingFunction
from torch import nn

from moelab.integrations import router_keys as router_keys_rules
from moelab.routing import gates, scorer
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput
from moelab.routing.router import Router
from moelab.routing.selection import Budget, Selected
from moelab.routing.selection.topk import TopK

if TYPE_CHECKING:
    from olmo_core.train.common import ReduceType

__all__ = [
    "EngineGate",
    "MoelabRouter",
    "MoelabRouterConfig",
    "UniformAssignment",
    "engine_weight",
    "equivalent_keys",
    "moelab_router",
    "moelab_router_config",
    "moelab_routers",
    "swap_routers",
    "use_moelab_routers",
]

SIGMOID_OFFSET = 1e-7
"""What OLMo-core adds to every sigmoid score (``F.sigmoid(logits) + 1e-7``)."""

ENGINE = "OLMo-core"
"""The engine's name in the bridge's messages."""

_SCOPES = {
    MoELoadBalancingLossGranularity.local_batch: "micro_batch",
    MoELoadBalancingLossGranularity.instance: "sequence",
}


class EngineGate(gates.Gate):
    """OLMo-core's gate on the selected slots: ``w = s + offset``, then divided by its
    ``norm``-norm over the K slots when ``norm`` is set (``normalize_expert_weights``),
    times ``scaling``. ``offset`` is 1e-7 for OLMo-core's sigmoid, whose scores are
    ``sigmoid + 1e-7``. Not registered: the Router's config names the closest moelab
    gate (renorm or the map's values), which answers every question on the gate."""

    name = "olmo_core"

    def __init__(self, offset: float, norm: float | None, scaling: float = 1.0) -> None:
        super().__init__(scaling)
        self.offset = float(offset)
        self.norm = norm

    def __call__(self, probs_TK: torch.Tensor, selected_TK: torch.Tensor) -> torch.Tensor:
        w_TK = torch.where(selected_TK, probs_TK + self.offset, 0)
        if self.norm is not None:
            w_TK = w_TK.div(torch.norm(w_TK, p=self.norm, dim=-1, keepdim=True))
        return w_TK if self.scaling == 1.0 else w_TK * self.scaling


class UniformAssignment(TopK):
    """OLMo-core's ``uniform_expert_assignment`` (a benchmarking mode): slot j of the
    flattened (T, K) slots takes expert j mod E, whatever the scores. Not registered."""

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        n_tokens, n_experts = rank_TE.shape
        flat_J = torch.arange(n_tokens * budget.top_k, device=rank_TE.device)
        ids_TK = torch.remainder(flat_J, n_experts).view(n_tokens, budget.top_k)
        return Selected(ids_TK, torch.ones_like(ids_TK, dtype=torch.bool))


# ------------------------------------------------------------------ engine settings


def _engine_map(engine: MoERouter) -> str:
    gating = MoERouterGatingFunction(engine.gating_function)
    if gating == MoERouterGatingFunction.softmax:
        return "softmax"
    if gating == MoERouterGatingFunction.sigmoid:
        return "sigmoid"
    raise ValueError(
        f"gating_function={gating.value!r} is not implemented by OLMo-core's own router "
        "forward either: use 'softmax' or 'sigmoid'"
    )


def equivalent_keys(engine: MoERouter) -> dict[str, Any]:
    """The RouterConfig keys that reproduce the routing of OLMo-core's router ``engine``
    (the module docstring's table); ValueError for a setting moelab cannot hold."""
    if engine.random_expert_assignment:
        raise ValueError(
            "random_expert_assignment routes by random scores (a benchmarking mode); a "
            "moelab router routes by its map: set random_expert_assignment=False"
        )
    top_k = int(engine.top_k)
    keys: dict[str, Any] = {
        "d_model": int(engine.d_model),
        "n_experts": int(engine.num_experts),
        "top_k": top_k,
        "map": _engine_map(engine),
        "rank_by": "probs",
        "aux_weight": float(engine.lb_loss_weight or 0.0),
        "aux_scope": _SCOPES[MoELoadBalancingLossGranularity(engine.lb_loss_granularity)],
        "z_loss_weight": float(engine.z_loss_weight or 0.0),
    }
    if keys["map"] == "sigmoid":
        keys["aux_probs"] = "normalized"
    if engine.normalize_expert_weights is not None:
        if top_k == 1:  # w / |w| = 1: moelab refuses renorm with K = 1 (no gradient)
            keys["straight_through"] = True
        else:
            keys["renorm"] = True
    return keys


def _check_keys(given: dict[str, Any]) -> None:
    router_keys_rules.check_keys(given, ENGINE)


def _refuse(router: Router, engine_k: int) -> None:
    router_keys_rules.refuse_undispatchable(
        router.config, ENGINE, top_k=engine_k, raise_top_k="build the block with a larger top_k"
    )


# ------------------------------------------------------------------ the router


class MoelabRouter(MoERouter):
    """OLMo-core's ``MoERouter`` whose routing is the moelab ``router``'s (module
    docstring). ``top_k`` is the engine block's K (the dispatch width); ``jitter_eps``,
    ``bias_gamma`` and ``uniform_expert_assignment`` keep their OLMo-core meaning; the
    balance losses are the moelab Router's own (its config)."""

    def __init__(
        self,
        router: Router,
        *,
        top_k: int,
        jitter_eps: float | None = None,
        bias_gamma: float | None = None,
        uniform_expert_assignment: bool = False,
        init_device: str = "cpu",
    ) -> None:
        config = router.config
        super().__init__(
            d_model=config.d_model,
            num_experts=config.n_experts,
            top_k=top_k,
            jitter_eps=jitter_eps,
            bias_gamma=bias_gamma,
            uniform_expert_assignment=uniform_expert_assignment,
            init_device=init_device,
        )
        _refuse(router, top_k)
        if jitter_eps and config.jitter > 0:
            raise ValueError(
                f"the router input would be jittered twice: give OLMo-core's jitter_eps "
                f"({jitter_eps:g}) or router.jitter ({config.jitter:g}), not both"
            )
        self.router = router
        if uniform_expert_assignment:
            if type(router.selection) is not TopK:
                raise ValueError(
                    "uniform_expert_assignment is a benchmarking mode of top-K routing: turn "
                    f"it off to use selection={config.selection!r}"
                )
            router.selection = UniformAssignment(router.selection.config)
        self.last: RouterOutput | None = None
        """The moelab Router's output of the latest forward."""
        self._sums: dict[str, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        device = self.router.weight.device
        return device if device.type != "meta" else torch.device("cpu")

    @property
    def weight(self) -> nn.Parameter:
        """The Router's (E, D) weight (E + M rows with null experts), which OLMo-core's
        ``init_weights`` initialises as it does its own router's (flat) weight."""
        return self.router.weight

    def reset_parameters(self) -> None:
        """What ``init_weights`` of a model built on the meta device calls after
        ``to_empty``: OLMo-core's reset of the router's counters and of its weight
        (``MoELinearRouter``'s truncated normal, std 0.02, drawn from the global RNG as
        OLMo-core draws it, so the modules initialised after it draw the same numbers),
        and the moelab Router's other parameters and buffers (selection bias,
        temperature, L1 coefficient) as a new Router of its config holds them."""
        super().reset_parameters()
        router = self.router
        if router.weight.device.type == "meta":
            return
        with torch.random.fork_rng(devices=[]):  # the global RNG stays OLMo-core's
            fresh = Router(router.config).to(device=router.weight.device)
        mine = dict(router.named_parameters()) | dict(router.named_buffers())
        with torch.no_grad():
            for name, value in [*fresh.named_parameters(), *fresh.named_buffers()]:
                if name != "weight":
                    mine[name].copy_(value)
            if self.score_bias is not None:
                router.bias[: self.num_experts].copy_(torch.as_tensor(self.score_bias))
        nn.init.trunc_normal_(router.weight, std=0.02, a=-3 * 0.02, b=3 * 0.02)

    def get_expert_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The Router's scores ``x W^T`` of every expert (and null expert), ``(*, E)``."""
        x_TD = x.reshape(-1, x.shape[-1])
        scores_TE = scorer.scores(x_TD, self.router.weight, self.router.scorer_bias)
        return scores_TE.view(*x.shape[:-1], -1)

    def forward(
        self, x: torch.Tensor, *, loss_div_factor: torch.Tensor | float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """OLMo-core's contract on ``x`` of shape ``(B, S, D)`` (or ``(T, D)``):
        ``(expert_weights, expert_indices, batch_size_per_expert, aux_loss)``."""
        x = self.jitter(x)
        lead = x.shape[:-1]
        x_TD = x.reshape(-1, x.shape[-1])
        seq_len = x.shape[-2] if x.dim() == 3 else None
        out = self.router(x_TD, seq_len=seq_len)
        self.last = out
        n_experts, top_k = self.num_experts, self.top_k
        weights_TK = torch.where(out.computed_TK, out.weights_TK, 0)
        ids_TK = torch.where(out.ids_TK < n_experts, out.ids_TK, 0)
        if ids_TK.shape[1] < top_k:  # fewer slots than the dispatch: expert 0, weight 0
            pad = top_k - ids_TK.shape[1]
            ids_TK = torch.nn.functional.pad(ids_TK, (0, pad))
            weights_TK = torch.nn.functional.pad(weights_TK, (0, pad))
        with torch.no_grad():
            counts_E = torch.bincount(ids_TK.flatten(), minlength=n_experts).float()
        aux: torch.Tensor | None = None
        if self.training and torch.is_grad_enabled():
            if self.router.aux_losses:
                # the engine's losses are sums over the tokens / loss_div_factor (the
                # tokens of the whole batch under micro-batching); moelab's are means
                scale = 1.0 if loss_div_factor is None else x_TD.shape[0] / loss_div_factor
                aux = out.aux_loss * scale
                for name, value in out.losses.items():
                    value = value.detach() * scale
                    self._sums[name] = self._sums.get(name, torch.zeros_like(value)) + value
            self.batch_size_per_expert += counts_E
            if self.bias_gamma is not None:
                assert self.score_bias_batch_size_per_expert is not None
                self.score_bias_batch_size_per_expert += counts_E
        weights = weights_TK.reshape(*lead, top_k)
        return weights, ids_TK.reshape(*lead, top_k), counts_E, aux

    def apply_tp(self, tp_mesh: Any, float8_enabled: bool = False) -> None:
        """Refused: OLMo-core's tensor parallelism replicates its router weight as a
        DTensor over the TP mesh, which the moelab Router's weight is not."""
        raise NotImplementedError(
            "MoelabRouter does not support OLMo-core's tensor parallelism (apply_tp); "
            "train with FSDP / expert parallelism, or keep OLMo-core's own router"
        )

    @torch.no_grad()
    def post_batch(self, dry_run: bool = False) -> None:
        """OLMo-core's hook after the final backward of a batch: its loss-free bias
        update (``bias_gamma``) copied into the Router's selection bias, then
        ``Router.step`` with the latest routing (temperature schedule, moelab's own
        ``bias_rate``, ReLU routing's adaptive L1)."""
        super().post_batch(dry_run=dry_run)
        if dry_run or not self.training:
            return
        if self.bias_gamma is not None and self.score_bias is not None:
            score_bias = torch.as_tensor(self.score_bias)
            self.router.bias[: self.num_experts].copy_(score_bias)
        self.router.step(self.last)

    @torch.no_grad()
    def compute_metrics(
        self, reset: bool = True
    ) -> dict[str, tuple[torch.Tensor, ReduceType | None]]:
        """OLMo-core's "load imbalance" and each moelab loss ("moelab <name>",
        unweighted), summed over the training calls since the last reset as OLMo-core
        sums its own ("load balancing loss unscaled")."""
        from olmo_core.train.common import ReduceType

        out = super().compute_metrics(reset=False)
        for name, total in self._sums.items():
            out[f"moelab {name}"] = (total.clone(), ReduceType.mean)
        if reset:
            self.reset_metrics()
        return out

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._sums = {}

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"


def moelab_router(engine: MoERouter, weight_ED: torch.Tensor, **router_keys: Any) -> MoelabRouter:
    """A :class:`MoelabRouter` in place of OLMo-core's router ``engine`` whose weight is
    ``weight_ED`` (E, D): the keys of :func:`equivalent_keys` overridden by
    ``router_keys``, the weight copied in float32, the engine's ``score_bias`` as the
    selection bias, the engine's gate kept while the map is the engine's and no gate key
    is given."""
    _check_keys(router_keys)
    own = equivalent_keys(engine)
    # NOTE: the engine has no expert groups: the choice stays by map value (+ bias)
    keys = router_keys_rules.merge_keys(own, router_keys, rank_by_without_groups="probs")
    engine_k = int(engine.top_k)
    config = RouterConfig(**keys)
    # the Router's own initial weight is replaced; drawing it leaves the global RNG as
    # it was, so that OLMo-core's init of the modules built after it draws the same
    with torch.random.fork_rng(devices=[]):
        router = Router(config).to(device=weight_ED.device)
    norm = engine.normalize_expert_weights
    if keys["map"] == own["map"] and not any(k in router_keys for k in router_keys_rules.GATE_KEYS):
        offset = SIGMOID_OFFSET if own["map"] == "sigmoid" else 0.0
        router.gate = EngineGate(offset, norm, config.routed_scaling)
    elif norm is not None and norm != 1.0:
        raise ValueError(
            f"normalize_expert_weights={norm} (an L{norm} norm of the weights) is kept only "
            f"with the engine's map {own['map']!r}: with map={keys['map']!r} give "
            "renorm=True or renorm=False"
        )
    with torch.no_grad():
        router.weight[: config.n_experts].copy_(weight_ED.detach().float())
        if engine.score_bias is not None:
            router.bias[: config.n_experts].copy_(torch.as_tensor(engine.score_bias).float())
    new = MoelabRouter(
        router,
        top_k=engine_k,
        jitter_eps=engine.jitter_eps,
        bias_gamma=engine.bias_gamma,
        uniform_expert_assignment=engine.uniform_expert_assignment,
        init_device=str(weight_ED.device),
    )
    if new.score_bias is not None and engine.score_bias is not None:
        with torch.no_grad():
            torch.as_tensor(new.score_bias).copy_(torch.as_tensor(engine.score_bias))
    new.group, new.cp_mesh, new.tp_mesh = engine.group, engine.cp_mesh, engine.tp_mesh
    new.train(engine.training)
    return new


def engine_weight(engine: MoERouter) -> torch.Tensor:
    """The (E, D) view of the weight of OLMo-core's linear router ``engine`` (stored flat,
    (E * D,), for FSDP); TypeError for a router without one."""
    weight = getattr(engine, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{type(engine).__name__} has no weight; swap_routers reads OLMo-core's linear "
            "router (MoELinearRouter)"
        )
    return weight.detach().view(engine.num_experts, engine.d_model)


def swap_routers(model: nn.Module, **router_keys: Any) -> list[str]:
    """Replace every OLMo-core ``MoERouter`` of ``model`` (a built OLMo-core Transformer,
    an MoE block or a router) with a :class:`MoelabRouter`, in place; returns the
    replaced modules' names in module order ("" for ``model`` itself, which is then not
    replaced: use :func:`moelab_router`).

    ``router_keys`` are RouterConfig keys (``map``, ``alpha``, ``selection``,
    ``aux_weight``, ...); those not given reproduce the engine's routing
    (:func:`equivalent_keys`), so that ``swap_routers(model)`` leaves the outputs as
    they were.

    Raises:
        TypeError: ``model`` is not a torch module.
        ValueError: no OLMo-core router in ``model``, routers swapped already, an unknown
            key, or a rule the engine cannot dispatch (module docstring).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_routers takes a torch module, got {type(model).__name__}")
    _check_keys(router_keys)
    sites = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, MoERouter) and not isinstance(m, MoelabRouter)
    ]
    if not sites:
        if moelab_routers(model):
            raise ValueError("this model's routers are swapped already; swap a fresh copy")
        raise ValueError(
            f"{type(model).__name__} has no OLMo-core MoERouter: pass a model built with "
            "an MoE block (e.g. TransformerConfig.smallmoe)"
        )
    if sites[0][0] == "":
        raise ValueError(
            "swap_routers replaces routers inside a model or MoE block; for a lone router "
            "use moelab_router(router, weight)"
        )
    # every router is built before any is put in place, so a refused key changes nothing
    new = [moelab_router(m, engine_weight(m), **router_keys) for _, m in sites]
    for (name, _), router in zip(sites, new, strict=True):
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, router)
    return [name for name, _ in sites]


def moelab_routers(model: nn.Module) -> list[MoelabRouter]:
    """The :class:`MoelabRouter` modules of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoelabRouter)]


# ------------------------------------------------------------------ config level


@dataclass
class MoelabRouterConfig(MoERouterConfig):
    """OLMo-core's ``MoERouterConfig`` that builds a :class:`MoelabRouter`: the engine's
    own fields set the dispatch (``top_k``) and the defaults the moelab keys start from
    (as for :func:`swap_routers`), ``moelab`` holds the RouterConfig keys that change
    them (``{"map": "entmax", "alpha": 1.5}``). The router's weight is initialised as
    OLMo-core initialises its linear router. In a saved OLMo-core config it is named by
    its class (``_CLASS_``), and its keys take dotted overrides
    (``...router.moelab.map=sparsemax``)."""

    moelab: dict[str, Any] = field(default_factory=dict)
    """moelab RouterConfig keys (``d_model`` and ``n_experts`` come from the block)."""

    def num_params(self, d_model: int, num_experts: int) -> int:
        keys = dict(self.moelab)
        n_scored = num_experts + int(keys.get("n_null_experts", 0))
        return d_model * n_scored + (n_scored if keys.get("scorer_bias") else 0)

    def build(  # type: ignore[override]
        self,
        d_model: int,
        num_experts: int,
        *,
        lb_loss_weight: float | None = None,
        lb_loss_granularity: MoELoadBalancingLossGranularity = (
            MoELoadBalancingLossGranularity.local_batch
        ),
        z_loss_weight: float | None = None,
        dtype: torch.dtype | None = None,
        init_device: str = "cpu",
    ) -> MoelabRouter:
        engine_config = MoERouterConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(MoERouterConfig)}
        )
        engine = engine_config.build(
            d_model,
            num_experts,
            lb_loss_weight=lb_loss_weight,
            lb_loss_granularity=lb_loss_granularity,
            z_loss_weight=z_loss_weight,
            dtype=dtype,
            init_device=init_device,
        )
        return moelab_router(engine, engine_weight(engine), **dict(self.moelab))


def moelab_router_config(config: MoERouterConfig, **router_keys: Any) -> MoelabRouterConfig:
    """``config`` (OLMo-core's router config) as a :class:`MoelabRouterConfig` with the
    moelab ``router_keys``."""
    _check_keys(router_keys)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(MoERouterConfig)}
    return MoelabRouterConfig(**values, moelab=dict(router_keys))


def use_moelab_routers(config: Any, **router_keys: Any) -> int:
    """Replace, in place, every ``MoERouterConfig`` inside ``config`` (an OLMo-core
    ``TransformerConfig``, ``MoEConfig`` or any config dataclass holding them, block
    overrides included) with a :class:`MoelabRouterConfig` with ``router_keys``;
    returns how many were replaced (ValueError when none)."""
    _check_keys(router_keys)
    seen: set[int] = set()

    def walk(obj: Any) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        n = 0
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if isinstance(value, MoERouterConfig):
                    setattr(obj, f.name, moelab_router_config(value, **router_keys))
                    n += 1
                else:
                    n += walk(value)
        elif isinstance(obj, dict):
            for value in obj.values():
                n += walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                n += walk(value)
        return n

    replaced = walk(config)
    if not replaced:
        raise ValueError(
            f"{type(config).__name__} holds no MoERouterConfig: give a config with an MoE "
            "block (feed_forward_moe)"
        )
    return replaced
