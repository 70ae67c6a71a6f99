"""The router swap for the families without a table row of their own in
:mod:`moelab.integrations.hf.swap`: the moelab Router keys that reproduce a router's
written-out rule (:class:`moelab.integrations.hf.rules.Rule`), the output form the
family's MoE block expects from its router, and the check that the swap reproduces the
router's own choice and weights on probe states before any swap with other keys is
made.

==================  ======================================================================
rule                moelab Router keys
==================  ======================================================================
softmax / sigmoid   ``map`` = the scores' map (sqrt-softplus: ``map="sqrtsoftplus"``,
/ sqrt-softplus     DeepSeek-V4); ``renorm`` (straight-through with k = 1);
                    ``routed_scaling`` = the rule's scale
choice bias         the Router's selection ``bias`` = the router's bias; the choice by
                    scores + bias is moelab's group-limited rank (every group kept when the
                    family has none); by logits + bias (Kolibri), moelab's plain rank
groups              ``n_groups`` / ``topk_groups``; a group ranked by its best expert:
                    :class:`~moelab.integrations.hf.swap.DeepseekV2Groups`
zero experts        LongCat-Flash: ``n_null_experts`` = ``zero_expert_num``, identity null
                    experts, whose slots the family's experts compute as x; the choice by
                    softmax + bias over all E + Z: ``rank_by="probs"``
by token id         DeepSeek-V4's hash layers (``DeepseekV4HashRouter``, whose block calls
                    ``gate(hidden, input_ids)``): ``selection="hash"`` with the router's
                    ``tid2eid`` table loaded (:func:`token_table`,
                    :meth:`~moelab.routing.selection.hash.Hash.load_table`),
                    ``vocab_size`` = its rows, ``top_k`` = its width; the gate weights'
                    rule read on probe states and probe token ids (:func:`hash_rule`:
                    the map's values at the table's experts, renormalised, x scale);
                    ``aux_weight=0`` (the choice reads no score; the router preset
                    deepseek-v4's hash layers)
==================  ======================================================================

DeepSeek-V4 renormalises with w / (sum w + 1e-20), moelab's ``renorm`` with
w / max(sum w, tiny): equal in float32 for every sum of at least 2^-42 (about 2.3e-13;
the 1e-20 is then under half an ulp of the sum), so both layers reproduce V4 bit for bit
unless all K chosen scores are below about 1e-13 (sqrt-softplus: logits below about -60).

The check (:func:`check_swap`) runs the router and the swap on the same probe states
(and, for a layer chosen by token id, the same probe token ids).

Refused, with the reason: the sparse mixer
(PhiMoE: its training-time choice samples and its gradient is a third-order estimate,
which moelab does not have), a router that normalises its input or scales experts on
its own (Gemma 4), top-k on logits with a softmax over the k and a choice bias, a
router chosen by token id that holds no ``tid2eid`` table, or whose gate weights follow
none of the rules above.

Shape suffixes: T (moelab.shapes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelab.integrations.hf.families import RouterSite
from moelab.integrations.hf.rules import (
    Rule,
    UnresolvedRuleError,
    float32_copy,
    infer_hash_rule,
    probe_states,
    probe_token_ids,
    same_routing,
)
from moelab.routing.selection.hash import check_table

__all__ = ["check_swap", "hash_rule", "null_experts", "rule_keys", "token_table"]


def weight_only_gate(keys: dict[str, Any], renorm: bool, top_k: int) -> None:
    """The gate keys of w = p (renorm False) or w = p / sum p over the K chosen; with
    K = 1 the latter is weight 1, which the straight-through gate gives forward (moelab
    refuses renorm with K = 1: it has no gradient)."""
    if renorm and top_k == 1:
        keys["straight_through"] = True
    else:
        keys["renorm"] = bool(renorm)


def v3_group_keys(n_experts: int, n_group: int | None, topk_group: int | None) -> dict[str, Any]:
    """The group keys that make moelab choose by a + b as DeepSeek-V3 does. With one
    group V3 still chooses by sigmoid + bias (moelab without groups ranks by logit + bias,
    another choice once the bias is not constant): keep every group of a split into
    groups of two, which chooses by a + b and masks nothing."""
    if n_group is not None and n_group > 1:
        return {"n_groups": int(n_group), "topk_groups": int(topk_group or n_group)}
    divisors = [g for g in range(2, n_experts // 2 + 1) if n_experts % g == 0]
    if not divisors:  # E prime: ranking by logit + bias; equal while the bias is constant
        return {}
    g = max(divisors)
    return {"n_groups": g, "topk_groups": g}


def null_experts(model: nn.Module) -> int:
    """Zero-computation experts of the family (LongCat-Flash's ``zero_expert_num``)."""
    return int(getattr(model.config, "zero_expert_num", 0) or 0)


def _refusal(site: RouterSite, rule: Rule) -> str | None:
    if rule.scores == "sparsemixer":
        return (
            "PhiMoE's sparse mixer samples its choice in training and takes a third-order "
            "gradient estimate, which moelab does not have"
        )
    if rule.first == "probs" or rule.expert_scale:
        return "its router normalises its input and scales each expert by a learned factor"
    if rule.scores == "softmax_over_k" and rule.choice_bias:
        return "it chooses by logits + bias and weights by a softmax over the k"
    return None


def token_table(model: nn.Module, site: RouterSite) -> torch.Tensor:
    """The (V, K) token id -> experts table of a site that chooses by token id
    (DeepSeek-V4's ``tid2eid`` buffer); ValueError when its router holds none, or one
    that moelab's hash rule cannot take
    (:func:`~moelab.routing.selection.hash.check_table`: K distinct experts in [0, E)
    per token id; the table of a freshly initialised V4 is all zeros)."""
    table = getattr(site.router, "tid2eid", None)
    name = getattr(model.config, "model_type", None)
    where = f"MoE layer {site.layer} ({site.name}) of this {name!r} model chooses its experts"
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise ValueError(
            f"{where} by token id, but its router holds no (V, K) table tid2eid that the "
            "swap could load into moelab's hash rule"
        )
    try:
        check_table(table, int(table.shape[0]), site.n_experts, int(table.shape[1]))
    except ValueError as err:
        raise ValueError(
            f"{where} by its token table tid2eid, which moelab's hash rule cannot take: {err}"
        ) from None
    return table


def hash_rule(model: nn.Module, site: RouterSite) -> Rule:
    """The rule of the gate weights of a site that chooses by token id
    (:func:`moelab.integrations.hf.rules.infer_hash_rule`), read once per router module
    (kept on it); ValueError saying why when moelab cannot tell it."""
    cached = site.router.__dict__.get("_moelab_hash_rule")
    if isinstance(cached, Rule):
        return cached
    vocab = int(token_table(model, site).shape[0])
    try:
        rule = infer_hash_rule(site.router, model.config, vocab)
    except UnresolvedRuleError as err:
        name = getattr(model.config, "model_type", None)
        raise ValueError(f"swap_routers cannot reproduce the {name!r} router: {err}") from None
    site.router.__dict__["_moelab_hash_rule"] = rule
    return rule


def _hash_keys(model: nn.Module, site: RouterSite) -> dict[str, Any]:
    """The keys of a layer that chooses by token id: moelab's hash rule (its table is
    the router's, :func:`token_table`, loaded by the swap), the gate weights of
    :func:`hash_rule`; no balance loss (the preset deepseek-v4's hash layers: the choice
    reads no score for it to move)."""
    rule = hash_rule(model, site)
    vocab, width = token_table(model, site).shape
    keys: dict[str, Any] = {"d_model": int(site.weight.shape[1]), "n_experts": site.n_experts}
    keys.update(top_k=int(width), selection="hash", vocab_size=int(vocab), map=rule.scores)
    weight_only_gate(keys, rule.renorm, int(width))
    if rule.scale != 1.0:
        keys["routed_scaling"] = float(rule.scale)
    keys["aux_weight"] = 0.0
    return keys


def rule_keys(model: nn.Module, site: RouterSite) -> dict[str, Any]:
    """The RouterConfig keys of the site's rule (module docstring); ValueError saying
    why when moelab cannot express it."""
    if site.by_token_id:
        return _hash_keys(model, site)
    rule = site.rule
    name = getattr(model.config, "model_type", None)
    if rule is None:
        raise ValueError(
            f"MoE layer {site.layer} ({site.name}) of this {name!r} model: its routing "
            "rule was not read, so the swap cannot reproduce it"
        )
    why = _refusal(site, rule)
    if why is not None:
        raise ValueError(f"swap_routers cannot reproduce the {name!r} router: {why}")
    n_null = null_experts(model)
    n_real = site.n_experts - n_null
    keys: dict[str, Any] = {"d_model": int(site.weight.shape[1]), "n_experts": n_real}
    keys["top_k"] = site.top_k
    if rule.scores == "softmax_over_k":  # softmax over the k = the renormalised softmax
        keys["map"] = "softmax"
        weight_only_gate(keys, True, site.top_k)
        keys["scorer_bias"] = site.bias is not None
        return keys
    keys["map"] = rule.scores
    weight_only_gate(keys, rule.renorm, site.top_k)
    if rule.scale != 1.0:
        keys["routed_scaling"] = float(rule.scale)
    if n_null:
        keys.update(n_null_experts=n_null, null_expert="identity")
    if rule.groups is not None:
        keys.update(n_groups=rule.groups[0], topk_groups=rule.groups[1])
    elif rule.choice_bias and rule.choice_on == "scores":
        if n_null:  # groups exclude null experts; rank by the map's values + bias
            keys["rank_by"] = "probs"
        else:
            keys.update(v3_group_keys(n_real, None, None))
    return keys


def _described(site: RouterSite) -> str:
    if site.by_token_id:
        rule = site.router.__dict__.get("_moelab_hash_rule")
        weights = f", weights: {rule.describe()}" if isinstance(rule, Rule) else ""
        return f"experts by token id{weights}"
    return site.rule.describe() if site.rule else site.family.name


@torch.no_grad()
def check_swap(model: nn.Module, site: RouterSite, swapped: nn.Module) -> None:
    """ValueError unless the swapped router chooses the experts and gate weights of the
    site's own router on probe states (float32, 1e-5)."""
    assert site.adapter is not None
    router = float32_copy(site.router)
    x = probe_states(site.adapter.weight(router))
    was = router.training, swapped.training
    router.eval()
    swapped.eval()
    try:
        if site.by_token_id:  # the block passes the input ids: probe ids with the states
            ids_T = probe_token_ids(int(token_table(model, site).shape[0])).to(x.device)
            _, w, ids = site.read(router(x, ids_T))
            _, w2, ids2 = site.read(swapped(x, ids_T))
        else:
            _, w, ids = site.read(site.adapter.call(router, site.block, x))
            out = site.adapter.call(swapped, site.block, x)
            _, w2, ids2 = site.read(out)
    finally:
        router.train(was[0])
        swapped.train(was[1])
    tol = 1e-5
    if not same_routing(ids, w, ids2, w2, tol):
        name = getattr(model.config, "model_type", None)
        raise ValueError(
            f"swap_routers cannot reproduce the {name!r} router of MoE layer {site.layer} "
            f"({site.name}; {_described(site)}): the "
            "moelab Router's choice or gate weights differ from the model's on probe "
            "inputs, so the swap is refused"
        )
