"""The rules on RouterConfig keys that every bridge putting a moelab
:class:`~moelab.routing.router.Router` in place of another framework's router shares
(the Hugging Face swap, :mod:`moelab.integrations.hf.swap`; torchtitan,
:mod:`moelab.integrations.torchtitan.router`; OLMo-core,
:mod:`moelab.integrations.olmo_core.router`), written once and named by the engine in
their messages:

- :func:`check_keys`: the user's keys are RouterConfig fields (or old names of them, or
  the bridge's own extra keys); a key the engine's model sets (``d_model``,
  ``n_experts``, and for an engine whose gate has its bias ``scorer_bias``) is refused;
- :func:`merge_keys`: the engine's keys (those that reproduce its routing) overridden by
  the user's, where a gate key given replaces all the engine's gate keys and a selection
  rule that cannot run after group-limited choice drops the engine's groups;
- :func:`refuse_undispatchable`: what a token-choice dispatch of K slots per token
  cannot hold (expert choice, hash routing, identity / constant null experts, more
  slots than the engine's K).

Every error is a ValueError of one line that names the engine and says what to change.
Importing this module imports no engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from moelab.routing import selection as selection_rules
from moelab.routing.config import ALIASES, RouterConfig
from moelab.routing.selection.expert_choice import ExpertChoice
from moelab.routing.selection.hash import Hash

__all__ = [
    "ENGINE_KEYS",
    "GATE_KEYS",
    "GROUP_KEYS",
    "check_keys",
    "merge_keys",
    "refuse_undispatchable",
]

ENGINE_KEYS = ("d_model", "n_experts")
"""RouterConfig keys every engine's model sets (the width of its states, its experts)."""

GATE_KEYS = ("gate", "renorm", "straight_through")
"""The keys that choose the gate: one given replaces all the engine's."""

GROUP_KEYS = ("n_groups", "topk_groups")
"""Group-limited choice (DeepSeek-V3): the keys a selection without groups drops."""

_NULL_REASONS = {
    "identity": "outputs x times its gate weight",
    "constant": "adds a learned vector per null expert",
}


def check_keys(
    given: Mapping[str, Any],
    engine: str,
    *,
    fixed: Collection[str] = ENGINE_KEYS,
    extra: Collection[str] = (),
) -> None:
    """ValueError, in one line naming ``engine``, for a key of ``given`` in ``fixed``
    (set by the engine's model) or one that is neither a RouterConfig field, nor an old
    name of one (:data:`~moelab.routing.config.ALIASES`), nor one of the bridge's
    ``extra`` keys; an unknown key close to a known one is named with it."""
    for key in given:
        if key in fixed:
            raise ValueError(f"{key} comes from the {engine} model (its router); do not pass it")
    known = {f.name for f in fields(RouterConfig)} | set(ALIASES) | set(extra)
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    plural = "s" if len(unknown) > 1 else ""
    also = f", or {', '.join(sorted(extra))}" if extra else ""
    raise ValueError(
        f"unknown router key{plural} {', '.join(named)} for {engine}: give fields of "
        f"moelab.RouterConfig (map, alpha, top_k, selection, ...){also}"
    )


def merge_keys(
    defaults: Mapping[str, Any],
    given: Mapping[str, Any],
    *,
    rank_by_without_groups: str | None = None,
) -> dict[str, Any]:
    """The engine's keys ``defaults`` overridden by the user's ``given``: a gate key
    given (:data:`GATE_KEYS`) replaces the engine's gate keys; a ``selection`` given
    whose rule cannot run after group-limited choice drops the engine's groups
    (:data:`GROUP_KEYS`) unless groups are given too.

    Group-limited choice ranks by the map's values (+ bias); without groups the Router
    ranks by its ``rank_by``. ``rank_by_without_groups`` is what the engine's own keys
    give a router without groups (torchtitan: "probs", its choice by map value + bias),
    set when the groups are dropped and ``rank_by`` is not given; None leaves the
    RouterConfig default ("logits", as the Hugging Face swap's keys of a family without
    groups leave it)."""
    keys = dict(defaults)
    if any(k in given for k in GATE_KEYS):
        for k in GATE_KEYS:
            keys.pop(k, None)
    if "selection" in given and not any(k in given for k in GROUP_KEYS):
        if not selection_rules.get(given["selection"]).limits_groups:
            if rank_by_without_groups is not None and any(k in keys for k in GROUP_KEYS):
                keys.setdefault("rank_by", rank_by_without_groups)
            for k in GROUP_KEYS:
                keys.pop(k, None)
    keys.update(given)
    return keys


def refuse_undispatchable(
    config: RouterConfig,
    engine: str,
    *,
    top_k: int | None = None,
    raise_top_k: str = "raise the engine's top_k",
    expert_choice: bool = False,
    token_ids: bool = False,
) -> None:
    """ValueError, in one line naming ``engine``, for a routing of ``config`` that the
    engine's MoE block cannot run: hash routing unless ``token_ids`` (the block passes
    its router the tokens' ids, as DeepSeek-V4's hash layers in transformers), identity
    / constant null experts (its experts cannot add x or a vector), expert choice
    unless ``expert_choice`` (a token-choice dispatch of K experts per token cannot
    hold a token's batch-dependent slots), and, given the engine's dispatch width
    ``top_k``, a rule with more slots per token (``raise_top_k``: how to widen the
    engine's dispatch)."""
    rule = config.selection_rule
    if not expert_choice and issubclass(rule, ExpertChoice):
        raise ValueError(
            f"selection={config.selection!r} has experts pick their tokens, so a token's "
            f"slots depend on the batch, which the {engine} MoE block's token-choice "
            "dispatch (K experts per token) cannot hold: choose a token-choice rule "
            "(topk, threshold, top_p, sinkhorn)"
        )
    if issubclass(rule, Hash) and not token_ids:
        raise ValueError(
            f"selection={config.selection!r} routes by token id, which the {engine} MoE "
            "block does not pass to its router: choose another selection rule"
        )
    if config.n_null_experts and config.null_expert != "zero":
        why = _NULL_REASONS.get(config.null_expert, "adds an output")
        raise ValueError(
            f"null_expert={config.null_expert!r} {why}, which the {engine} experts cannot "
            "compute: use null_expert='zero' or n_null_experts=0"
        )
    if top_k is not None and config.slots > top_k:
        raise ValueError(
            f"the router fills up to {config.slots} slots per token and the {engine} MoE "
            f"block dispatches top_k={top_k}: cap the rule at {top_k} (top_k, top_p_cap "
            f"or token_cap_factor), or {raise_top_k}"
        )
