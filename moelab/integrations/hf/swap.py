"""Router swap: replace the routing of every MoE layer of a loaded Hugging Face model with
a moelab :class:`~moelab.routing.router.Router`, and fine-tune it with moelab's own
balance loss.

Every family the installed transformers supports here has a router module that returns
``(router_logits, top_k_weights, top_k_index)`` and a block that feeds the last two to its
experts (``block.gate`` or, in GPT-OSS, ``block.router``). The swap puts a
:class:`SwappedRouter` in that attribute: it runs the moelab Router and returns the same
triple, so the HF experts run unchanged with every expert implementation (eager,
``batched_mm``, ``grouped_mm``). In the installed transformers (5.x) every supported
family, DeepSeek-V3 included, chooses its experts in the router module; a block that
chooses them in a routing method of its own (``route_tokens_to_experts``, as older
transformers did for DeepSeek-V3) is refused with a message.

Initialisation and the options that reproduce each family's routing
(:func:`equivalent_keys`; keys given to :func:`swap_routers` override them):

==============  ==============================================================
family          moelab Router keys
==============  ==============================================================
mixtral         softmax, top-k, ``renorm=True``
qwen2_moe,      softmax, top-k, ``renorm=norm_topk_prob``
qwen3_moe,
olmoe
deepseek_v2     softmax, top-k (``topk_method="greedy"``; ``"group_limited_greedy"``:
                with ``n_groups=n_group``, ``topk_groups=topk_group`` and a group
                scored by its best expert, :class:`DeepseekV2Groups`), gate = the
                softmax values, ``routed_scaling=routed_scaling_factor``
deepseek_v3     ``map="sigmoid"``, top-k by a + b within ``n_groups=n_group``,
                ``topk_groups=topk_group`` (a group scored by its two best),
                ``renorm=norm_topk_prob``, ``routed_scaling``; the Router's
                selection ``bias`` buffer = ``e_score_correction_bias``
gpt_oss         softmax, top-k, ``renorm=True`` (a softmax over the k chosen
                logits is the renormalised softmax over all E),
                ``scorer_bias=True`` initialised from the router bias
==============  ==============================================================

The Router's weight is a float32 copy of the HF gate weight (E, D).

Variable-k routing (``selection="threshold"``, ``"top_p"``, capacity drops, null
experts): a slot that is not computed keeps a valid expert index (its own, or 0 for a
null expert) and weight 0, never a sentinel index E (which yields NaN in the grouped
path). Rules the swap refuses: ``selection="hash"`` in a layer whose block does not pass
its router the token ids (every layer but DeepSeek-V4's hash layers, whose block calls
``gate(hidden, input_ids)``: there the swap *is* moelab's hash rule, with the model's
``tid2eid`` table, :mod:`moelab.integrations.hf.swap_rules`) and
``null_expert="identity"`` (an identity null expert outputs x times its weight, which
the HF experts cannot add). Expert choice
(``selection="expert_choice"``) works, with its own caveat: each expert picks its tokens
among those of the forward call, so a token's experts depend on the rest of the batch
(and generation with a cache routes one token at a time).

Fine-tuning: the Router's ``aux_loss`` (its Switch loss ``aux_weight``, z-loss, ...,
correct for every map) is collected in each forward; add :func:`moelab_aux_loss` to the
model's loss. transformers' own load-balancing loss recomputes softmax + top-k from the
router logits; after a swap it is off: the swap sets ``config.output_router_logits`` to
False and a forward with ``output_router_logits=True`` raises a ValueError that says so
(on an unswapped model, turn it off with ``output_router_logits=False`` or
``router_aux_loss_coef=0``). :func:`step_swapped` advances the Routers' per-step state (temperature
schedule, loss-free bias) after each optimiser step.

Saving: ``model.save_pretrained(path)`` of a swapped model calls
:func:`moelab.integrations.hf.saved.save_swapped`, which writes a plain transformers
folder of the original architecture (the routers' fine-tuned weights under the HF router
names; a plain ``from_pretrained`` gives the family's own routing) and the moelab Routers
beside it; :func:`~moelab.integrations.hf.saved.load_swapped` loads both back (and
``moelab stats --hf``, ``eval --hf`` and ``analyze --hf`` read the folder with them). The save warns
when a plain ``from_pretrained`` would route otherwise than the swapped routers.

Shape suffixes: T, D, E, K, G, V (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from moelab.integrations import router_keys as router_keys_rules
from moelab.integrations.hf.swap_rules import (
    check_swap,
    null_experts,
    rule_keys,
    token_table,
    v3_group_keys,
    weight_only_gate,
)
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput
from moelab.routing.router import Router, step_routers
from moelab.routing.selection import Budget, Selected
from moelab.routing.selection.hash import Hash
from moelab.routing.selection.topk import TopK

__all__ = [
    "SWAP_FAMILIES",
    "DeepseekV2Groups",
    "SwappedRouter",
    "SwappedRouting",
    "collect_router_outputs",
    "equivalent_keys",
    "load_token_table",
    "moelab_aux_loss",
    "new_router",
    "step_swapped",
    "swap_routers",
    "swapped_routers",
]

SWAP_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)
"""The model types whose routing :func:`swap_routers` reproduces by the table of the module
docstring; every other family whose rule moelab writes out swaps through
:mod:`moelab.integrations.hf.swap_rules`, checked on probe states first."""

ENGINE = "Hugging Face"
"""The engine's name in the swap's messages."""


class DeepseekV2Groups(TopK):
    """DeepSeek-V2's ``group_limited_greedy``: the E experts form ``n_groups`` groups of
    consecutive experts, a group is scored by its best ranking score (the softmax value,
    plus the selection bias), the ``topk_groups`` best groups are kept and top-K chooses
    among their experts. moelab's own group-limited choice (``selection="topk"`` with
    ``n_groups``) is DeepSeek-V3's, a group scored by its two best; the swap puts this
    rule in a DeepSeek-V2 Router's ``selection`` in place of it (the config still says
    top-K with groups, which answers every question on slots and budgets alike). Not
    registered: it is not a rule of its own."""

    def forward(
        self, logits_TE: torch.Tensor, probs_TE: torch.Tensor, bias_E: torch.Tensor, budget: Budget
    ) -> Selected:
        cfg = self.config
        rank_TE = self.rank(probs_TE, bias_E, budget)
        if cfg.n_groups is not None and cfg.n_groups > 1:
            assert cfg.topk_groups is not None
            n_tokens, n_experts = rank_TE.shape
            per_group = n_experts // cfg.n_groups
            score_TG = rank_TE.reshape(n_tokens, cfg.n_groups, per_group).amax(-1)
            best_TG = torch.sort(score_TG, dim=-1, descending=True, stable=True).indices
            kept_TG = torch.zeros_like(score_TG, dtype=torch.bool)
            kept_TG.scatter_(1, best_TG[:, : cfg.topk_groups], True)
            kept_TE = kept_TG.repeat_interleave(per_group, dim=1)
            rank_TE = rank_TE.masked_fill(~kept_TE, float("-inf"))
        return self.select(rank_TE, probs_TE, budget)


# ------------------------------------------------------------------ the router sites


def _family(model: nn.Module) -> str:
    """The model type of a model of :data:`SWAP_FAMILIES`, or "generic" for another
    family whose routers moelab reads with a written-out rule
    (:mod:`moelab.integrations.hf.swap_rules`)."""
    from moelab.integrations.hf.families import UnsupportedModelError, family_of

    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family in SWAP_FAMILIES:
        return family
    try:
        if family_of(model).name == "generic":
            return "generic"
    except UnsupportedModelError:
        pass
    raise ValueError(
        f"swap_routers supports the model types {', '.join(SWAP_FAMILIES)} and the "
        f"families whose routing moelab writes out (docs/huggingface.md, Families); this "
        f"model is {family!r}"
    )


def _sites(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(block, attribute, router module)`` of every MoE layer, from
    :func:`moelab.integrations.hf.families.moe_routers`."""
    from moelab.integrations.hf.families import moe_routers

    if swapped_routers(model):
        raise ValueError("this model's routers are swapped already; swap a fresh copy")
    return [(s.block, s.name.rpartition(".")[2], s.router) for s in moe_routers(model)]


def _top_k(hf_router: nn.Module, config: Any) -> int:
    k = getattr(hf_router, "top_k", None)
    return int(k if k is not None else config.num_experts_per_tok)


def equivalent_keys(model: nn.Module, hf_router: nn.Module) -> dict[str, Any]:
    """The RouterConfig keys that reproduce the routing of ``hf_router`` (one MoE layer of
    ``model``); see the module docstring's table."""
    family = _family(model)
    config = model.config
    weight = hf_router.weight
    n_experts, d_model = weight.shape
    top_k = _top_k(hf_router, config)
    keys: dict[str, Any] = {"d_model": d_model, "n_experts": n_experts, "top_k": top_k}
    keys["map"] = "softmax"
    if family == "mixtral":
        weight_only_gate(keys, True, top_k)
    elif family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        weight_only_gate(
            keys, bool(getattr(hf_router, "norm_topk_prob", config.norm_topk_prob)), top_k
        )
    elif family == "deepseek_v2":
        keys["routed_scaling"] = float(config.routed_scaling_factor)
        method = getattr(hf_router, "topk_method", config.topk_method)
        if method == "group_limited_greedy":  # top-K by V2's group score: _v2_groups
            keys["n_groups"] = int(config.n_group)
            keys["topk_groups"] = int(config.topk_group)
        elif method != "greedy":
            raise ValueError(
                f"DeepSeek-V2 topk_method {method!r} is not supported by the swap; "
                "supported: 'greedy', 'group_limited_greedy'"
            )
    elif family == "deepseek_v3":
        keys["map"] = "sigmoid"
        keys["routed_scaling"] = float(config.routed_scaling_factor)
        weight_only_gate(keys, bool(config.norm_topk_prob), top_k)
        keys.update(v3_group_keys(n_experts, config.n_group, config.topk_group))
    elif family == "gpt_oss":
        weight_only_gate(keys, True, top_k)
        keys["scorer_bias"] = True
    return keys


def _merge(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The family's keys overridden by the user's
    (:func:`moelab.integrations.router_keys.merge_keys`): a gate key given replaces the
    three gate keys, a selection given drops the group keys unless the rule allows groups
    (or the groups are given too); the choice then ranks by ``rank_by`` as given or as
    the family's keys set it (RouterConfig's "logits" for most)."""
    # NOTE: torchtitan's bridge sets rank_by="probs" when it drops the groups, its own
    # choice without groups; the families here without groups keep RouterConfig's
    return router_keys_rules.merge_keys(defaults, given)


def _v2_groups(model: nn.Module, hf_router: nn.Module, router: Router) -> None:
    """DeepSeek-V2's group-limited greedy choice: the top-K rule with groups of the
    Router scores a group by its best expert (:class:`DeepseekV2Groups`)."""
    method = getattr(hf_router, "topk_method", getattr(model.config, "topk_method", None))
    if method != "group_limited_greedy" or type(router.selection) is not TopK:
        return
    if router.config.n_groups is not None and router.config.n_groups > 1:
        router.selection = DeepseekV2Groups(router.selection.config)


def _refuse(config: RouterConfig, token_ids: bool = False) -> None:
    # NOTE: expert choice runs: the block takes whatever slots the router gives; hash
    # routing where the block passes its router the input ids (``token_ids``)
    router_keys_rules.refuse_undispatchable(config, ENGINE, expert_choice=True, token_ids=token_ids)


def new_router(config: RouterConfig, device: torch.device | str | None = None) -> Router:
    """``Router(config)`` on ``device``; a hash rule's table (drawn at construction from
    torch's global RNG) is drawn from a forked RNG, so that building a Router whose table
    the swap then replaces leaves the caller's random stream as it was."""
    if not issubclass(config.selection_rule, Hash):
        return Router(config).to(device=device)
    with torch.random.fork_rng(devices=[]):
        return Router(config).to(device=device)


def load_token_table(router: Router, table_VK: torch.Tensor) -> None:
    """Route ``router`` (a hash rule) by ``table_VK`` (V, K'): its first K columns, K
    the Router's ``top_k`` (:meth:`~moelab.routing.selection.hash.Hash.load_table`
    refuses a K above the table's width)."""
    assert isinstance(router.selection, Hash)
    width = router.selection.table_VK.shape[1]
    table = table_VK.detach().to(router.selection.table_VK.device)
    router.selection.load_table(table[:, :width] if table.shape[1] > width else table)


# ------------------------------------------------------------------ the swapped router


class SwappedRouting(NamedTuple):
    """A swapped router's decision in the form the model's block reads
    (:meth:`SwappedRouter.route`)."""

    out: RouterOutput
    """The moelab Router's output."""
    weights_TK: torch.Tensor
    """The gate weights, 0 on a slot that is not computed, in the hidden states' dtype."""
    ids_TK: torch.Tensor
    """The expert ids, a valid expert index on every slot."""


class SwappedRouter(nn.Module):
    """A moelab :class:`Router` in place of an HF router module: ``forward(hidden)``
    returns ``(router_logits, top_k_weights, top_k_index)`` as the HF module did (the
    logits are the Router's scores; the weights are 0 on every slot whose expert is not
    computed, whose index is always a valid expert)."""

    def __init__(self, router: Router, family: str, form: str = "triple") -> None:
        super().__init__()
        self.router = router
        self.family = family
        self.form = form
        """What the family's block expects back: "triple" (logits, weights, ids);
        "llama4" (the weights scattered over all E, the logits); "null_ids" a triple
        whose null-expert slots keep their ids >= E and weights (LongCat-Flash's
        identity experts, which its block computes)."""
        self.num_experts = router.config.n_experts
        self.own: RouterConfig | None = None
        """The RouterConfig that reproduces the layer's own routing (the family's rule):
        what a plain ``from_pretrained`` of a saved folder routes with
        (:meth:`own_router`)."""
        self.own_groups = False
        """Whether the own rule scores a group by its best expert (DeepSeek-V2's)."""
        self.own_bias: torch.Tensor | None = None
        """The selection bias of the own rule at the swap (the model's own, or zeros):
        what a plain load routes with where the save does not write the Router's."""
        self.by_token_id = False
        """The layer chooses by token id (DeepSeek-V4's hash layers): the block passes
        the input ids after the hidden states, and :meth:`forward` gives them to the
        Router as ``token_ids_T``."""
        self.own_table: torch.Tensor | None = None
        """The (V, K) token id -> experts table of a layer that chooses by token id, as
        the model had it at the swap (what a saved folder's table holds)."""
        self.last: RouterOutput | None = None
        """The RouterOutput of the latest forward (for the aux loss and step)."""
        self._collect: list[RouterOutput] | None = None
        self._seq_len: int | None = None

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @top_k.setter
    def top_k(self, value: int) -> None:
        self.router.top_k = int(value)

    @property
    def weight(self) -> torch.Tensor:
        """The Router's weight (E (+ M), D)."""
        return self.router.weight

    def route(
        self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> SwappedRouting:
        """``(out, weights_TK, ids_TK)``: the Router's decision on the (T, D) tokens (and
        their input ids ``token_ids``, any shape of T elements, for a hash rule), with
        the slots that are not computed at weight 0 and a valid expert index."""
        seq_len = hidden_states.shape[1] if hidden_states.dim() == 3 else self._seq_len
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        if seq_len is not None and x_TD.shape[0] % seq_len:
            seq_len = None
        ids_T = None if token_ids is None else token_ids.reshape(-1).to(x_TD.device)
        out = self.router(x_TD, seq_len=seq_len, token_ids_T=ids_T)
        self.last = out
        if self._collect is not None:
            self._collect.append(out)
        computed_TK = out.computed_TK
        if self.form == "null_ids" and out.null_TK is not None:
            kept_TK = computed_TK | out.null_TK
            weights_TK = torch.where(kept_TK, out.weights_TK, 0)
            ids_TK = torch.where(kept_TK, out.ids_TK, 0)
            return SwappedRouting(out, weights_TK.to(hidden_states.dtype), ids_TK)
        weights_TK = torch.where(computed_TK, out.weights_TK, 0)
        ids_TK = torch.where(out.ids_TK < self.num_experts, out.ids_TK, 0)
        return SwappedRouting(out, weights_TK.to(hidden_states.dtype), ids_TK)

    def forward(self, hidden_states: torch.Tensor, *block_args: Any) -> Any:
        """The routing of ``hidden_states`` in the form the family's block reads. In a
        layer that chooses by token id (:attr:`by_token_id`) ``block_args[0]`` is the
        input ids, given to the Router; other ``block_args``, such as a choice bias the
        block passes, are not used (the Router holds its own selection bias)."""
        ids = block_args[0] if self.by_token_id and block_args else None
        out, weights_TK, ids_TK = self.route(hidden_states, ids)
        scores_TE = out.scores_TE.to(hidden_states.dtype)
        if self.form == "llama4":
            dense_TE = torch.zeros_like(scores_TE).scatter_add(1, ids_TK, weights_TK)
            return dense_TE, scores_TE
        return scores_TE, weights_TK, ids_TK

    def own_router(self, bias_saved: bool) -> Router | None:
        """A Router of the layer's own rule (:attr:`own`) on this Router's current weights
        (and scorer bias, or zeros): how a plain ``from_pretrained`` of a folder
        :func:`~moelab.integrations.hf.saved.save_swapped` wrote routes this layer.
        ``bias_saved``: the save writes the Router's selection bias into the model
        (DeepSeek-V3's ``e_score_correction_bias``); else the own rule keeps the bias it
        had at the swap. None when the own rule is not known."""
        if self.own is None:
            return None
        mine = self.router
        plain = new_router(self.own, mine.weight.device)
        if self.own_groups and type(plain.selection) is TopK:
            plain.selection = DeepseekV2Groups(plain.selection.config)
        if self.own_table is not None and isinstance(plain.selection, Hash):
            load_token_table(plain, self.own_table)
        n = min(plain.weight.shape[0], mine.weight.shape[0])
        with torch.no_grad():
            plain.weight[:n].copy_(mine.weight[:n])
            if plain.scorer_bias is not None:
                if mine.scorer_bias is not None:
                    plain.scorer_bias[:n].copy_(mine.scorer_bias[:n])
                else:
                    plain.scorer_bias.zero_()
            if bias_saved:
                plain.bias[:n].copy_(mine.bias[:n])
            elif self.own_bias is not None:
                plain.bias[: self.own_bias.shape[0]].copy_(self.own_bias)
        return plain.eval()

    def extra_repr(self) -> str:
        return f"family={self.family}"


def _record_seq_len(block: nn.Module, args: tuple[Any, ...]) -> None:
    swapped = _swapped_of(block)
    if swapped is not None and args and isinstance(args[0], torch.Tensor):
        swapped._seq_len = args[0].shape[1] if args[0].dim() == 3 else None


def _swapped_of(block: nn.Module) -> SwappedRouter | None:
    for child in block.children():
        if isinstance(child, SwappedRouter):
            return child
    return None


def swap_routers(model: nn.Module, **router_keys: Any) -> list[SwappedRouter]:
    """Replace the router of every MoE layer of ``model`` (a loaded transformers MoE
    causal LM of :data:`SWAP_FAMILIES`) with a moelab Router, in place; returns the
    swapped routers, in layer order.

    ``router_keys`` are RouterConfig keys (``map``, ``alpha``, ``selection``,
    ``truncation``, ``top_p``, ``gate``, ``temperature``, ``aux_weight``, ...); those not
    given take the values that reproduce the model's own routing
    (:func:`equivalent_keys`), so that ``swap_routers(model)`` leaves the logits as
    they were. The Router starts from the HF gate weight (and bias, and DeepSeek-V3's
    correction bias as its selection bias); ``d_model`` and ``n_experts`` come from the
    model. The Routers take the mode (train / eval) of the model.

    Raises:
        ValueError: an unsupported model, a key the config refuses, or a rule the swap
            cannot run (``selection="hash"`` where the block passes no token ids,
            ``null_expert="identity"``).
    """
    return swap_with_layer_keys(model, router_keys, None)


def swap_with_layer_keys(
    model: nn.Module, router_keys: dict[str, Any], layer_keys: list[dict[str, Any]] | None
) -> list[SwappedRouter]:
    """:func:`swap_routers`; with ``layer_keys`` (one dict per MoE layer, as
    :func:`~moelab.integrations.hf.saved.load_swapped` reads them) each layer takes its own
    keys in place of ``router_keys``."""
    family = _family(model)
    router_keys_rules.check_keys(router_keys, ENGINE)
    if family == "generic":
        return _swap_generic(model, router_keys, layer_keys)
    swapped = []
    sites = _sites(model)
    if layer_keys is not None and len(layer_keys) != len(sites):
        raise ValueError(f"{len(layer_keys)} layers of router keys for {len(sites)} MoE layers")
    for i, (block, attr, hf_router) in enumerate(sites):
        if hasattr(block, "route_tokens_to_experts"):
            raise ValueError(
                f"{type(block).__name__} chooses its experts in route_tokens_to_experts, "
                "not in its router module; the swap supports the router-module layout of "
                "transformers >= 5 (upgrade transformers)"
            )
        given = router_keys if layer_keys is None else layer_keys[i]
        own = equivalent_keys(model, hf_router)
        config = RouterConfig(**_merge(own, given))
        weight = hf_router.weight.detach()
        router = Router(config).to(device=weight.device)
        _refuse(config)
        if family == "deepseek_v2":
            _v2_groups(model, hf_router, router)
        with torch.no_grad():
            router.weight[: config.n_experts].copy_(weight.float())
            hf_bias = getattr(hf_router, "bias", None)
            if router.scorer_bias is not None and isinstance(hf_bias, torch.Tensor):
                router.scorer_bias[: config.n_experts].copy_(hf_bias.detach().float())
            correction = getattr(hf_router, "e_score_correction_bias", None)
            if isinstance(correction, torch.Tensor):
                router.bias[: config.n_experts].copy_(correction.detach().float())
        router.train(hf_router.training)
        new = SwappedRouter(router, family)
        new.own = RouterConfig(**own)
        method = getattr(hf_router, "topk_method", getattr(model.config, "topk_method", None))
        new.own_groups = method == "group_limited_greedy" and (own.get("n_groups") or 0) > 1
        new.own_bias = router.bias[: config.n_experts].detach().clone()
        new.train(hf_router.training)
        setattr(block, attr, new)
        block.register_forward_pre_hook(_record_seq_len)
        swapped.append(new)
    # transformers' own load-balancing loss reads the router logits its recorder no
    # longer finds; it is off, and asking for it says what to use instead
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    model.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_save_pretrained, model)
    return swapped


def _finish(model: nn.Module) -> None:
    # transformers' own load-balancing loss reads the router logits its recorder no
    # longer finds; it is off, and asking for it says what to use instead
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    model.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_save_pretrained, model)


def _generic_router(
    site: Any, keys: dict[str, Any], form: str, table: torch.Tensor | None = None
) -> SwappedRouter:
    """The SwappedRouter of one site with ``keys``; ``table``: the token id -> experts
    table a hash rule routes by (the model's own, for a layer that chooses by token id)."""
    config = RouterConfig(**keys)
    router = new_router(config, site.weight.device)
    if not keys.get("n_null_experts"):
        _refuse(config, token_ids=site.by_token_id)
    elif config.null_expert != "identity":
        raise ValueError(
            "this family's zero-computation experts are identity experts: keep "
            "null_expert='identity' for the swap"
        )
    if type(router.selection) is TopK and _max_groups(site):
        router.selection = DeepseekV2Groups(router.selection.config)
    if table is not None and isinstance(router.selection, Hash):
        try:
            load_token_table(router, table)
        except ValueError as err:
            raise ValueError(
                f"MoE layer {site.layer} ({site.name}) routes by its token table tid2eid, "
                f"which moelab's hash rule cannot take: {err}"
            ) from None
    n = min(site.n_experts, router.weight.shape[0])
    with torch.no_grad():
        router.weight[:n].copy_(site.weight.detach().float()[:n])
        if router.scorer_bias is not None and site.bias is not None:
            router.scorer_bias[:n].copy_(site.bias.detach().float()[:n])
        if site.choice_bias is not None:
            router.bias[:n].copy_(site.choice_bias.detach().float()[:n])
    router.train(site.router.training)
    new = SwappedRouter(router, str(getattr(site.family, "name", site.family)), form)
    new.by_token_id = bool(site.by_token_id)
    new.train(site.router.training)
    return new


def _max_groups(site: Any) -> bool:
    """The site's rule scores a group by its best expert (DeepSeek-V2's)."""
    return bool(site.rule is not None and site.rule.groups and site.rule.group_score == "max")


def _swap_generic(
    model: nn.Module, router_keys: dict[str, Any], layer_keys: list[dict[str, Any]] | None
) -> list[SwappedRouter]:
    """:func:`swap_with_layer_keys` for a family without a row of its own: each router's written-out
    rule gives the keys (:func:`moelab.integrations.hf.swap_rules.rule_keys`), and a
    Router with those keys must reproduce the model's choice and weights on probe states
    (:func:`~moelab.integrations.hf.swap_rules.check_swap`) before the one with the
    given keys takes its place."""
    from moelab.integrations.hf.families import moe_routers

    if swapped_routers(model):
        raise ValueError("this model's routers are swapped already; swap a fresh copy")
    sites = moe_routers(model)
    if layer_keys is not None and len(layer_keys) != len(sites):
        raise ValueError(f"{len(layer_keys)} layers of router keys for {len(sites)} MoE layers")
    assert all(s.adapter is not None for s in sites)
    form = "null_ids" if null_experts(model) else "triple"
    if any(s.adapter.name == "llama4" for s in sites):  # type: ignore[union-attr]
        form = "llama4"
    plans = []
    for i, site in enumerate(sites):
        own = rule_keys(model, site)
        table = token_table(model, site) if site.by_token_id else None
        check_swap(model, site, _generic_router(site, own, form, table))
        given = router_keys if layer_keys is None else layer_keys[i]
        # a table given (hash_table) is the one routed by, not the model's
        routed = None if "hash_table" in given else table
        plans.append((site, own, _merge(own, given), routed, table))
    swapped = []
    for site, own, keys, routed, table in plans:
        new = _generic_router(site, keys, form, routed)
        new.own = RouterConfig(**own)
        new.own_groups = _max_groups(site)
        if table is not None:  # the model's own, which a saved folder holds
            new.own_table = table.detach().clone()
        n = min(site.n_experts, new.router.bias.shape[0])
        new.own_bias = new.router.bias[:n].detach().clone()
        attr = site.name.rpartition(".")[2]
        setattr(site.block, attr, new)
        site.block.register_forward_pre_hook(_record_seq_len)
        swapped.append(new)
    _finish(model)
    return swapped


def _save_pretrained(model: nn.Module, save_directory: Any, **kwargs: Any) -> Any:
    """``model.save_pretrained`` of a swapped model:
    :func:`moelab.integrations.hf.saved.save_swapped`, which that module registers in
    :data:`SAVE` when it is imported (the package imports it), so that this module does
    not import the one that imports it."""
    if SAVE is None:  # pragma: no cover - the package always imports saved
        raise RuntimeError("import moelab.integrations.hf.saved to save a swapped model")
    return SAVE(model, save_directory, 2, kwargs)


SAVE: Any = None
"""``save_swapped``'s body, ``(model, path, stack level, kwargs)``
(:mod:`moelab.integrations.hf.saved` sets it)."""


def _refuse_router_logits(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "output_router_logits=True asks for transformers' load-balancing loss, which "
            "recomputes softmax + top-k from the logits; after swap_routers it is off: add "
            "moelab_aux_loss(model) to the loss (and read the routing with "
            "collect_router_outputs(model))"
        )


# ------------------------------------------------------------------ fine-tuning


def swapped_routers(model: nn.Module) -> list[SwappedRouter]:
    """The swapped routers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, SwappedRouter)]


def moelab_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the swapped Routers' ``aux_loss`` of the latest forward (their balance
    loss, z-loss, ... as configured: ``aux_weight`` etc.), to add to the model's loss in
    place of transformers' load-balancing loss.

    Raises:
        ValueError: no swapped router, or none has run a forward yet.
    """
    routers = swapped_routers(model)
    if not routers:
        raise ValueError("the model has no swapped router: call swap_routers(model, ...) first")
    outs = [r.last for r in routers]
    if any(o is None for o in outs):
        raise ValueError("run a forward of the model before reading its aux loss")
    return sum((o.aux_loss for o in outs if o is not None), torch.zeros(()).to(outs[0].aux_loss))


@contextlib.contextmanager
def collect_router_outputs(model: nn.Module) -> Iterator[list[RouterOutput]]:
    """Within the block, every swapped Router's output is appended to the yielded list
    (several forwards: all of them, in call order)."""
    routers = swapped_routers(model)
    if not routers:
        raise ValueError("the model has no swapped router: call swap_routers(model, ...) first")
    outs: list[RouterOutput] = []
    for r in routers:
        r._collect = outs
    try:
        yield outs
    finally:
        for r in routers:
            r._collect = None


def step_swapped(model: nn.Module) -> None:
    """Once per optimiser step: ``Router.step`` of every swapped router with its latest
    output (temperature schedules, auxiliary-loss-free bias ``bias_rate``, ReLU routing's
    adaptive L1), as moelab's training loop does."""
    routers = swapped_routers(model)
    ran = [r for r in routers if r.last is not None]
    step_routers([r.router for r in ran], [r.last for r in ran if r.last is not None])
