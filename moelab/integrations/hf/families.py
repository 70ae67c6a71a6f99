"""Mixture-of-experts families of Hugging Face transformers (>= 5) and their routing.

A *family* is a ``config.model_type`` whose MoE blocks hold a router module that maps
hidden states ``x_TD`` to ``(logits_TE, weights_TK, ids_TK)`` (transformers 5's
``*TopKRouter`` modules; the block runs its experts on ``ids_TK`` with ``weights_TK``).
Each family turns the logits into its expert choice and gate weights its own way; this
module records that as data (:class:`Family`) and as a reference function
(:func:`route`), which the tests check against the installed transformers' routers:

=============  ==============================================================================
family         probabilities / choice / gate weights
=============  ==============================================================================
mixtral        softmax over E, top-k, renormalised over the k
qwen2_moe,     softmax over E, top-k, renormalised over the k iff ``norm_topk_prob``
qwen3_moe,
olmoe
deepseek_v2    softmax over E; ``topk_method`` "greedy" (top-k) or "group_limited_greedy"
               (the ``topk_group`` of ``n_group`` groups with the highest max score, then
               top-k inside them); weights = scores x ``routed_scaling_factor``
deepseek_v3    sigmoid scores; choice on scores + ``e_score_correction_bias``, group-limited
               (groups ranked by the sum of their top-2 biased scores, keep ``topk_group`` of
               ``n_group``), top-k; weights = the unbiased scores of the chosen experts,
               normalised over the k iff ``norm_topk_prob``, x ``routed_scaling_factor``
gpt_oss        top-k on the logits (router with a bias), softmax over the k logits
generic        any other family whose router modules moelab reaches (``...TopKRouter``,
               ``...HashRouter`` for a layer that chooses by token id, or a ``...Router`` /
               ``...Gate`` child of an MoE block): the rule is read from the router on
               probe states (:mod:`moelab.integrations.hf.rules`) and checked to reproduce
               its choice and weights; ``generic_sigmoid`` when that rule's scores are
               positive (sigmoid, sqrt-softplus), normalised over all E for the statistics
=============  ==============================================================================

Statistics need a distribution over all E experts (:func:`stats_probs`): the softmax
of the logits for the softmax families, for GPT-OSS (whose own probabilities are a
softmax over the chosen k only) and for ``generic``; the sigmoid scores of DeepSeek-V3
and ``generic_sigmoid`` normalised over all E (``a / sum(a)``). The ``map`` of the
statistics is then ``"softmax"`` or ``"sigmoid"``; neither has a singleton ``threshold``
(null).

:func:`moe_routers` lists the router of every MoE layer (:class:`RouterSite`) and
refuses a model with an MoE layer (a module holding ``experts``) whose router it cannot
hook; :func:`top_k` changes the number of experts per token of a loaded model in place
(whether a router honours it is checked on the routing it returns:
:mod:`moelab.integrations.hf.stats`).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moelab.integrations.hf import rules as _rules
from moelab.integrations.hf.rules import Adapter, RouterReading, Rule, UnresolvedRuleError
from moelab.maps.softmax import rows_softmax

__all__ = [
    "FAMILIES",
    "Family",
    "RouterSite",
    "UnsupportedModelError",
    "check_top_k",
    "family_of",
    "first_rule",
    "import_transformers",
    "moe_blocks",
    "moe_routers",
    "route",
    "route_site",
    "set_offline",
    "stats_probs",
    "top_k",
]


class UnsupportedModelError(ValueError):
    """The model has no router that moelab knows how to read."""


@dataclass(frozen=True)
class Family:
    """Routing semantics of one MoE family (see the module docstring).

    ``scores``: how the family scores experts from the logits ("softmax", "sigmoid" or
    "logits" for GPT-OSS's top-k on raw logits); ``map``: the map whose values over all
    E the statistics use ("softmax" or "sigmoid"); ``router_classes``: class names of
    the router modules in the installed transformers (empty for ``generic``, which
    matches any ``...TopKRouter``).
    """

    name: str
    scores: str
    map: str
    router_classes: tuple[str, ...]
    renorm: str  # "always", "norm_topk_prob", "never" or "softmax_over_k"
    grouped: str  # "never", "topk_method" (DeepSeek-V2) or "always" (DeepSeek-V3)
    scaled: bool  # weights x routed_scaling_factor
    choice_bias: bool  # e_score_correction_bias added for the choice only


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mixtral", "softmax", "softmax", ("MixtralTopKRouter",), "always", "never",
               False, False),
        Family("qwen2_moe", "softmax", "softmax", ("Qwen2MoeTopKRouter",), "norm_topk_prob",
               "never", False, False),
        Family("qwen3_moe", "softmax", "softmax", ("Qwen3MoeTopKRouter",), "norm_topk_prob",
               "never", False, False),
        Family("olmoe", "softmax", "softmax", ("OlmoeTopKRouter",), "norm_topk_prob", "never",
               False, False),
        Family("deepseek_v2", "softmax", "softmax", ("DeepseekV2TopkRouter",), "never",
               "topk_method", True, False),
        Family("deepseek_v3", "sigmoid", "sigmoid", ("DeepseekV3TopkRouter",),
               "norm_topk_prob", "always", True, True),
        Family("gpt_oss", "logits", "softmax", ("GptOssTopKRouter",), "softmax_over_k",
               "never", False, False),
        Family("generic", "softmax", "softmax", (), "router", "never", False, False),
        Family("generic_sigmoid", "sigmoid", "sigmoid", (), "router", "always", False, True),
    )
}  # fmt: skip
"""The supported families by name (the config's ``model_type``; ``generic`` for any
other model whose routers return (logits, weights, indices), ``generic_sigmoid`` for
those among them whose routers hold an ``e_score_correction_bias``: sigmoid scores, as
DeepSeek-V3)."""

_NOT_READ = {
    "dbrx": "DBRX's router returns logits only and its MoE block chooses the experts and "
    "normalises their weights itself (a p-norm), so there is no router output to read",
    "jetmoe": "JetMoE's router returns a dispatch plan (token order, gates, expert sizes), "
    "not each token's experts and weights",
    "zaya": "ZAYA's router is an MLP that carries state from the previous MoE layer",
}
"""MoE families of transformers whose routing moelab does not read, with the reason."""

_GENERIC_ROUTER = re.compile(r"(Top[Kk]|Hash)Router$")


def _supported() -> str:
    named = [n for n in FAMILIES if not n.startswith("generic")]
    return (
        ", ".join(named) + ", and any other family whose router modules moelab reaches "
        "(...TopKRouter, ...HashRouter, or a ...Router / ...Gate of an MoE block) and whose "
        "rule it writes out (docs/huggingface.md, Families)"
    )


# -- transformers, offline --------------------------------------------------------


def set_offline() -> None:
    """Set the Hugging Face libraries' offline switches (HF_HUB_OFFLINE,
    TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) so that they never reach a network."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def import_transformers() -> Any:
    """``transformers`` (>= 5), imported after :func:`set_offline`; a clear ImportError
    naming the extra when it is missing or too old."""
    set_offline()
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "the Hugging Face integration needs transformers >= 5: "
            "pip install 'moelab[hf]' (or pip install 'transformers>=5.0')"
        ) from err
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"the Hugging Face integration needs transformers >= 5, found "
            f"{transformers.__version__}: pip install -U 'transformers>=5.0'"
        )
    return transformers


# -- finding the routers ----------------------------------------------------------


@dataclass
class RouterSite:
    """The router of one MoE layer of a loaded model.

    ``layer``: index among the MoE layers (model order); ``name``: qualified name of the
    router module; ``block``: the MoE block holding it (its parent module); ``router``:
    the router module (``router(x_TD) -> (logits_TE, weights_TK, ids_TK)``);
    ``weight``: the gate weight (E, D) (the parameter itself); ``bias``: the logits'
    bias (E,) (GPT-OSS) or None; ``choice_bias``: DeepSeek-V3's
    ``e_score_correction_bias`` (E,), added to the scores for the choice only, or None;
    ``top_k``: the router's current experts per token; ``n_experts``: E;
    ``by_token_id``: the router chooses by token id (its forward takes ``input_ids``, as
    DeepSeek-V4's hash-routed layers: a fixed table of experts per token id; its logits
    still give the gate weights).
    """

    layer: int
    name: str
    block: torch.nn.Module
    router: torch.nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    choice_bias: torch.Tensor | None
    top_k: int
    n_experts: int
    family: Family
    by_token_id: bool = False
    rule: Rule | None = None
    """The written-out rule of a ``generic`` router, checked on probe states
    (:func:`moelab.integrations.hf.rules.infer_rule`); None for the named families."""
    adapter: Adapter | None = None
    """How the router's output is read (:class:`moelab.integrations.hf.rules.Adapter`)."""

    def read(self, output: Any) -> RouterReading:
        """The router's output as a :class:`~moelab.integrations.hf.rules.RouterReading`
        ``(logits_TE, weights_TK, ids_TK)``."""
        if self.adapter is None:
            return _rules.ADAPTERS["triple"].read(output, self.top_k)
        return self.adapter.read(output, self.top_k)


def family_of(model_or_config: Any) -> Family:
    """The :class:`Family` of a model or config, from ``config.model_type``; a model of
    another type whose routers moelab reaches (:func:`_generic_routers`) is ``generic``
    (:func:`moe_routers` makes it ``generic_sigmoid`` when the rule it reads scores by a
    sigmoid). Raises UnsupportedModelError naming the supported families otherwise (and
    the reason, for the families moelab knows it does not read)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES and not model_type.startswith("generic"):
        return FAMILIES[model_type]
    if isinstance(model_or_config, torch.nn.Module) and _generic_routers(model_or_config):
        return FAMILIES["generic"]
    why = _NOT_READ.get(str(model_type))
    if why is not None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: {why}; supported: {_supported()}"
        )
    raise UnsupportedModelError(
        f"model type {model_type!r} is not a supported mixture-of-experts family; "
        f"supported: {_supported()}"
    )


def _is_router(module: torch.nn.Module, family: Family) -> bool:
    cls = type(module).__name__
    if family.router_classes:
        return cls in family.router_classes
    return bool(_GENERIC_ROUTER.search(cls)) and isinstance(
        getattr(module, "weight", None), torch.Tensor
    )


_ROUTER_NAME = re.compile(r"(Router|Gate)$")


def _generic_routers(model: torch.nn.Module) -> list[str]:
    """Qualified names of the router modules of a model of no named family: the
    ``...TopKRouter`` / ``...HashRouter`` modules, and the ``...Router`` / ``...Gate``
    children of its MoE blocks whose gate weight moelab can reach
    (:func:`moelab.integrations.hf.rules.adapter_of`), in model order."""
    modules = dict(model.named_modules())
    found = {
        n for n, m in modules.items()
        if _GENERIC_ROUTER.search(type(m).__name__) and type(m).__name__ != "SwappedRouter"
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    }  # fmt: skip
    for block in moe_blocks(model):
        for child_name, child in modules[block].named_children():
            cls = type(child).__name__
            if child_name == "experts" or cls == "SwappedRouter" or not _ROUTER_NAME.search(cls):
                continue
            if _rules.adapter_of(child) is not None:
                found.add(f"{block}.{child_name}" if block else child_name)
    return [n for n in modules if n in found]


def moe_blocks(model: torch.nn.Module) -> list[str]:
    """Qualified names of the MoE blocks of ``model``, in model order: every module with
    a child named ``experts`` (the transformers >= 5 layout of every MoE family), found
    from the modules alone, whether or not moelab knows its router."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "_modules", {}).get("experts"), torch.nn.Module)
    ]


def first_rule(sites: list[RouterSite]) -> str | None:
    """The written-out rule (:meth:`Rule.describe`) of the first MoE layer that has one,
    which stands for the model's routing in reports: a model's first layers may choose
    by token id and have none (DeepSeek-V4's hash layers); None when no layer has one."""
    for site in sites:
        if site.rule is not None:
            return site.rule.describe()
    return None


def _by_token_id(router: torch.nn.Module) -> bool:
    try:
        return "input_ids" in inspect.signature(router.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def _site_label(site: RouterSite) -> str:
    return f"{site.layer} ({site.name})"


def _unhooked(model: torch.nn.Module, sites: list[RouterSite], family: Family) -> None:
    """UnsupportedModelError naming every MoE block of ``model`` that holds none of the
    routers found (its routing would go unread)."""
    parents = [s.name.rpartition(".")[0] for s in sites]
    modules = dict(model.named_modules())
    blocks = moe_blocks(model)
    missing = [b for b in blocks if not any(b == p or b.startswith(p + ".") for p in parents)]
    if missing:
        named = ", ".join(f"{b} ({type(modules[b]).__name__})" for b in missing)
        raise UnsupportedModelError(
            f"{len(missing)} of the {len(blocks)} MoE layers of this "
            f"{getattr(model.config, 'model_type', None)!r} model (family {family.name}) "
            f"hold no router moelab can hook, so their routing cannot be read: {named}; "
            f"supported: {_supported()}"
        )


def moe_routers(model: torch.nn.Module) -> list[RouterSite]:
    """The router of every MoE layer of ``model`` (a transformers causal LM or base
    model), in model order. A router of the ``generic`` family has its rule read from it
    on probe states (:func:`moelab.integrations.hf.rules.infer_rule`; ``generic_sigmoid``
    when that rule scores with a sigmoid). Raises UnsupportedModelError (naming the
    supported families) when the model is of no supported family, has no router, has an
    MoE block (:func:`moe_blocks`) that holds none of the routers found (naming the
    blocks and the family), or has a router whose rule moelab cannot write out."""
    family = family_of(model)
    modules = dict(model.named_modules())
    names = (
        _generic_routers(model)
        if family.name == "generic"
        else [n for n, m in modules.items() if _is_router(m, family)]
    )
    sites: list[RouterSite] = []
    for name in names:
        module = modules[name]
        adapter = _rules.adapter_of(module)
        if adapter is None:
            raise UnsupportedModelError(
                f"router {name} ({type(module).__name__}) has no gate weight moelab can "
                f"reach; supported: {_supported()}"
            )
        weight = adapter.weight(module)
        if weight.dim() != 2:
            raise UnsupportedModelError(
                f"router {name} has a weight of shape {tuple(weight.shape)}, expected "
                f"(experts, width); supported: {_supported()}"
            )
        parent = name.rpartition(".")[0]
        bias = getattr(module, "bias", None)
        choice_bias = adapter.bias(module, modules[parent])
        k = getattr(module, "top_k", None)
        for key in ("num_experts_per_tok", "top_k_experts", "moe_topk"):
            if k is None:
                k = getattr(model.config, key, None)
        site = RouterSite(
            layer=len(sites),
            name=name,
            block=modules[parent],
            router=module,
            weight=weight,
            bias=bias if isinstance(bias, torch.Tensor) else None,
            choice_bias=choice_bias,
            top_k=int(k),
            n_experts=int(weight.shape[0]),
            family=family,
            by_token_id=_by_token_id(module),
            adapter=adapter,
        )
        if family.name == "generic" and not site.by_token_id and not weight.is_meta:
            # NOTE: a model still on the meta device (load_hf checks the layout before the
            # weights exist) has its rule read when its routers are listed again
            site.rule = _rule_of(model, site)
            if site.rule.map == "sigmoid":
                site.family = FAMILIES["generic_sigmoid"]
        sites.append(site)
    if not sites:
        raise UnsupportedModelError(
            f"found no MoE router in the {type(model).__name__} (model type "
            f"{getattr(model.config, 'model_type', None)!r}); supported: {_supported()}"
        )
    _unhooked(model, sites, family)
    if family.name == "generic":
        fams = {s.family.name for s in sites if not s.by_token_id}
        if len(fams) > 1:
            raise UnsupportedModelError(
                "the MoE layers of this model score experts by different maps (softmax in "
                "some, sigmoid in others); moelab reads one map per model"
            )
        for s in sites:
            if s.by_token_id and fams:
                s.family = FAMILIES[fams.pop()]
                fams.add(s.family.name)
    return sites


def _rule_of(model: torch.nn.Module, site: RouterSite) -> Rule:
    """The site's rule, inferred once per router module (kept on the module)."""
    cached = site.router.__dict__.get("_moelab_rule")
    if isinstance(cached, Rule):
        return cached
    assert site.adapter is not None
    try:
        rule = _rules.infer_rule(site.router, site.block, model.config, site.adapter, site.top_k)
    except UnresolvedRuleError as err:
        raise UnsupportedModelError(
            f"MoE layer {site.layer} ({site.name}) of this "
            f"{getattr(model.config, 'model_type', None)!r} model: {err}; its statistics "
            "would use a distribution the model does not"
        ) from None
    site.router.__dict__["_moelab_rule"] = rule
    return rule


# -- the families' routing as functions ----------------------------------------------


def stats_probs(family: Family | str, logits_TE: torch.Tensor) -> torch.Tensor:
    """The distribution over all E experts that the statistics use (float32): softmax
    of the logits, or for sigmoid scores ``a / sum(a)`` with ``a = sigmoid(logits)``."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    z = logits_TE.float()
    if fam.scores == "sigmoid":
        a = torch.sigmoid(z)
        return a / a.sum(-1, keepdim=True)
    return rows_softmax(z)  # torch.softmax, faster on narrow CPU rows


def _group_mask(values_TE: torch.Tensor, n_group: int, topk_group: int, how: str) -> torch.Tensor:
    T, E = values_TE.shape
    grouped = values_TE.view(T, n_group, E // n_group)
    if how == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # sum of the top-2
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def route(
    family: Family | str,
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    norm_topk_prob: bool = False,
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    choice_bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing of ``family`` from its logits: ``(ids_TK, weights_TK)``, each
    family's semantics (module docstring) written out from the installed transformers'
    router code. ``generic`` has no reference (its router's own output is used)."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    z = logits_TE.float()
    E = z.shape[-1]
    check_top_k(fam, top_k, E, n_group=n_group, topk_group=topk_group, topk_method=topk_method)
    if fam.name.startswith("generic"):
        raise ValueError(f"the {fam.name} family has no reference routing: use the router's output")
    if fam.scores == "logits":  # GPT-OSS
        top, ids = z.topk(top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    if fam.scores == "sigmoid":  # DeepSeek-V3
        scores = torch.sigmoid(z)
        choice = scores if choice_bias_E is None else scores + choice_bias_E.float()
        keep = _group_mask(choice, n_group, topk_group, "top2sum")
        ids = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        scores = torch.softmax(z, dim=-1)
        choice = scores
        if fam.grouped == "topk_method" and topk_method == "group_limited_greedy":
            keep = _group_mask(scores, n_group, topk_group, "max")
            choice = scores.masked_fill(~keep, 0.0)
        weights, ids = choice.topk(top_k, dim=-1)
    if fam.renorm == "always" or (fam.renorm == "norm_topk_prob" and norm_topk_prob):
        weights = weights / weights.sum(-1, keepdim=True)
    if fam.scaled:
        weights = weights * routed_scaling_factor
    return ids, weights


def _router_params(router: torch.nn.Module) -> dict[str, Any]:
    return dict(
        norm_topk_prob=bool(getattr(router, "norm_topk_prob", False)),
        topk_method=getattr(router, "topk_method", "greedy"),
        n_group=int(getattr(router, "num_group", None) or 1),
        topk_group=int(getattr(router, "topk_group", None) or 1),
        routed_scaling_factor=float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
    )


def route_site(
    site: RouterSite, logits_TE: torch.Tensor, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` with the parameters read from the site's router module."""
    return route(
        site.family,
        logits_TE,
        site.router.top_k if k is None else k,
        choice_bias_E=site.choice_bias,
        **_router_params(site.router),
    )


# -- changing K ------------------------------------------------------------------------


def check_top_k(
    family: Family | str,
    k: int,
    n_experts: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    topk_method: str = "greedy",
) -> None:
    """ValueError when ``k`` experts per token cannot be chosen (k < 1, k > E, or more
    than the experts of the ``topk_group`` groups a group-limited choice keeps)."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    if not 1 <= k <= n_experts:
        raise ValueError(f"top-k must be in 1..{n_experts} (the experts per layer), got {k}")
    grouped = fam.grouped == "always" or (
        fam.grouped == "topk_method" and topk_method == "group_limited_greedy"
    )
    if grouped:
        allowed = topk_group * (n_experts // n_group)
        if k > allowed:
            raise ValueError(
                f"top-k {k} is more than the {allowed} experts a {fam.name} router can choose "
                f"from ({topk_group} of {n_group} groups of {n_experts // n_group}); use "
                f"top-k <= {allowed}"
            )


@contextlib.contextmanager
def top_k(model: torch.nn.Module, k: int) -> Iterator[list[RouterSite]]:
    """Set ``top_k = k`` on the router of every MoE layer of ``model`` inside the block;
    restored after. The named families' routers read that attribute in forward; a router
    that does not (PhiMoE's always chooses 2, a token-id table has its own width) keeps
    its own choice: the sweep checks the routing it captures
    (:meth:`moelab.integrations.hf.stats.Seen.check_k`)."""
    sites = moe_routers(model)
    for s in sites:
        p = _router_params(s.router)
        check_top_k(s.family, k, s.n_experts, n_group=p["n_group"],
                    topk_group=p["topk_group"], topk_method=p["topk_method"])  # fmt: skip
    fixed = [s for s in sites if not hasattr(s.router, "top_k")]
    if fixed and k != fixed[0].top_k:
        raise UnsupportedModelError(
            f"the router of MoE layer {_site_label(fixed[0])} ({type(fixed[0].router).__name__}) "
            f"takes its K from the model's config, not from a top_k of its own; the sweep "
            f"cannot set K = {k} on this model: sweep its own K only (--top-k {fixed[0].top_k})"
        )
    movable = [s for s in sites if hasattr(s.router, "top_k")]
    old = [s.router.top_k for s in movable]
    try:
        for s in movable:
            s.router.top_k = k
            s.top_k = k
        yield sites
    finally:
        for s, k0 in zip(movable, old, strict=True):
            s.router.top_k = k0
            s.top_k = k0


# -- the installed transformers' MoE families ---------------------------------------------


def moe_model_types() -> list[str]:
    """Every ``model_type`` of the installed transformers that has a causal-LM class and
    whose modeling module defines an experts module (a class named ``...Experts``),
    sorted: the MoE families moelab is tested against (docs/huggingface.md, "Families")."""
    import importlib

    tf = import_transformers()
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        module = model_type_to_module_name(model_type)
        try:
            mod = importlib.import_module(f"{tf.__name__}.models.{module}.modeling_{module}")
        except Exception:
            continue
        if any(n.endswith("Experts") and isinstance(getattr(mod, n), type) for n in dir(mod)):
            found.append(model_type)
    return found
