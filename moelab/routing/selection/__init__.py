"""The selection stage: which experts each token goes to, as a registry of rules.

A rule is one :class:`Selection` subclass in one file of this package, registered under
its ``name`` (``RouterConfig.selection``) by one line in this file (the base classes, the
stage's config :class:`SelectionConfig` and the registry live in
:mod:`moelab.routing.selection.base`, which the rules import). It holds its computation,
ranking scores and map values in, selected slots out::

    logits_TE, probs_TE --rank--> rank_TE --select--> ids_TK, selected_TK

and it answers what the rest of moelab asks about a rule, so that nothing outside this
package compares a rule's name:

* ``truncates``: a token-dependent number of experts (a cut on p), not a fixed count;
* ``sweep``: what the inference-time budget sweep varies, ``"top_k"``
  (``Router.top_k``; :func:`moelab.diagnostics.evaluate`) or ``"threshold_scale"`` (a
  factor on ``Router.truncation``; :func:`moelab.diagnostics.evaluate_truncation`);
* ``calibrates``: the rule cuts p at ``Router.truncation``, which training calibrates so
  that about k experts pass (:meth:`Router.calibrate`), k the map's budget: learned
  allocation across layers needs such a rule;
* :meth:`~Selection.slots` (K, the slots per token) and
  :meth:`~Selection.expected_experts` (the experts a token is expected to reach, what
  ``moelab params`` counts as active), both from the config alone;
* :meth:`~Selection.check`: the settings the rule cannot use, refused when the
  :class:`SelectionConfig` (the stage's own settings, which ``RouterConfig`` builds) is
  built; a setting of another stage that the rule cannot pair with is refused by the
  Router's wiring (:mod:`moelab.routing.pairings`), from what the rule states:
  ``learns_through_gate``, ``learned_choice``;
* ``limits_groups``: the rule may run after DeepSeek-V3's group-limited choice
  (``n_groups``, ``topk_groups``; :mod:`moelab.routing.selection.groups`), which ranks
  by the map's values plus the bias and masks the experts of the groups not kept.

The gate stage turns the selected slots into weights; a slot that is not selected gets
weight 0. A rule is an ``nn.Module`` so that one that needs state (a fixed table, say)
can keep it in the router's state dict (hash routing keeps its token id -> experts table
there).

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

from moelab.routing.selection import groups
from moelab.routing.selection.base import (
    HASH_TABLE_FILE,
    HASH_TABLES,
    RANK_BY,
    SWEEPS,
    Budget,
    Selected,
    Selection,
    SelectionConfig,
    available,
    get,
    register,
    unregister,
)
from moelab.routing.selection.expert_choice import ExpertChoice
from moelab.routing.selection.hash import Hash
from moelab.routing.selection.sinkhorn import Sinkhorn
from moelab.routing.selection.threshold import Threshold
from moelab.routing.selection.top_p import TopP
from moelab.routing.selection.topk import TopK

__all__ = [
    "HASH_TABLES",
    "HASH_TABLE_FILE",
    "RANK_BY",
    "SWEEPS",
    "Budget",
    "Selected",
    "Selection",
    "SelectionConfig",
    "available",
    "get",
    "groups",
    "register",
    "unregister",
]

# the registry: one line per built-in rule, in the order available() lists them
register(TopK)
register(Threshold)
register(TopP)
register(ExpertChoice)
register(Sinkhorn)
register(Hash)
