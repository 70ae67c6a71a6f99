"""A moelab :class:`~moelab.routing.router.Router` in place of torchtitan's
``TokenChoiceTopKRouter``: the module (:class:`MoelabRouter`), the keys that reproduce the
engine's routing (:func:`engine_keys`) and the swap on a built model
(:func:`swap_routers`).

torchtitan's ``MoE.forward`` calls ``router(x_BLD, expert_bias_E)`` and reads back
``(topk_scores_BLK, topk_expert_ids_BLK, scores_BLE)``: the gate weights of the K slots,
their expert ids and a (B, L, E) tensor whose shape (and only its shape) builds the
routing map. :class:`MoelabRouter` returns that triple from the moelab Router's decision:

- ``topk_scores_BLK``: the Router's gate weights, 0 on every slot whose expert is not
  computed (a truncating rule's unused slot, a capacity drop, a null expert, a slot the
  router does not fill when its K is below the engine's);
- ``topk_expert_ids_BLK``: a real expert on every slot, distinct within a token (the
  engine's dispatcher counts each (token, expert) pair once: a slot without an expert
  takes the best-scored expert the token does not use yet, at weight 0). Such a slot is
  computed by the engine's experts (times 0) and counted in its ``tokens_per_expert_E``;
- ``scores_BLE``: the map's values over the E real experts (``probs_TE``; softmax /
  sigmoid with no keys, as the engine's own router returns them).

Engine settings and the RouterConfig keys that reproduce them (:func:`engine_keys`;
keys given to :func:`swap_routers` or the converter override them):

====================================  =================================================
TokenChoiceTopKRouter                 moelab Router keys
====================================  =================================================
``score_func``                        ``map`` ("softmax" / "sigmoid")
``top_k``                             ``top_k`` (and the width of the ids the engine's
                                      dispatcher expects, which no key changes)
``route_norm``                        ``renorm=True`` (with K = 1 ``straight_through``:
                                      weight 1 forward, as the engine's p / p)
``route_scale``                       ``routed_scaling``
``num_expert_groups`` /               ``n_groups`` / ``topk_groups`` (a group scored by
``num_limited_groups``                the sum of its two best map values + bias)
the choice by map value + bias        ``rank_by="probs"`` (without groups)
``MoE.expert_bias_E``                 the Router's selection ``bias`` (copied in at
                                      every forward; the engine's optimizer hook keeps
                                      updating it from ``tokens_per_expert_E``)
``gate.bias``                         ``scorer_bias=True`` (the gate's own bias)
no auxiliary loss                     ``aux_weight=0.0``
====================================  =================================================

The engine's ``route_norm`` divides by ``sum + 1e-20``, moelab's renorm by the sum: the
two differ by a relative 1e-20 / sum, below float64's resolution for any sum above
1e-4 (a sum of K map values of the chosen experts).

Refused, in one line each: expert choice and hash routing (the engine routes each
token on its own and passes no token ids), identity / constant null experts (the
engine's experts cannot add x or a vector), a router with more slots than the engine's
``top_k``, moelab's ``bias_rate`` while the engine's MoE has ``load_balance_coeff``
(the engine moves the bias), the engine's ``_debug_force_load_balance``.

The module keeps the engine's gate (``router.gate``, a torchtitan ``Linear`` with its
``param_init``): the Router scores with its weight, so checkpoints keep the engine's
key ``moe.router.gate.weight``. The Router and its stages are torchtitan ``Module``s
(``verify_module_protocol`` passes) and ``init_states`` re-initialises them after a
meta-device build (the gate by its ``param_init``, the Router's buffers as a fresh
Router has them).

Shape suffixes: B, L, T, D, E, K (moelab.shapes). torchtitan's own BLD / BLK names stand
where the engine's tensors are held.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter
from torchtitan.protocols.module import Module

from moelab import maps
from moelab.integrations import router_keys as router_keys_rules
from moelab.routing.allocation import LayerAllocator
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput
from moelab.routing.router import Router

__all__ = [
    "EXTRA_KEYS",
    "FIXED_KEYS",
    "MoelabRouter",
    "TitanAllocator",
    "TitanRouter",
    "check_keys",
    "dispatchable",
    "engine_keys",
    "merge_keys",
    "moelab_routers",
    "swap_routers",
]

FIXED_KEYS = ("d_model", "n_experts", "scorer_bias")
"""RouterConfig keys that come from the engine's router (its gate), never from the user."""

EXTRA_KEYS = ("k_total",)
"""Keys of :func:`swap_routers` beyond RouterConfig's: ``k_total``, learned allocation of
a LapSum budget across the swapped layers (:class:`TitanAllocator`)."""

ENGINE = "torchtitan"
"""The engine's name in the bridge's messages."""


def check_keys(router_keys: dict[str, Any]) -> None:
    """ValueError, in one line, for a key that is not a RouterConfig key (or an old name
    of one, or :data:`EXTRA_KEYS`), or one of :data:`FIXED_KEYS`
    (:func:`moelab.integrations.router_keys.check_keys`)."""
    router_keys_rules.check_keys(router_keys, ENGINE, fixed=FIXED_KEYS, extra=EXTRA_KEYS)


def engine_keys(config: TokenChoiceTopKRouter.Config) -> dict[str, Any]:
    """The RouterConfig keys that reproduce the routing of a torchtitan router built from
    ``config`` (the module docstring's table)."""
    gate = config.gate
    top_k = int(config.top_k)
    keys: dict[str, Any] = {
        "d_model": int(gate.in_features),
        "n_experts": int(config.num_experts),
        "top_k": top_k,
        "map": str(config.score_func),
        "routed_scaling": float(config.route_scale),
        "aux_weight": 0.0,
    }
    if config.route_norm and top_k == 1:
        keys["straight_through"] = True
    else:
        keys["renorm"] = bool(config.route_norm)
    groups = config.num_expert_groups
    if groups is not None and groups > 1:
        if config.num_limited_groups is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        keys["n_groups"] = int(groups)
        keys["topk_groups"] = int(config.num_limited_groups)
    else:
        keys["rank_by"] = "probs"
    if gate.bias:
        keys["scorer_bias"] = True
    return keys


def merge_keys(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The engine's keys overridden by the user's: a gate key given replaces the engine's
    gate keys; a selection rule that cannot follow group-limited choice drops the groups
    (then the choice is by map value + bias, the engine's own without groups, unless
    ``rank_by`` is given; :func:`moelab.integrations.router_keys.merge_keys`)."""
    return router_keys_rules.merge_keys(defaults, given, rank_by_without_groups="probs")


def _refuse(config: RouterConfig, engine_top_k: int, load_balance: bool) -> None:
    """ValueError, in one line, for what the engine's dispatch cannot hold."""
    router_keys_rules.refuse_undispatchable(
        config,
        ENGINE,
        top_k=engine_top_k,
        raise_top_k="raise the engine's top_k (router.top_k and "
        "routed_experts.token_dispatcher.top_k; MoelabRouterConverter sets both)",
    )
    if config.balancing_config.moves_bias and load_balance:
        raise ValueError(
            "the engine's MoE updates its expert_bias_E (load_balance_coeff is set), which "
            "the router uses as its selection bias: drop bias_rate (and bias_update="
            "'quantile'), or set the MoE's load_balance_coeff=None to let moelab's "
            "balancing move it"
        )


# ------------------------------------------------------------------ Module protocol


@functools.cache
def _module_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with torchtitan's ``Module`` mixed in (the protocol the trainer checks),
    made once per class and kept in this module's namespace so that pickling finds it."""
    name = f"{cls.__name__}AsModule"
    made = type(name, (cls, Module), {"__module__": __name__, "__qualname__": name})
    globals()[name] = made
    return made


def _as_module(module: nn.Module) -> None:
    """Make every submodule of ``module`` a torchtitan ``Module`` in place (class swap)."""
    for sub in module.modules():
        if not isinstance(sub, Module):
            sub.__class__ = _module_class(type(sub))


class TitanRouter(Router, Module):
    """A moelab Router whose scorer weight (and bias) is the engine's gate: ``weight``
    reads ``owner.gate.weight`` (with the rows of the null experts, a parameter of its
    own, appended), so the engine's parameter, its FQN, its init and its sharding stay
    as they were. Made from a Router by :func:`_adopt`."""

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        gate = self._owner[0].gate
        null = self._parameters.get("null_weight")
        w = gate.weight
        return w if null is None else torch.cat([w, null.to(w.dtype)])

    @property  # type: ignore[override]
    def scorer_bias(self) -> torch.Tensor | None:
        b = self._owner[0].gate.bias
        if b is None:
            return None
        null = self._parameters.get("null_bias")
        return b if null is None else torch.cat([b, null.to(b.dtype)])


def _adopt(router: Router, owner: MoelabRouter) -> TitanRouter:
    """``router`` as a :class:`TitanRouter` scoring with ``owner.gate``: its own weight
    and bias are dropped but for the null experts' rows (``null_weight``,
    ``null_bias``), initialised as moelab does (N(0, init_std^2), zeros)."""
    cfg = router.config
    weight = router._parameters.pop("weight")
    bias = router._parameters.pop("scorer_bias", None)
    router.__class__ = TitanRouter
    _as_module(router)
    n_null = cfg.n_null_experts
    null_w = nn.Parameter(weight.detach()[cfg.n_experts :].clone()) if n_null else None
    null_b = None
    if n_null and bias is not None:
        null_b = nn.Parameter(bias.detach()[cfg.n_experts :].clone())
    router.register_parameter("null_weight", null_w)
    router.register_parameter("null_bias", null_b)
    init = {
        "null_weight": functools.partial(nn.init.normal_, std=cfg.init_std),
        "null_bias": nn.init.zeros_,
    }
    router._param_init = init
    # NOTE: a tuple is not registered as a submodule: the owner is reached, not owned
    router.__dict__["_owner"] = (owner,)
    return router  # type: ignore[return-value]


class TitanAllocator(LayerAllocator, Module):
    """moelab's :class:`LayerAllocator` as a torchtitan ``Module`` (``eta`` starts at
    zeros, also after ``init_states``): one per model, shared by its
    :class:`MoelabRouter` layers, each of which reads its k_l in its forward."""

    def __init__(self, n_layers: int, k_total: float, n_experts: int) -> None:
        super().__init__(n_layers, k_total, n_experts)
        self._param_init = {"eta": nn.init.zeros_}


# ------------------------------------------------------------------ the module


class MoelabRouter(Module):
    """torchtitan's router slot holding a moelab Router: ``forward(x_BLD,
    expert_bias_E=None)`` returns ``(topk_scores_BLK, topk_expert_ids_BLK, scores_BLE)``
    (see the module docstring). ``router`` is the moelab Router (a :class:`TitanRouter`),
    ``gate`` the engine's gate it scores with, ``last`` the RouterOutput of the latest
    forward (:func:`moelab.integrations.torchtitan.aux_loss` reads it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        """The engine router's config plus the moelab keys; ``top_k`` stays the width
        of the ids the engine's dispatcher expects."""

        router_keys: dict[str, Any] = field(default_factory=dict)
        """RouterConfig keys over the engine's (:func:`engine_keys`)."""
        load_balance: bool = True
        """The enclosing MoE has ``load_balance_coeff`` (then moelab's ``bias_rate`` is
        refused: the engine moves the bias)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        if config._debug_force_load_balance:
            raise ValueError(
                "_debug_force_load_balance routes round-robin in the engine's router; "
                "turn it off to use a moelab router"
            )
        check_keys(config.router_keys)
        keys = merge_keys(engine_keys(config), config.router_keys)
        keys.pop("k_total", None)
        # NOTE: the config probes its map on small tensors: on the CPU, also inside the
        # trainer's meta-device build
        with torch.device("cpu"):
            router_config = RouterConfig(**keys)
        _refuse(router_config, int(config.top_k), config.load_balance)
        self.gate = config.gate.build()
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.top_k)
        self.router = _adopt(Router(router_config), self)
        self.last: RouterOutput | None = None
        self.__dict__["_allocator"] = None  # (TitanAllocator, layer index), not owned

    def attach(self, allocator: TitanAllocator, layer: int) -> None:
        """Read this layer's LapSum budget k_l from ``allocator`` (entry ``layer``)."""
        self.__dict__["_allocator"] = (allocator, layer)

    def lapsum_k(self) -> torch.Tensor | None:
        """k_l of the attached allocator (None: the Router's configured budget)."""
        held = self.__dict__.get("_allocator")
        if held is None:
            return None
        allocator, layer = held
        return allocator()[layer]

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, D = x_BLD.shape
        E = self.num_experts
        if expert_bias_E is not None:
            with torch.no_grad():
                self.router.bias[:E].copy_(expert_bias_E)
        out = self.router(x_BLD.reshape(B * L, D), lapsum_k=self.lapsum_k(), seq_len=L)
        self.last = out
        weights_TK, ids_TK = dispatchable(out, E, self.top_k)
        scores_BLE = out.probs_TE[:, :E].reshape(B, L, E)
        return weights_TK.view(B, L, -1), ids_TK.view(B, L, -1), scores_BLE

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        # NOTE: the Router's buffers (selection bias, temperature, ReLU's L1 coefficient)
        # as a fresh Router has them: after to_empty() they hold garbage
        fresh = Router(self.router.config)
        for name, value in fresh.named_buffers():
            owner_name, _, leaf = name.rpartition(".")
            owner = self.router.get_submodule(owner_name) if owner_name else self.router
            old = owner._buffers[leaf]
            assert old is not None
            device = buffer_device if buffer_device is not None else old.device
            owner._buffers[leaf] = value.to(device=device, dtype=old.dtype)
        self.last = None

    def __getstate__(self) -> dict[str, Any]:
        # NOTE: the latest output holds the forward's graph, which copies and pickles
        # cannot take; a copy starts without it
        state = dict(super().__getstate__())
        state["last"] = None
        return state

    def extra_repr(self) -> str:
        return f"engine_top_k={self.top_k}"


def dispatchable(
    out: RouterOutput, n_experts: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_TK, ids_TK)`` with ``width`` slots for the engine's dispatch: the
    Router's weights (0 on a slot whose expert is not computed) and ids where every slot
    holds a real expert, distinct within its token; a slot without one (null expert, a
    repeat, a slot the Router does not fill) takes, at weight 0, the best-scored expert
    the token does not use yet."""
    ids_TK = out.ids_TK
    weights_TK = torch.where(out.computed_TK, out.weights_TK, 0)
    T, K = ids_TK.shape
    if K > width:
        raise ValueError(
            f"the router filled {K} slots per token but the engine dispatches top_k = "
            f"{width}: lower the router's budget or raise the engine's top_k"
        )
    real_TK = ids_TK < n_experts
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=ids_TK.device).tril(-1)
    repeat_TK = ((ids_TK[:, :, None] == ids_TK[:, None, :]) & earlier_KK).any(-1)
    bad_TK = ~real_TK | repeat_TK
    if K < width:
        pad = width - K
        ids_TK = torch.cat([ids_TK, ids_TK.new_zeros(T, pad)], 1)
        weights_TK = torch.cat([weights_TK, weights_TK.new_zeros(T, pad)], 1)
        bad_TK = torch.cat([bad_TK, bad_TK.new_ones(T, pad)], 1)
    weights_TK = torch.where(bad_TK, 0, weights_TK)
    kept_TK = (~bad_TK).to(torch.int32)
    used_TE = torch.zeros(T, n_experts, dtype=torch.int32, device=ids_TK.device)
    used_TE = used_TE.scatter_add(1, ids_TK.clamp(0, n_experts - 1), kept_TK) > 0
    free_TE = out.probs_TE[:, :n_experts].detach().masked_fill(used_TE, float("-inf"))
    free_TK = free_TE.topk(width, dim=-1).indices
    order_TK = (bad_TK.cumsum(1) - 1).clamp_min(0)
    ids_TK = torch.where(bad_TK, free_TK.gather(1, order_TK), ids_TK)
    return weights_TK, ids_TK


# ------------------------------------------------------------------ the swap


def moelab_routers(model: nn.Module) -> list[tuple[str, MoelabRouter]]:
    """``(name, module)`` of every :class:`MoelabRouter` of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoelabRouter)]


def _config_of(old: TokenChoiceTopKRouter) -> MoelabRouter.Config:
    gate = old.gate
    return MoelabRouter.Config(
        num_experts=old.num_experts,
        gate=Linear.Config(
            in_features=gate.in_features,
            out_features=gate.out_features,
            bias=gate.bias is not None,
            param_init=gate._param_init,
        ),
        num_expert_groups=old.num_expert_groups,
        num_limited_groups=old.num_limited_groups,
        top_k=old.top_k,
        score_func=old.score_func,  # type: ignore[arg-type]
        route_norm=old.route_norm,
        route_scale=old.route_scale,
        _debug_force_load_balance=old._debug_force_load_balance,
    )


def swap_routers(model: nn.Module, **router_keys: Any) -> list[str]:
    """Replace every torchtitan ``TokenChoiceTopKRouter`` of ``model`` (a built
    torchtitan model, or a bare ``MoE``) with a :class:`MoelabRouter` that keeps the
    engine's gate (the same parameter object: an optimizer built before still holds
    it); returns the swapped modules' names.

    ``router_keys`` are RouterConfig keys over the engine's own (:func:`engine_keys`):
    none gives the engine's routing (the same expert ids and outputs). ``k_total``
    (with ``map="lapsum"`` and a truncating selection) adds one
    :class:`TitanAllocator` as ``model.moelab_allocator``, whose k_l feed the swapped
    layers' LapSum budgets (the layers start at ``lapsum_k = k_total / L``).

    Raises:
        ValueError: an unknown or fixed key, a model with no TokenChoiceTopKRouter, a
            routing the engine's dispatch cannot hold (module docstring), in one line.
    """
    check_keys(router_keys)
    sites = [(name, m) for name, m in model.named_modules() if isinstance(m, TokenChoiceTopKRouter)]
    if not sites:
        kind = "swapped already" if moelab_routers(model) else "none"
        raise ValueError(
            f"{type(model).__name__} has no torchtitan TokenChoiceTopKRouter to swap "
            f"({kind}); pass a torchtitan model or MoE module built from its config"
        )
    keys = dict(router_keys)
    k_total = keys.pop("k_total", None)
    if k_total is not None:  # as moelab's own model: every layer starts at K / L
        keys.setdefault("lapsum_k", float(k_total) / len(sites))
        keys.setdefault("truncation_relative", True)
    parents = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    news: list[tuple[nn.Module, str, MoelabRouter]] = []
    for name, old in sites:
        parent_name, _, attr = name.rpartition(".")
        if not name:
            raise ValueError("pass the model or MoE that holds the router, not the router")
        parent = model.get_submodule(parent_name)
        config = _config_of(old)
        moe = parents.get(parent_name)
        config.load_balance = moe is not None and moe.load_balance_coeff is not None
        config.router_keys = keys
        weight = old.gate.weight
        with torch.device("meta"):
            new = config.build()
        new.gate = old.gate
        new.router.to_empty(device=weight.device)
        new._init_self_buffers()
        with torch.no_grad():
            for pname, p in new.router.named_parameters():
                new.router._init_param(pname, p)
        if weight.dtype == torch.float64:  # a float64 model routes in float64
            new.router.to(dtype=torch.float64)
        new.train(old.training)
        news.append((parent, attr, new))
    for parent, attr, new in news:
        setattr(parent, attr, new)
    if k_total is not None:
        _attach_allocator(model, [n for _, _, n in news], float(k_total))
    return [name for name, _ in sites]


def _attach_allocator(model: nn.Module, routers: list[MoelabRouter], k_total: float) -> None:
    first = routers[0].router.config
    if not (maps.info(first.map).needs_k and first.selection_rule.calibrates):
        raise ValueError(
            "k_total (learned allocation) feeds each layer's LapSum k: set map='lapsum' "
            "and a truncating selection (selection='threshold')"
        )
    device = routers[0].gate.weight.device
    allocator = TitanAllocator(len(routers), k_total, first.n_experts).to(device)
    model.moelab_allocator = allocator
    for layer, r in enumerate(routers):
        r.attach(allocator, layer)
