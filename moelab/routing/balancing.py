"""Load balancing: auxiliary losses, capacity limits, bias balancing, load statistics.

Pure tensor functions, no modules and no state: the router calls them with what
it computed and keeps whatever state (the selection bias) itself. Two of them
communicate: :func:`global_load` sums a load over the data-parallel ranks (a no-op
in one process), which the bias update and the ``"global"`` scope of the Switch loss
use, and :func:`global_mean` averages quantile balancing's bias over the ranks.

Shape suffixes: B, S, T, E, K, J (moelab.shapes); here J is slot-major (j = k * T + t),
B the token sets of the Switch loss (sequences) and S the tokens of one set.

A slot ``(t, k)`` names expert ``ids_TK[t, k]``; it counts only where
``selected_TK[t, k]`` (unused slots of a truncating router hold expert 0).

Methods and papers:
    - Switch balancing loss E * sum_i f_i P_i
      (Fedus, Zoph, Shazeer, 2021, https://arxiv.org/abs/2101.03961).
    - Its scopes (:func:`scoped_switch_loss`): per micro-batch (Switch), per sequence
      (DeepSeek-V3, https://arxiv.org/abs/2412.19437) and with f counted over the global
      batch of all data-parallel ranks (Qiu et al., 2025, *Demons in the Detail*,
      https://arxiv.org/abs/2501.11873), the second place that communicates.
    - Router z-loss mean_t logsumexp(z_t)^2
      (Zoph et al., ST-MoE, 2022, https://arxiv.org/abs/2202.08906).
    - Capacity factor with token dropping
      (Lepikhin et al., GShard, 2020, https://arxiv.org/abs/2006.16668; Switch).
    - Auxiliary-loss-free bias balancing
      (Wang et al., 2024, https://arxiv.org/abs/2408.15664; DeepSeek-V3,
      https://arxiv.org/abs/2412.19437); under data parallelism the bias follows the
      load summed over the ranks (:func:`global_load`), the one place where balancing
      communicates.
    - Quantile balancing (Megatron-Core, 2026, after Su Jianlin, *MoE Odyssey 6*,
      https://kexue.fm/archives/11619): the selection bias set once per global batch to
      the quantile of the scores that gives each expert its share of the slots
      (:func:`quantile_bias`, :func:`quantile_update`); under data parallelism the
      ranks' biases are averaged (:func:`global_mean`), as Megatron does.
    - Bias-driven control of null (zero-computation) experts toward a target number of
      real experts per token (:func:`null_target_update`; Meituan LongCat Team, 2025,
      *LongCat-Flash Technical Report*, https://arxiv.org/abs/2509.01322).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moelab.maps import compute_dtype
from moelab.maps.softmax import rows_softmax
from moelab.routing.measures import check_slots, expert_counts, load_cv

__all__ = [
    "aux_source",
    "bias_update",
    "capacity",
    "capacity_drop",
    "check_capacity_factor",
    "entropy_loss",
    "expert_counts",
    "global_load",
    "global_mean",
    "load_stats",
    "quantile_bias",
    "quantile_update",
    "scoped_switch_loss",
    "switch_loss",
    "top1_slots",
    "z_loss",
]


def switch_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    n_experts: int,
) -> torch.Tensor:
    """Switch Transformer balancing loss, without its weight alpha.

    L = E * sum_i f_i * P_i, where

    - f_i = (selected slots routed to expert i) / (all selected slots), the
      fraction of the dispatch that expert i receives; a count, hence a
      constant: no gradient flows through f;
    - P_i = (1/T) sum_t probs_TE[t, i], the mean router probability of expert
      i; the gradient flows through P only: dL/dprobs[t, i] = E * f_i / T.

    With balanced dispatch (f_i = 1/E) and probabilities that sum to 1 per
    token, L = 1 whatever the probabilities; L = 1 also for uniform
    probabilities whatever the dispatch. As f is constant, the gradient lowers
    each P_i in proportion to f_i: probability moves off the busiest experts.

    The caller chooses P (RouterConfig.aux_probs): the router's own map
    ("map": e.g. sparsemax or entmax values, whose zeros give no gradient to
    the experts outside the support), or softmax of the same logits
    ("softmax": dense gradient to every expert), the two options the papers
    compare. With a map whose values do not sum to 1 (sigmoid; LapSum, whose
    values sum to k) balanced dispatch gives L = sum_i P_i (k for LapSum), not 1.

    Which slots count in f is the caller's choice too: the Switch Transformer
    counts the dispatch before the capacity limit (every selected slot,
    dropped or not), which is what passing ``selected_TK`` gives.

    Args:
        probs_TE: router probabilities of all E experts, shape (T, E).
        ids_TK: int64 expert ids, shape (T, K).
        selected_TK: bool, shape (T, K): slots that hold a selected expert.
        n_experts: E.

    Returns:
        0-dim tensor in float32 (float64 for float64 probs); 0 when no slot
        is selected or there are no tokens.
    """
    check_slots(ids_TK, selected_TK, n_experts)
    if probs_TE.dim() != 2 or probs_TE.shape != (ids_TK.shape[0], n_experts):
        raise ValueError(
            f"probs_TE must have shape (T, E) = ({ids_TK.shape[0]}, {n_experts}), "
            f"got {tuple(probs_TE.shape)}"
        )
    return scoped_switch_loss(probs_TE, ids_TK, selected_TK, n_experts, "micro_batch")


def aux_source(aux_probs: str, logits_TE: torch.Tensor, probs_TE: torch.Tensor) -> torch.Tensor:
    """The P of the Switch loss (``RouterConfig.aux_probs``): ``"map"`` the map's values,
    ``"softmax"`` a softmax of the logits, ``"normalized"`` the map's values divided by
    their sum over the E experts per token (DeepSeek-V3's P for sigmoid affinities: a
    normalised over all E; a row of no mass, relu of all-negative scores, gives 0)."""
    if aux_probs == "softmax":
        return rows_softmax(logits_TE)  # torch's softmax, faster for E < 16 on the CPU
    if aux_probs == "normalized":
        total_T1 = probs_TE.sum(-1, keepdim=True)
        tiny = torch.finfo(probs_TE.dtype).tiny
        return torch.where(total_T1 > 0, probs_TE / total_T1.clamp_min(tiny), 0)
    if aux_probs != "map":
        raise ValueError(f"aux_probs must be 'map', 'softmax' or 'normalized', got {aux_probs!r}")
    return probs_TE


def top1_slots(
    probs_TE: torch.Tensor, ids_TK: torch.Tensor, chosen_TK: torch.Tensor
) -> torch.Tensor:
    """The slot of each token's top-1 expert (``RouterConfig.aux_count="top1"``): bool
    (T, K), True at the chosen slot whose map value ``probs_TE[t, ids_TK[t, k]]`` is
    largest (ties: the earlier slot), none for a token with no chosen slot. With it the
    Switch loss's f_i is the fraction of tokens whose top-1 expert is i (Switch's f, the
    temperature paper's eq. 6) instead of the fraction of all selected slots."""
    value_TK = probs_TE.detach().gather(-1, ids_TK.long())
    value_TK = torch.where(chosen_TK, value_TK, float("-inf"))
    best_T = value_TK.argmax(dim=-1)
    one_TK = torch.nn.functional.one_hot(best_T, ids_TK.shape[-1]).bool()
    return one_TK & chosen_TK.any(dim=-1, keepdim=True)


def _balance_term(counts_BE: torch.Tensor, probs_BSE: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e P_e of each of B token sets (f from the counts, P the mean of the S
    tokens' probabilities), averaged over the B sets."""
    f_BE = counts_BE / counts_BE.sum(-1, keepdim=True).clamp_min(1)  # no grad: counts
    return probs_BSE.shape[-1] * (f_BE * probs_BSE.mean(-2)).sum(-1).mean()


def scoped_switch_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    n_experts: int,
    scope: str,
    seq_len: int | None = None,
) -> torch.Tensor:
    """The Switch loss E * sum_i f_i P_i (:func:`switch_loss`, without its weight) over
    the token set of ``scope`` (``RouterConfig.aux_scope``):

    ``"micro_batch"``
        f and P over the T tokens of the call. Under data parallelism "the batch" is the
        rank's micro-batch (batch and sequence flattened), as in Switch.
    ``"sequence"``
        DeepSeek-V3's sequence-wise loss: the T = B * S tokens are B sequences of
        ``seq_len`` = S tokens laid out sequence-major (as the model flattens (B, S, D));
        for each sequence f_i is its share of the sequence's selected slots and P_i the
        mean over the sequence, and the loss is the mean over the B sequences. With K
        slots selected per token, E * f_i = E / (K S) * (count of i in the sequence), the
        report's f_i, so this is the report's sum_i f_i P_i per sequence. With
        ``seq_len`` None (tokens given as (T, D), no sequence structure known) the call
        counts as one sequence: the same value as ``"micro_batch"``. The loss reads the
        whole sequence (a training-time term; the routing itself stays causal).
    ``"global"``
        Qiu et al., 2025 (*Demons in the Detail*, https://arxiv.org/abs/2501.11873): f_i
        is counted over the global batch, the selected slots of every data-parallel rank
        (:func:`global_load`, an all-reduce of the counts that every rank must reach
        alike), while P_i stays the mean over the rank's own T tokens. In one process it
        equals ``"micro_batch"``. With DDP's averaging of the gradients over R ranks of
        equal T, the step equals that of one process on the concatenated batch. Gradient
        accumulation is not looked at (moelab's training takes one micro-batch per
        step).

    The counts carry no gradient (f is a constant); the gradient flows through P. f counts
    the selected slots before any capacity limit (as :func:`switch_loss`).

    Args:
        probs_TE: the P source, shape (T, E) (:func:`aux_source`).
        ids_TK, selected_TK: the selected slots, shape (T, K).
        n_experts: E.
        scope: "micro_batch", "sequence" or "global".
        seq_len: S for ``"sequence"`` (must divide T); None: one sequence.

    Returns:
        0-dim tensor in float32 (float64 for float64 probs); 0 when there are no tokens.
    """
    check_slots(ids_TK, selected_TK, n_experts)
    n_tokens = ids_TK.shape[0]
    if probs_TE.dim() != 2 or probs_TE.shape != (n_tokens, n_experts):
        raise ValueError(
            f"probs_TE must have shape (T, E) = ({n_tokens}, {n_experts}), "
            f"got {tuple(probs_TE.shape)}"
        )
    if scope not in ("micro_batch", "sequence", "global"):
        raise ValueError(f"scope must be 'micro_batch', 'sequence' or 'global', got {scope!r}")
    dtype = compute_dtype(probs_TE.dtype)
    probs = probs_TE.to(dtype)
    if n_tokens == 0:  # no tokens: the mean P would be 0/0
        return probs.sum()
    if scope == "sequence" and seq_len is not None:
        if seq_len <= 0 or n_tokens % seq_len:
            raise ValueError(f"seq_len = {seq_len} must be positive and divide T = {n_tokens}")
        n_seqs = n_tokens // seq_len
        # counts per (sequence, expert): the slots of sequence b go to bins b * E + e
        seq_TK = (torch.arange(n_tokens, device=ids_TK.device) // seq_len).unsqueeze(-1)
        counts_BE = expert_counts(
            seq_TK * n_experts + ids_TK.long(), selected_TK, n_seqs * n_experts, dtype
        ).reshape(n_seqs, n_experts)
        return _balance_term(counts_BE, probs.reshape(n_seqs, seq_len, n_experts))
    counts_E = expert_counts(ids_TK, selected_TK, n_experts)
    if scope == "global":
        counts_E = global_load(counts_E)
    return _balance_term(counts_E.to(dtype).unsqueeze(0), probs.unsqueeze(0))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss of ST-MoE: L_z = (1/T) sum_t (log sum_i exp z_ti)^2.

    Penalises large logits (keeps the router's softmax numerically tame) without
    changing which expert wins. Gradient: dL/dz_ti = 2 lse(z_t) softmax(z_t)_i / T.

    Args:
        logits_TE: router logits (after temperature), shape (T, E); -inf entries
            (masked experts) are allowed as long as a row keeps a finite one.

    Returns:
        0-dim tensor in float32 (float64 for float64 logits).
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must have shape (T, E), got {tuple(logits_TE.shape)}")
    lse_T = torch.logsumexp(logits_TE.to(compute_dtype(logits_TE.dtype)), dim=-1)
    return lse_T.square().mean()


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots each expert accepts: C = ceil(capacity_factor * T * K / E).

    NOTE: computed exactly on the decimal value of ``capacity_factor``
    (Fraction(repr(cf))), so that e.g. cf=1.1, T=10, K=1, E=11 gives 1 and
    not 2 from the rounding of 1.1 * 10 / 11 = 1.0000000000000002.
    """
    if n_tokens < 0 or top_k <= 0 or n_experts <= 0:
        raise ValueError(
            f"need n_tokens >= 0, top_k > 0 and n_experts > 0, got {n_tokens}, {top_k}, {n_experts}"
        )
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor}")
    num, den = decimal_ratio(float(capacity_factor))
    return -(-num * n_tokens * top_k // (den * n_experts))  # integer ceiling


def decimal_ratio(x: float) -> tuple[int, int]:
    """``(num, den)`` with num / den the decimal value of ``repr(x)`` exactly (1.1 ->
    (11, 10)), for a finite x >= 0: what ``Fraction(repr(x))`` gives, in string and
    integer operations only, so that ``torch.compile`` traces it as constants."""
    mantissa, _, exponent = repr(x).lower().partition("e")
    whole, _, frac = mantissa.partition(".")
    num, den = int(whole + frac), 10 ** len(frac)
    shift = int(exponent) if exponent else 0
    return (num * 10**shift, den) if shift >= 0 else (num, den * 10**-shift)


def check_capacity_factor(capacity_factor: float | None) -> None:
    """ValueError unless ``capacity_factor`` is None (dropless) or > 0."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}"
        )


def capacity_drop(
    ids_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    n_experts: int,
    capacity_factor: float | None,
) -> torch.Tensor:
    """Slots refused by the capacity limit (Switch / GShard token dropping).

    Each expert accepts at most C = capacity(T, K, E, capacity_factor) slots.
    Slots are admitted in slot-major priority order: every token's first
    choice (k=0) in token order, then every token's second choice (k=1) in
    token order, and so on; so a token's second choice is dropped before a
    later token's first choice is. A selected slot that finds its expert full
    is dropped. Unselected slots are never dropped and take no capacity.

    dropped[t, k] = selected[t, k] and
        #{(t', k') selected, ids[t', k'] = ids[t, k], (k', t') < (k, t)} >= C

    Vectorised: a stable sort of the slots flattened in (k, t) order by expert
    (unselected slots get the key E, after every expert) gives each slot its
    rank within its expert as (sorted position - start of its expert's run).

    Args:
        ids_TK: int64 expert ids, shape (T, K).
        selected_TK: bool, shape (T, K).
        n_experts: E.
        capacity_factor: the factor in C; None: dropless, nothing is dropped.

    Returns:
        bool tensor of shape (T, K).
    """
    check_slots(ids_TK, selected_TK, n_experts)
    if capacity_factor is None:
        return torch.zeros_like(selected_TK)
    n_tokens, top_k = ids_TK.shape
    if top_k == 0:
        return torch.zeros_like(selected_TK)
    cap = capacity(n_tokens, top_k, n_experts, capacity_factor)
    # Flatten in priority order: index j = k * T + t.
    key_J = torch.where(selected_TK, ids_TK.long(), n_experts).t().reshape(-1)
    sorted_key_J, order_J = torch.sort(key_J, stable=True)
    run_len_E = expert_counts(ids_TK, selected_TK, n_experts, torch.int64)
    # (E + 1,): where the run of each expert, then of the unselected slots, starts
    run_start = torch.cat([run_len_E.new_zeros(1), run_len_E.cumsum(0)])
    n_slots = key_J.numel()
    rank_J = torch.arange(n_slots, device=key_J.device) - run_start[sorted_key_J]
    dropped_sorted_J = (rank_J >= cap) & (sorted_key_J < n_experts)
    dropped_J = torch.empty_like(dropped_sorted_J)
    dropped_J[order_J] = dropped_sorted_J
    return dropped_J.reshape(top_k, n_tokens).t().contiguous()


def _check_update(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float, shape: str) -> None:
    """ValueError unless the bias and the load are 1-D of one shape and the rate >= 0."""
    if bias_E.dim() != 1 or load_E.shape != bias_E.shape:
        raise ValueError(
            f"bias_E and load_E must both have shape {shape}, "
            f"got {tuple(bias_E.shape)} and {tuple(load_E.shape)}"
        )
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")


def bias_update(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """One step of auxiliary-loss-free balancing (DeepSeek-V3).

    b_i <- b_i + rate * sign(mean_j(load_j) - load_i)

    An underloaded expert (load below the mean) gets a larger bias and is
    selected more often; an overloaded one a smaller bias; an expert exactly at
    the mean keeps its bias. The bias is added to the scores for *selection
    only*: the gate weights come from the unbiased scores. It is not trained by
    gradient: the result carries no autograd history.

    Args:
        bias_E: current selection bias, shape (E,).
        load_E: per-expert load of the last batch, shape (E,). Prefer counts
            (e.g. ``expert_counts``): their mean is exact, so an expert exactly
            at the mean gets sign 0; shares can round to a spurious +-1.
        rate: the update speed gamma (RouterConfig.bias_rate), >= 0.

    Returns:
        a new tensor of shape (E,), dtype and device of ``bias_E``; the input is
        left unchanged.
    """
    _check_update(bias_E, load_E, rate, "(E,)")
    with torch.no_grad():
        load = load_E.to(torch.float64)  # exact for counts: an expert at the mean gets sign 0
        step_E = torch.sign(load.mean() - load).to(bias_E.dtype)
        return bias_E.detach() + rate * step_E


def null_target_update(
    bias_E: torch.Tensor,
    load_E: torch.Tensor,
    n_experts: int,
    top_k: int,
    target: float,
    rate: float,
) -> torch.Tensor:
    """One step of bias-driven control of null experts (after LongCat-Flash's
    computation budget control, here with moelab's sign update).

    With E real experts, M null ones (ids E .. E + M - 1) and K slots per token, every
    slot chosen (top-K), the real experts a token reaches on average are

        r = K * sum_{i < E} load_i / sum_i load_i

    and the update is

        b_i <- b_i + rate * sign(mean_{j < E} load_j - load_i)   for i < E (as bias_update)
        b_m <- b_m + rate * sign(r - target)                     for every null m

    so the null experts become likelier while tokens reach more real experts than the
    target and less likely while they reach fewer; the real experts are balanced among
    themselves. The null experts all move alike (they are not balanced among
    themselves). r is a ratio of counts, so counts summed over the data-parallel ranks
    (:func:`global_load`) give the global batch's r.

    Args:
        bias_E: current selection bias, shape (E + M,).
        load_E: chosen slots per expert, real and null, shape (E + M,).
        n_experts: E, the real experts (the first E entries).
        top_k: K, the slots of each token.
        target: the mean number of real experts per token, in (0, K).
        rate: the update speed (RouterConfig.bias_rate), >= 0.

    Returns:
        a new tensor of shape (E + M,), without autograd history. A batch without load
        leaves the bias unchanged.
    """
    _check_update(bias_E, load_E, rate, "(E + M,)")
    if not 0 < n_experts < bias_E.numel():
        raise ValueError(
            f"n_experts = {n_experts} must leave at least one null expert among the "
            f"{bias_E.numel()} biases"
        )
    with torch.no_grad():
        load = load_E.to(torch.float64)
        out = bias_E.detach().clone()
        total = load.sum()
        if not bool(total > 0):
            return out
        real = load[:n_experts]
        # NOTE: r - target compared as K * real - target * total, exact for counts
        excess = top_k * real.sum() - target * total
        out[:n_experts] += rate * torch.sign(real.mean() - real).to(bias_E.dtype)
        out[n_experts:] += rate * torch.sign(excess).to(bias_E.dtype)
        return out


def quantile_bias(rank_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """The selection bias of quantile balancing (Megatron-Core, 2026): the bias that,
    on this batch, gives each expert its share of the T * K slots, from a quantile of
    the scores; one step of a dual coordinate descent.

    Read from Megatron-LM's ``qb_dual_update`` (megatron/core/transformer/moe/
    moe_utils.py; the router's ``quantile_balancing`` in moe/router.py and the
    per-global-batch update ``_update_router_qb_beta`` in
    megatron/core/distributed/finalize_model_grads.py), after Su Jianlin's "MoE Odyssey
    6: optimal allocation for equilibrium" (https://kexue.fm/archives/11619). Megatron
    subtracts its bias beta from the logits; moelab adds b = -beta to the ranking scores
    r (``rank_by``: the logits or the map's values).

    A token t takes its K best experts by r_t + b. Expert e enters token t's top K,
    the other experts' biases held, exactly when r_te + b_e beats the token's cutoff
    for e,

        c_te = the K-th largest of r_tj + b_j over the experts j != e

    which is the (K + 1)-th largest of r_t + b for a token whose top K holds e, and
    the K-th largest (the expert e would displace) for one whose top K does not. With
    the margins m_te = r_te - c_te, e is taken by exactly the tokens with m_te > -b_e,
    so the bias at which e is taken by n tokens, n = round(T * K / E) its share of the
    slots, is minus a quantile of e's margins over the tokens:

        b_e = -(m_(n),e + m_(n+1),e) / 2

    with m_(j),e the j-th largest margin of expert e: midway between the n-th and the
    (n + 1)-th, so that a float rounding of the bias cannot move the token at the
    boundary. Two choices differ from Megatron's: it takes every token's (K + 1)-th
    score as the cutoff for every expert and the (n + 1)-th margin itself. Its cutoff
    ties every token whose (K + 1)-th expert is e at the margin -b_e, where the quantile
    often falls, and overstates e's margins where e would have to displace the K-th;
    the cutoff without e is each expert's exact best response (on a frozen batch of
    512 tokens, E = 16, K = 4, the repeated step reaches a load CV of 0 where Megatron's
    stays at a few thousandths). Each expert gets n tokens with the other biases held;
    all move at once, so the loads after the step are near, not at, the target, and
    repeating the step on the same scores converges to it (Su's alternating quantiles).

    Args:
        rank_TE: the scores the selection ranks by, before the bias, shape (T, E).
        bias_E: the current selection bias, shape (E,).
        top_k: K, the slots of each token.

    Returns:
        shape (E,), dtype and device of ``bias_E``, no autograd history: b for this
        batch, not yet averaged over ranks, blended or centred
        (:func:`quantile_update`). With fewer than two tokens, or K >= E (every expert
        is taken by every token), there is nothing to balance: ``bias_E`` itself.
    """
    if rank_TE.dim() != 2 or bias_E.shape != rank_TE.shape[-1:]:
        raise ValueError(
            f"rank_TE must have shape (T, E) and bias_E shape (E,), got "
            f"{tuple(rank_TE.shape)} and {tuple(bias_E.shape)}"
        )
    n_tokens, n_experts = rank_TE.shape
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    with torch.no_grad():
        if n_tokens < 2 or top_k >= n_experts:
            return bias_E.detach().clone()
        dtype = torch.promote_types(compute_dtype(rank_TE.dtype), bias_E.dtype)
        rank = rank_TE.detach().to(dtype)
        top = (rank + bias_E.to(dtype)).topk(top_k + 1, dim=-1)
        kth_T1, next_T1 = top.values[:, top_k - 1 : top_k], top.values[:, top_k:]
        taken_TE = torch.zeros_like(rank, dtype=torch.bool).scatter_(
            1, top.indices[:, :top_k], True
        )
        margin_TE = rank - torch.where(taken_TE, next_T1, kth_T1)
        # NOTE: integer arithmetic, round half up: T * K / E slots per expert
        n = min(max((2 * n_tokens * top_k + n_experts) // (2 * n_experts), 1), n_tokens - 1)
        top_2E = margin_TE.topk(n + 1, dim=0).values[n - 1 :]
        return (-(top_2E[0] + top_2E[1]) / 2).to(bias_E.dtype)


def quantile_update(bias_E: torch.Tensor, target_E: torch.Tensor, ema: float) -> torch.Tensor:
    """The next bias of quantile balancing: the bias ``target_E`` of
    :func:`quantile_bias` (averaged over the data-parallel ranks, :func:`global_mean`),
    blended with the current one and centred, as Megatron-Core's
    ``_update_router_qb_beta`` does:

        b <- ema * b + (1 - ema) * target,   then   b <- b - mean_e(b)

    Top-K of r + b does not change when every b_e moves alike, so centring changes no
    choice; it keeps the bias from drifting. ``ema`` in [0, 1)
    (``RouterConfig.bias_ema``; 0: the target alone).

    Returns:
        a new tensor of shape (E,), dtype and device of ``bias_E``, no autograd history.
    """
    _check_update(bias_E, target_E, 0.0, "(E,)")
    if not 0 <= ema < 1:
        raise ValueError(f"ema must lie in [0, 1), got {ema}")
    with torch.no_grad():
        new = ema * bias_E.detach().to(torch.float64) + (1 - ema) * target_E.to(torch.float64)
        return (new - new.mean()).to(bias_E.dtype)


def global_load(load_E: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The per-expert load summed over the ranks of ``group`` (None: the default
    process group), for state that every rank must update alike from the whole global
    batch: the bias of :func:`bias_update`.

    Under data parallelism each rank routes its own share of the batch; a bias updated
    from a rank's local load would follow that share only (and DDP's broadcast of
    buffers would then keep rank 0's). Summing the counts gives every rank the load of
    the global batch, hence the same update as one process on that batch. The sum runs
    in float64, exact for counts up to 2**53.

    Without a process group (or with one rank) ``load_E`` itself is returned: no
    communication and no copy. Every rank must call it, in the same order.

    Args:
        load_E: this rank's load, shape (E,) (e.g. :func:`expert_counts`).
        group: the ranks that share the batch; None for all of them.

    Returns:
        shape (E,): the load of the global batch (float64 when summed across ranks).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return load_E
    total_E = load_E.detach().to(torch.float64, copy=True)
    dist.all_reduce(total_E, op=dist.ReduceOp.SUM, group=group)
    return total_E


def global_mean(value_E: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of ``value_E`` over the ranks of ``group`` (None: the default process
    group), in float64; ``value_E`` itself without a process group or with one rank.

    Quantile balancing's global view (:func:`quantile_bias`): the exact quantile of the
    global batch's margins would need every rank's (T, E) margins, or a search with a
    collective per step; like Megatron-Core (an AVG all-reduce of the ranks' quantiles in
    ``_update_router_qb_beta``), moelab averages each rank's bias instead, one collective
    of E numbers. In one process it is the exact quantile. Every rank must call it, in
    the same order."""
    total_E = global_load(value_E, group)  # the sum over the ranks, in float64
    if total_E is value_E:  # no process group, or one rank
        return value_E
    return total_E / dist.get_world_size(group)


def _share_stats(counts_E: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    share_E = counts_E / counts_E.sum().clamp_min(1)
    return {
        f"{prefix}_share_E": share_E,
        f"{prefix}_sd": share_E.std(correction=0),  # population std
        f"{prefix}_cv": load_cv(share_E),
        f"{prefix}_max_over_mean": share_E.max() / share_E.mean(),
    }


def load_stats(
    ids_TK: torch.Tensor,
    selected_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    n_experts: int,
) -> dict[str, torch.Tensor]:
    """Per-expert load shares and their imbalance, nominal and contributor.

    Nominal load counts every selected slot (a zero-weight filler included);
    contributor load counts the selected slots with weight > 0:

        nominal_i = #{(t, k): selected[t, k], ids[t, k] = i}
        contrib_i = #{(t, k): selected[t, k], weights[t, k] > 0, ids[t, k] = i}
        share_i   = load_i / sum_j load_j
        sd        = sqrt((1/E) sum_i (share_i - 1/E)^2)      (population std)
        cv        = sd / mean_i(share_i) = std(load) / mean(load)
        max_over_mean = max_i share_i / mean_i share_i

    Capacity drops are not looked at: pass ``selected_TK & ~dropped_TK`` for
    the load the experts actually computed.

    Args:
        ids_TK: int64 expert ids, shape (T, K).
        selected_TK: bool, shape (T, K).
        weights_TK: gate weights, shape (T, K).
        n_experts: E.

    Returns:
        float32 tensors (no autograd history), keys
        ``nominal_share_E``, ``contrib_share_E`` (shape (E,)) and the 0-dim
        ``nominal_sd``, ``contrib_sd``, ``nominal_cv``, ``contrib_cv``,
        ``nominal_max_over_mean``, ``contrib_max_over_mean``. With no selected
        (or no contributing) slot the shares are 0 and cv and max_over_mean are
        NaN (an imbalance of no load is undefined).
    """
    check_slots(ids_TK, selected_TK, n_experts)
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(
            f"weights_TK shape {tuple(weights_TK.shape)} must equal ids_TK shape "
            f"{tuple(ids_TK.shape)}"
        )
    with torch.no_grad():
        contrib_TK = selected_TK & (weights_TK > 0)
        return {
            **_share_stats(expert_counts(ids_TK, selected_TK, n_experts), "nominal"),
            **_share_stats(expert_counts(ids_TK, contrib_TK, n_experts), "contrib"),
        }


def entropy_loss(probs_TE: torch.Tensor) -> torch.Tensor:
    """The dynamic loss of top-p routing: the mean over tokens of -sum_e p_e log p_e,
    with 0 log 0 = 0 and a finite gradient where p = 0 (a masked expert, or one outside
    a sparse map's support)."""
    # NOTE: xlogy(p, p) and entr(p) give 0/0 or inf*0 = NaN gradients at p = 0
    log_TE = probs_TE.clamp_min(torch.finfo(probs_TE.dtype).tiny).log()
    return -(probs_TE * log_TE).sum(-1).mean()
