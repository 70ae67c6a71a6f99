"""ReLU routing with adaptive L1 regularisation (ReMoE: Wang, Chen and Zhu, *ReMoE: Fully
Differentiable Mixture-of-Experts with ReLU Routing*, ICLR 2025,
https://arxiv.org/abs/2412.14711).

The routing itself is two existing stages: ``map="relu"`` gives the gates R = relu(s)
and ``selection="threshold"`` with ``truncation=0`` and no ``token_cap_factor`` keeps
every expert with a positive gate (E slots, no renormalisation), so a token's output is
sum_e R_e FFN_e(x). This file holds what ReMoE adds on top, switched on by
``RouterConfig.l1_target`` = k:

* the L1 term with the paper's load-balancing refinement (:func:`l1_loss`), per layer

      L_reg = sum_e f_e * (1/T) sum_t R_te,     f_e = E / (k T) * #{t : R_te > 0},

  f detached (a count), so a busy expert's gates are pushed down harder; with even
  load (f_e = 1) it is the plain mean L1 norm (1/T) sum_t ||R_t||_1. The router adds
  lambda * L_reg to its ``aux_loss`` and reports L_reg unweighted as ``losses["l1"]``;

* the controller of lambda (:func:`coef_update`), once per optimiser step,

      lambda_{i+1} = lambda_i * gamma ** sign((1 - k/E) - S_i),

  S_i the measured fraction of zero gates over all MoE layers (and all data-parallel
  ranks, :func:`global_activity`): too dense (S_i below the target) raises lambda, too
  sparse lowers it, exactly on target keeps it (sign 0). gamma = ``l1_rate`` (the
  paper's 1.2) and lambda_0 = ``l1_init`` (1e-8: the initial value in the scripts of a
  public fork of the authors' Megatron code; the paper itself was not at hand).

Choices where the paper leaves room, or where moelab differs:

* k in f_e is ``l1_target`` (the authors' code uses its top-k setting, the same k).
  f counts the router call's tokens: under data parallelism the rank's micro-batch,
  as the authors' code counts its local tokens; only lambda's sparsity is global.
* A gate counts as active when its slot is selected and its weight positive (the
  router's contributors, before any capacity drop). In the ReMoE setting this is
  exactly R_te > 0; with another rule (a top-K cap, a cut above 0) it is the gates the
  token actually uses.
* The paper averages L_reg over the L layers; moelab's model sums the routers'
  auxiliary losses, so the total is lambda * sum_l L_reg,l, as in the authors' Megatron
  code, where each layer adds its own term. The factor L only rescales the lambda the
  controller settles at.
* lambda is one number for the whole model, as in the paper: every router holds it as
  the buffer ``l1_coef`` (saved in checkpoints) and all of them move it alike from the
  same global measurement, so the copies never differ.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moelab import maps
from moelab.maps import compute_dtype
from moelab.routing.balancing import global_load
from moelab.routing.measures import expert_counts
from moelab.routing.output import RouterOutput

__all__ = [
    "active_slots",
    "check",
    "coef_update",
    "global_activity",
    "l1_loss",
    "l1_maps",
    "sparsity",
    "unfit",
]

_PROBE = (-1.0, -0.25, 0.25, 1.0)
"""Scores on which a suitable map gives exact zeros and positive values."""


def unfit(name: str, params: dict) -> str | None:
    """Why the map ``name`` (with parameters ``params``) cannot carry an L1 sparsity
    penalty (None: it can)."""
    record = maps.info(name)
    if record.simplex:
        return "its values sum to 1 for every token"
    if "k" in record.params:
        return "its values sum to its budget k for every token"
    p = record.fn(torch.tensor([_PROBE]), **params)
    if not bool((p == 0).any()) or not bool((p > 0).any()) or bool((p < 0).any()):
        return "its values are never exactly 0 (or can be negative)"
    return None


def l1_maps() -> tuple[str, ...]:
    """The registered maps an L1 penalty can make sparse (``relu`` among moelab's):
    non-negative, unnormalised, with exact zeros."""
    return tuple(n for n, i in maps.registry().items() if unfit(n, i.defaults()) is None)


def check(l1_target: float | None, l1_rate: float, l1_init: float, n_experts: int) -> None:
    """Raise ValueError, saying what to change, for settings of the adaptive L1 that
    cannot work (called when the balancing stage's config is built; what the L1 cannot
    pair with in the other stages, :func:`moelab.routing.pairings.adaptive_l1`)."""
    if not l1_rate > 1 or l1_rate == float("inf"):
        raise ValueError(
            f"l1_rate (gamma of the adaptive L1) must be a finite number > 1, got "
            f"{l1_rate}; the paper uses 1.2"
        )
    if not 0 < l1_init < float("inf"):
        raise ValueError(
            f"l1_init (the L1 coefficient at the start) must be a finite number > 0, got "
            f"{l1_init}; the paper uses 1e-8"
        )
    if l1_target is not None and not 0 < l1_target <= n_experts:
        raise ValueError(
            f"l1_target must lie in (0, n_experts={n_experts}], got {l1_target}: the mean "
            "number of active experts per token the adaptive L1 steers to"
        )


def active_slots(out: RouterOutput) -> torch.Tensor:
    """bool (T, K): the slots whose gate is active, selected with a positive weight (before
    any capacity drop; in the ReMoE setting exactly R_te > 0)."""
    return out.selected_TK & (out.weights_TK.detach() > 0)


def l1_loss(
    gates_TE: torch.Tensor, ids_TK: torch.Tensor, active_TK: torch.Tensor, l1_target: float
) -> torch.Tensor:
    """The load-balanced L1 term of ReMoE, without its coefficient lambda:

        L_reg = sum_e f_e * (1/T) sum_t gates_TE[t, e],   f_e = E / (k T) * count_e,

    count_e the active slots of expert e (``active_TK``), k = ``l1_target``. f is a
    count, so no gradient flows through it: dL/dgates[t, e] = f_e / T.

    Args:
        gates_TE: the map's values R of all E experts, shape (T, E).
        ids_TK: int64 expert ids, shape (T, K).
        active_TK: bool, shape (T, K): the active slots (:func:`active_slots`).
        l1_target: k, the target mean number of active experts per token.

    Returns:
        0-dim tensor in float32 (float64 for float64 gates); 0 without tokens.
    """
    n_tokens, n_experts = gates_TE.shape
    dtype = compute_dtype(gates_TE.dtype)
    if n_tokens == 0:
        return gates_TE.to(dtype).sum()
    f_E = expert_counts(ids_TK, active_TK, n_experts, dtype) * (n_experts / (l1_target * n_tokens))
    return (f_E * gates_TE.to(dtype).mean(0)).sum()


@torch.no_grad()
def global_activity(
    routers: Sequence[nn.Module], outs: Sequence[RouterOutput]
) -> torch.Tensor | None:
    """float64 (2,): (active gates, all gates) of one step, summed over the routers with an
    ``l1_target`` and over the data-parallel ranks (:func:`global_load`), so that every
    rank moves lambda alike; None when no router has one (then no communication).
    ``routers[i]`` (a :class:`~moelab.routing.router.Router`, which holds the buffer
    ``l1_coef`` exactly when it has an ``l1_target``) produced ``outs[i]``. Every rank
    must call it, in the same order."""
    pairs = [
        (r, o)
        for r, o in zip(routers, outs, strict=True)
        if getattr(r, "l1_coef", None) is not None
    ]
    if not pairs:
        return None
    local = torch.zeros(2, dtype=torch.float64, device=pairs[0][1].probs_TE.device)
    for _, out in pairs:
        local[0] += active_slots(out).sum()
        local[1] += out.probs_TE.numel()
    return global_load(local)


def sparsity(activity: torch.Tensor) -> torch.Tensor:
    """S, the fraction of zero gates, from :func:`global_activity`'s (active, all)."""
    return 1 - activity[0] / activity[1].clamp_min(1)


def coef_update(
    coef: torch.Tensor, activity: torch.Tensor, l1_target: float, n_experts: int, rate: float
) -> torch.Tensor:
    """One step of the controller: ``coef * rate ** sign((1 - k/E) - S)``, S the zero
    fraction of ``activity`` = (active, all) gates, k = ``l1_target``.

    The sign is taken exactly on the counts, as sign(active * E - k * all): lambda
    rises when more gates are active than the target (too dense), falls when fewer, and
    stays when exactly on target. No host sync; the result has ``coef``'s dtype and
    carries no autograd history."""
    with torch.no_grad():
        step = torch.sign(activity[0] * n_experts - l1_target * activity[1])
        return coef.detach() * torch.pow(rate, step.to(coef.dtype))
