"""Group-limited choice before the selection rule (DeepSeek-V3 technical report, 2024,
https://arxiv.org/abs/2412.19437, section 2.1.2; ``SelectionConfig.n_groups`` and
``topk_groups``).

The E experts form G = ``n_groups`` groups of E / G consecutive experts (group g holds
experts g * E/G .. (g + 1) * E/G - 1). Per token:

1. the choice scores are ``a + b``: a the map's values (``probs_TE`` detached: the
   sigmoid affinities of DeepSeek-V3 with ``map="sigmoid"``), b the loss-free balancing
   bias (``Router.bias``), plus the exploration noise in training (``noise_std``);
2. a group's score is the sum of its two largest ``a + b``;
3. the U = ``topk_groups`` groups of largest score are kept;
4. the selection rule (top-K) chooses among the kept groups' experts: the others get the
   choice score -inf, so they are never chosen (``top_k <= U * E / G`` is checked).

The gates come from ``a`` alone (the gate stage reads ``probs_TE``, never the choice
scores): DeepSeek-V3 normalises the selected ``a`` to sum 1 (``renorm=True``) and
multiplies by ``routed_scaling`` (:func:`moelab.routing.router.gate_weights`).

Choices made here, and why:

* The choice scores are the map's values plus the bias, not the logits plus the bias (the
  ranking of every other rule, :meth:`Selection.rank`): DeepSeek-V3 adds the bias to the
  sigmoid affinities, and the sum of a group's two best is not invariant under the
  monotone map, so ranking by logits would pick other groups. This matches DeepSeek's
  inference code and ``transformers``' ``DeepseekV3TopkRouter``.
* Experts outside the kept groups are masked with -inf, as DeepSeek's inference code and
  recent ``transformers`` do; some ports fill 0.0 instead, which picks the same experts
  whenever the K-th best kept ``a + b`` is >= 0 (always without bias, sigmoid being
  positive).
* Ties are broken deterministically: among groups of equal score the lower group index
  wins (a stable sort). A masked expert never ties with a kept one (-inf). Ties between
  experts inside the kept groups are left to ``torch.topk``, as in the references.
* A group's score needs two experts: every group must hold at least 2 (checked with the
  config). It is V3's sum of the two best whatever the map (DeepSeek-V2's softmax
  routing scored a group by its best expert alone; moelab does not offer that).

Which rules allow it is the rule's answer ``Selection.limits_groups`` (top-K: yes).
Causal: yes, each token is routed on its own.

Shape suffixes: T, E, G, U (moelab.shapes).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["GroupSettings", "check", "enabled", "group_mask", "kept_experts", "limit_groups"]


class GroupSettings(Protocol):
    """What group-limited choice reads of the selection stage's settings
    (:class:`~moelab.routing.selection.base.SelectionConfig` has them)."""

    @property
    def selection(self) -> str: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def sample_extra(self) -> int: ...
    @property
    def n_groups(self) -> int | None: ...
    @property
    def topk_groups(self) -> int | None: ...


def enabled(config: GroupSettings) -> bool:
    """Group-limited choice is on: ``n_groups`` > 1."""
    return config.n_groups is not None and config.n_groups > 1


def kept_experts(config: GroupSettings) -> int:
    """The experts a token can choose from: ``topk_groups * E / n_groups`` (E when off)."""
    if not enabled(config):
        return config.n_experts
    assert config.n_groups is not None and config.topk_groups is not None
    return config.topk_groups * (config.n_experts // config.n_groups)


def check(config: GroupSettings, limits_groups: bool) -> None:
    """Raise ValueError, saying what to change, for ``n_groups`` / ``topk_groups`` that
    cannot work with this config; ``limits_groups``: the selection rule allows it."""
    n_groups, topk_groups, n_experts = config.n_groups, config.topk_groups, config.n_experts
    if n_groups is not None and (
        isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1
    ):
        raise ValueError(f"n_groups must be a positive integer (or None: off), got {n_groups!r}")
    if not enabled(config):
        if topk_groups is not None and topk_groups != 1:
            raise ValueError(
                f"topk_groups = {topk_groups} needs group-limited routing: set n_groups > 1 "
                "(or drop topk_groups)"
            )
        return
    assert n_groups is not None
    if not limits_groups:
        raise ValueError(
            f"selection {config.selection!r} cannot use group-limited routing (n_groups); "
            "use selection='topk' or n_groups=None"
        )
    if n_experts % n_groups:
        raise ValueError(f"n_groups = {n_groups} must divide n_experts = {n_experts}")
    if n_experts // n_groups < 2:
        raise ValueError(
            f"each group needs at least 2 experts (a group's score is the sum of its two "
            f"best), got n_experts / n_groups = {n_experts}/{n_groups}: use fewer groups"
        )
    if topk_groups is None or isinstance(topk_groups, bool) or not isinstance(topk_groups, int):
        raise ValueError(
            f"n_groups = {n_groups} needs topk_groups, the groups kept per token "
            f"(an integer in [1, {n_groups}]), got {topk_groups!r}"
        )
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must lie in [1, n_groups={n_groups}], got {topk_groups}")
    kept = kept_experts(config)
    if config.top_k + config.sample_extra > kept:
        extra = f" + sample_extra = {config.top_k + config.sample_extra}" * bool(
            config.sample_extra
        )
        raise ValueError(
            f"top_k{extra} exceeds the {kept} experts of the topk_groups = {topk_groups} kept "
            f"groups (topk_groups * n_experts / n_groups): lower top_k or raise topk_groups"
        )


def group_mask(choice_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """bool (T, E): the experts of each token's ``topk_groups`` groups of largest score,
    a group's score the sum of its two largest ``choice_TE``; ties: the lower group."""
    n_tokens, n_experts = choice_TE.shape
    per_group = n_experts // n_groups
    score_TG = choice_TE.reshape(n_tokens, n_groups, per_group).topk(2, dim=-1).values.sum(-1)
    # NOTE: a stable descending sort, not topk: equal group scores keep index order
    best_TU = torch.sort(score_TG, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    kept_TG = torch.zeros_like(score_TG, dtype=torch.bool).scatter_(1, best_TU, True)
    return kept_TG.repeat_interleave(per_group, dim=1)


def limit_groups(
    choice_TE: torch.Tensor, config: GroupSettings, top_k: int, training: bool
) -> torch.Tensor:
    """``choice_TE`` with -inf on the experts outside each token's kept groups. A call
    whose rule may reach more experts than the kept groups hold (``top_k``, plus
    ``sample_extra`` candidates in training), ``top_k`` and ``training`` those of the
    call, is refused with a ValueError:
    ``Router.top_k`` may be changed after construction."""
    kept = kept_experts(config)
    needed = top_k + (config.sample_extra if training else 0)
    if needed > kept:
        raise ValueError(
            f"top_k = {top_k} (plus sample_extra in training) exceeds the {kept} "
            f"experts of the kept groups (topk_groups * n_experts / n_groups): route with "
            f"top_k <= {kept - (needed - top_k)}"
        )
    assert config.n_groups is not None and config.topk_groups is not None
    mask_TE = group_mask(choice_TE, config.n_groups, config.topk_groups)
    return choice_TE.masked_fill(~mask_TE, float("-inf"))
