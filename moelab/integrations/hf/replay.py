"""Routing replay for Hugging Face models with their own routers (not swapped).

:func:`record_hf` keeps the experts each native router module chose, in a
:class:`~moelab.diagnostics.replay.RoutingRecord` (the format of
:mod:`moelab.diagnostics.replay`); :func:`replay_hf` makes each native router choose
the recorded experts instead, while its gate weights come from its own *live*
probabilities at those experts, so that the router's weight receives a gradient:

    with torch.no_grad(), record_hf(model) as rollout:   # e.g. a generate call:
        seq_BS = model.generate(prompt_BS, max_new_tokens=8)  # prefill + decode steps
    with replay_hf(model, rollout):                      # the training forward
        logits = model(seq_BS[:, :-1]).logits            # gates: live probs, recorded ids
    loss.backward()                                      # reaches the gate weights

The two are the native counterparts of :func:`moelab.diagnostics.replay.record` and
:func:`~moelab.diagnostics.replay.replay`, and the records are interchangeable: a record
of a native model replays into a moelab swap of it
(:func:`moelab.integrations.hf.swap.swap_routers`, then ``replay``), and a swapped
model's record into the native one. On a swapped model, :func:`record_hf` and
:func:`replay_hf` are ``record`` and ``replay``.

Under :func:`replay_hf` the router module's own forward still runs (its logits are
the live ones, and the gradient flows through them); its choice is then replaced by the
next T recorded rows and the gate weights are recomputed from those logits at the
recorded experts, with the family's own arithmetic, op for op (:func:`native_gate`):

=============  ==============================================================
family         weights at the recorded experts ``ids_TK``
=============  ==============================================================
mixtral        softmax over all E, gathered, renormalised over the K
qwen2_moe,     softmax over all E, gathered, renormalised iff ``norm_topk_prob``
qwen3_moe,
olmoe
deepseek_v2    softmax over all E, gathered, x ``routed_scaling_factor``
deepseek_v3    sigmoid scores, gathered (the choice bias is not added), renormalised
               iff ``norm_topk_prob`` (+1e-20), x ``routed_scaling_factor``
gpt_oss        the logits (with the router's bias) gathered, softmax over the K
=============  ==============================================================

The weights are always gathered from the probabilities over *all* experts, never from a
row that the family's own choice masked: DeepSeek-V2's group-limited greedy sets the
scores of the experts outside the kept groups to 0 before its top-k, and a replay that
gathered from that row would give a recorded expert outside today's kept groups weight
0 and its score no gradient (the zeroed-gather mistake, docs/replay.md). So replaying a
model's own record into it reproduces its logits bit for bit, and replaying another
choice weighs each recorded expert by what the model's map gives it now.

Recording works for every family whose routers moelab reads
(:func:`moelab.integrations.hf.families.moe_routers`); replaying needs the family's
arithmetic written out, and refuses the ``generic`` families (swap their routers and
replay the swap instead). Layer l of a record is the l-th MoE layer of ``moe_routers``.
Every router call counts, in call order (as in :mod:`moelab.diagnostics.replay`): a
``generate`` call is recorded as its prefill (B x S rows) followed by one call of B
rows per decoded token; :func:`sequence_order` puts such a record in the order of one
forward over the generated sequences.

Shape suffixes: B, S, T, E, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from moelab.diagnostics.replay import RoutingRecord, record, replay, routers_of
from moelab.integrations.hf.families import RouterSite, moe_routers
from moelab.integrations.hf.swap import SWAP_FAMILIES, swapped_routers

__all__ = [
    "NATIVE_REPLAY_FAMILIES",
    "native_gate",
    "record_hf",
    "replay_hf",
    "sequence_order",
]

NATIVE_REPLAY_FAMILIES = SWAP_FAMILIES
"""The families whose native routers :func:`replay_hf` replays (:func:`native_gate`):
those whose routing :func:`~moelab.integrations.hf.swap.swap_routers` reproduces, the
families whose gate moelab knows op for op."""


def native_gate(site: RouterSite, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """The gate weights (T, K) the family of ``site`` gives the experts ``ids_TK`` from
    the router's logits ``logits_TE`` (its live output), with the same operations as the
    family's router module of transformers (module docstring's table): at the router's
    own choice the weights it returns, bit for bit. The probabilities are those over all
    E experts, gathered at ``ids_TK`` (never a top-k-masked row). ValueError for a family
    of no row."""
    family, router = site.family.name, site.router
    if family == "mixtral":
        top_TK = torch.softmax(logits_TE.float(), dim=-1).gather(-1, ids_TK)
        return top_TK / top_TK.sum(dim=-1, keepdim=True)
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        top_TK = torch.softmax(logits_TE, dtype=torch.float, dim=-1).gather(-1, ids_TK)
        if router.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return top_TK.to(logits_TE.dtype)
    if family == "deepseek_v2":
        top_TK = logits_TE.softmax(dim=-1, dtype=torch.float32).gather(-1, ids_TK)
        return top_TK * router.routed_scaling_factor
    if family == "deepseek_v3":
        top_TK = logits_TE.sigmoid().gather(-1, ids_TK)
        if router.norm_topk_prob:
            top_TK = top_TK / (top_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return top_TK * router.routed_scaling_factor
    if family == "gpt_oss":
        top_TK = logits_TE.gather(-1, ids_TK)
        return torch.softmax(top_TK, dim=1, dtype=top_TK.dtype)
    raise ValueError(_refusal(None, site))


def _refusal(model: nn.Module | None, site: RouterSite) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return (
        f"replay_hf cannot replay the native routers of model type {model_type!r} "
        f"(moelab family {site.family.name}: its rule is read from the router on probe "
        f"states, not written out op for op); it replays {', '.join(NATIVE_REPLAY_FAMILIES)}: "
        "swap_routers(model) and replay the swap with moelab.diagnostics.replay"
    )


def _sites(model: nn.Module) -> list[RouterSite]:
    sites = moe_routers(model)
    for site in sites:
        if site.by_token_id:
            raise ValueError(
                f"MoE layer {site.layer} ({site.name}) chooses its experts by token id (a "
                "fixed table), not by a choice of its native router to record or replay; "
                "swap_routers(model) makes it moelab's hash rule, and record / replay "
                "(moelab.diagnostics) take the swapped model"
            )
    return sites


@contextlib.contextmanager
def record_hf(model: nn.Module) -> Iterator[RoutingRecord]:
    """Within the block, keep the experts every native router of ``model`` (a
    transformers MoE model) chose, per MoE layer, the rows of every call concatenated
    in call order (a ``generate`` call: the prefill, then each decode step). The
    yielded record is complete when the block exits (also when it raises, with the calls
    made so far); ``map`` is the family's (``softmax`` or ``sigmoid``), every slot is
    chosen. A model whose routers are swapped is recorded by
    :func:`moelab.diagnostics.replay.record`.

    Forward hooks on the router modules, removed on exit. ValueError: a model of no
    family moelab reads, or a router that chooses by token id."""
    if swapped_routers(model):
        with record(model) as rec:
            yield rec
        return
    sites = _sites(model)
    chunks: list[list[torch.Tensor]] = [[] for _ in sites]

    def keep(site: RouterSite) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            ids_TK = site.read(output).ids_TK
            chunks[site.layer].append(ids_TK.detach().to("cpu", torch.int64).contiguous())

        return hook

    n_experts = sites[0].n_experts
    rec = RoutingRecord([], [], n_experts, 0, sites[0].family.map)
    handles = [s.router.register_forward_hook(keep(s)) for s in sites]
    try:
        yield rec
    except BaseException:
        _fill(rec, chunks, strict=False)
        raise
    else:
        _fill(rec, chunks, strict=True)
    finally:
        for h in handles:
            h.remove()


def _fill(rec: RoutingRecord, chunks: list[list[torch.Tensor]], strict: bool) -> None:
    """``rec`` gets each layer's calls concatenated. ``strict`` (the block exited
    normally): ValueError for calls of different K in one layer; otherwise (it raised)
    such a layer is left empty, and every layer keeps the rows all of them hold."""
    for i, layer in enumerate(chunks):
        widths = sorted({c.shape[1] for c in layer})
        if len(widths) > 1 and strict:
            raise ValueError(
                f"layer {i} chose K = {widths} experts per token inside one record_hf(); "
                "record each K in a record of its own"
            )
        if len(widths) > 1:
            chunks[i] = []
    ids = [torch.cat(c) if c else torch.zeros(0, 0, dtype=torch.int64) for c in chunks]
    n = min((t.shape[0] for t in ids), default=0)
    ids = [t[:n] for t in ids]  # a forward cut short by an error: the rows all layers hold
    chosen = [torch.ones_like(t, dtype=torch.bool) for t in ids]
    full = RoutingRecord(ids, chosen, rec.n_experts, 0, rec.map)
    rec.ids_TK, rec.chosen_TK, rec.consumed = full.ids_TK, full.chosen_TK, full.consumed


def _check_fits(model: nn.Module, rec: RoutingRecord, sites: list[RouterSite]) -> None:
    """The model's family has a row of :func:`native_gate`, and the record its layers
    and experts."""
    for site in sites:
        if site.family.name not in NATIVE_REPLAY_FAMILIES:
            raise ValueError(_refusal(model, site))
    if rec.n_layers != len(sites):
        raise ValueError(
            f"the routing record has {rec.n_layers} MoE layers, the model {len(sites)}: "
            "replay a record of this model"
        )
    for site in sites:
        if (site.n_experts, 0) != (rec.n_experts, rec.n_null):
            raise ValueError(
                f"the routing record has {rec.n_experts} experts (+{rec.n_null} null) per "
                f"layer, the model's layer {site.layer} {site.n_experts}: replay a record "
                "of this model"
            )


def _replayed_forward(rec: RoutingRecord, site: RouterSite) -> Any:
    """The router module's forward under replay: its own call (for the live logits and
    its width K), then the next T recorded rows, weighed by :func:`native_gate`."""
    own_forward = site.router.forward
    layer = site.layer

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = own_forward(*args, **kwargs)
        logits_TE, _, own_ids_TK = site.read(output)
        n_tokens, n_slots = own_ids_TK.shape
        ids_TK = rec.ids_TK[layer]
        start = rec.consumed[layer]
        if start + n_tokens > ids_TK.shape[0]:
            raise ValueError(
                f"layer {layer}: the call routes T={n_tokens} tokens from row {start}, past the "
                f"end of the routing record (T={ids_TK.shape[0]}, K={ids_TK.shape[1]}): replay "
                "the calls that were recorded, in order (rec.rewind() restarts)"
            )
        if ids_TK.shape[1] != n_slots:
            raise ValueError(
                f"layer {layer}: the routing record has K={ids_TK.shape[1]} experts per token, "
                f"the model's router K={n_slots}: replay with the recorded K"
            )
        rec.consumed[layer] = start + n_tokens
        ids_TK = ids_TK[start : start + n_tokens].to(own_ids_TK.device)
        return (output[0], native_gate(site, logits_TE, ids_TK), ids_TK, *output[3:])

    return forward


@contextlib.contextmanager
def replay_hf(model: nn.Module, rec: RoutingRecord) -> Iterator[RoutingRecord]:
    """Within the block, every call of the native router of MoE layer l of ``model``
    takes the next T rows of ``rec``'s layer l as its experts (a cursor per layer,
    :attr:`RoutingRecord.consumed`, from 0 at entry), weighed by the family's gate at
    those experts from the router's live logits (:func:`native_gate`): differentiable
    with respect to the gate weight and the hidden states. Yields ``rec``. A model whose
    routers are swapped replays through :func:`moelab.diagnostics.replay.replay`.

    The router modules' ``forward`` is wrapped on the instance for the block and
    restored on exit, also on error. Forward hooks on the routers (:func:`record_hf`,
    moelab's statistics) see the replayed choice.

    Raises:
        ValueError: at entry, a record of another layer or expert count, a family of no
            row of :func:`native_gate` (one line naming it), nested replays; in a call,
            a T that would run past the record's end or a K that differs from the
            router's.
    """
    if swapped_routers(model):
        routers_of(model)  # the swapped Routers, in the order the record holds them
        with replay(model, rec):
            yield rec
        return
    sites = _sites(model)
    rec.validate()
    _check_fits(model, rec, sites)
    if any("forward" in s.router.__dict__ for s in sites):
        raise ValueError("this model is replaying a routing record already; nest no replay")
    rec.rewind()
    try:
        for site in sites:
            site.router.forward = _replayed_forward(rec, site)
        yield rec
    finally:
        for site in sites:
            site.router.__dict__.pop("forward", None)


def sequence_order(rec: RoutingRecord, batch: int, prompt_len: int) -> RoutingRecord:
    """A record of one ``generate`` call on ``batch`` prompts of ``prompt_len`` tokens
    (a prefill of B x S rows, then calls of B rows, one per decoded token, as
    :func:`record_hf` keeps them) in the order of one forward over the generated
    sequences less their last token (``seq_BS[:, :-1]``, the positions whose logits
    score the generated tokens): sequence b's prompt rows, then its decoded rows. A new
    record; ``rec`` is unchanged. With ``batch`` = 1 the order is the same.

    ValueError when the record's rows are not B x S plus a multiple of B."""
    n_prompt = batch * prompt_len
    extra = rec.tokens - n_prompt
    if batch < 1 or prompt_len < 1 or extra < 0 or extra % batch:
        raise ValueError(
            f"a generate record of {batch} prompts of {prompt_len} tokens holds B x S = "
            f"{n_prompt} prefill rows plus B rows per decode step; this record holds "
            f"{rec.tokens} rows"
        )
    steps = extra // batch

    def reorder(t_TK: torch.Tensor) -> torch.Tensor:
        prompt_BSK = t_TK[:n_prompt].reshape(batch, prompt_len, -1)
        decoded_BSK = t_TK[n_prompt:].reshape(steps, batch, -1).transpose(0, 1)
        return torch.cat([prompt_BSK, decoded_BSK], dim=1).reshape(-1, t_TK.shape[1])

    margins = None if rec.margins_T2 is None else [reorder(m) for m in rec.margins_T2]
    token_ids = None if rec.token_ids is None else reorder(rec.token_ids[:, None])[:, 0]
    return RoutingRecord(
        [reorder(t) for t in rec.ids_TK],
        [reorder(t) for t in rec.chosen_TK],
        rec.n_experts,
        rec.n_null,
        rec.map,
        token_ids=token_ids,
        margins_T2=margins,
        seq_len=prompt_len + steps,
    )
