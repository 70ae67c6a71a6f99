"""Invariance: does a token's routing depend on what else the forward pass holds?

A few texts of the data (``n_texts`` pieces of ``length`` tokens) are each routed alone,
the reference, and then in these settings, each compared token by token with the
reference (the text's own tokens only):

``batch``
    the texts together in one batch (text i at row i);
``batch_position``
    the same batch rolled by 1 .. n - 1 rows, so each text sits at every other row;
``pad_right`` / ``pad_left``
    the text alone with ``pad`` pad tokens after / before it. A Hugging Face model gets
    an attention mask, and with left padding the position ids that ``generate`` gives
    (the mask's cumulative sum). moelab's Transformer has neither: with right padding
    its causal attention keeps the pads out of the text's context, so the whole model
    runs; with left padding the text would attend to the pads at shifted positions, so
    the analysis routes at the router level instead: each MoE layer's router gets the
    pad tokens' own router inputs followed by the text's reference inputs;
``decode`` / ``chunked``
    a Hugging Face model: the text one token at a time, then ``chunk`` tokens at a time,
    with the KV cache (against the whole text in one forward, the prefill). moelab's
    Transformer has no KV cache: not applicable there, with that reason;
``router_decode`` / ``router_chunked``
    moelab's stand-in (``level: "router"``): each MoE layer's router routes the text's
    reference inputs one token (``chunk`` tokens) per call, the part of decoding the
    router itself can change (a Hugging Face model: not applicable, see decode);
``recompute``
    training mode under activation recomputation (``torch.utils.checkpoint``,
    non-reentrant: moelab's blocks wrapped as ``--checkpoint-activations`` wraps them,
    a Hugging Face model's ``gradient_checkpointing_enable``): the texts in one batch,
    forward and backward; the routing of the recomputed forward against the original.

Per setting and MoE layer: ``changed``, the share of tokens whose *computed* experts
(selected, non-zero gate weight, not dropped by a capacity limit) differ; of them
``selected_changed`` (the used experts, drops ignored) and ``dropped_changed`` (the
capacity drops differ); and the margins of the reference ranking (the scores the rule
ranks by: the logits, or the map's values, plus the balancing bias): ``top2`` = r(1) -
r(2), and ``kk1`` = r(K) - r(K+1) with K the token's selected slots, summarised for the
changed tokens and for the rest. A changed token is a ``tie`` when its K/K+1 margin is
exactly 0, and ``near_tie`` when the margin is at most twice the largest change of its
ranking scores (``delta``): the arithmetic of another batch shape can move it across.
A change that is neither comes from a mechanism that reads the batch
(:func:`batch_mechanisms`: capacity dropping, expert choice, Sinkhorn, sampling), which
the document names. ``verdict`` per setting: ``invariant`` (no change), ``ties``
(exact ties only), ``near-ties`` (only tokens within the arithmetic's reach), or
``batch-dependent``.

Shape suffixes: B, S, T, D, E, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moelab.diagnostics.analysis.source import RoutingSource
from moelab.routing.output import RouterOutput

__all__ = ["SETTINGS", "InvarianceCounts", "batch_mechanisms", "invariance"]

SETTINGS = (
    "batch", "batch_position", "pad_right", "pad_left", "decode", "chunked", "router_decode",
    "router_chunked", "recompute",
)  # fmt: skip
"""The settings, in the order of the document."""


class NotApplicable(Exception):
    """A setting this source cannot run, with the reason."""


# -- what each mechanism does to batch invariance -------------------------------------------


def batch_mechanisms(source: RoutingSource) -> list[dict[str, Any]]:
    """The mechanisms of ``source``'s routers that make a token's experts depend on the
    other tokens of the call (or on random draws): ``{"mechanism", "key", "value",
    "when": "always" | "training", "why"}`` each; ``[]`` for routers that are
    batch-invariant by construction. A Hugging Face family's own router is top-K per
    token (no capacity in the families moelab reads), so it lists nothing."""
    from moelab.routing import selection
    from moelab.routing.router import Router

    found: dict[str, dict[str, Any]] = {}
    for r in source.routers:
        if not isinstance(r, Router):
            continue
        c = r.config
        rule = selection.get(c.selection)
        if rule.reads_batch:
            label = rule.name.replace("_", " ")
            found[label] = dict(
                key="selection", value=rule.name, when=rule.reads_batch,
                why=rule.reads_batch_why,
            )  # fmt: skip
        if c.capacity_factor is not None and rule.reads_batch != "always":
            found["capacity dropping"] = dict(
                key="capacity_factor", value=c.capacity_factor, when="always",
                why="each expert computes at most ceil(cf T K / E) slots of the call, "
                "admitted first choices first, in token order: a token's computed experts "
                "depend on the other tokens, their order and T",
            )  # fmt: skip
        if c.jitter > 0:
            found["input jitter"] = dict(
                key="jitter", value=c.jitter, when="training",
                why="in training the router's input is multiplied by random factors drawn "
                "per entry: they follow the RNG state and the token's place in the call",
            )  # fmt: skip
        if c.noise_std > 0 or c.sample_extra > 0:
            found["exploration"] = dict(
                key="noise_std" if c.noise_std > 0 else "sample_extra",
                value=c.noise_std if c.noise_std > 0 else c.sample_extra, when="training",
                why="in training, random draws move the choice: they follow the RNG state "
                "and the call's shape (checkpoint's preserved RNG state replays them)",
            )  # fmt: skip
    return [{"mechanism": k, **v} for k, v in found.items()]


# -- one text's routing at one layer ----------------------------------------------------------


@dataclass
class _Routing:
    """Per token of one text at one layer."""

    computed_SE: torch.Tensor  # bool: the expert runs for the token
    used_SE: torch.Tensor  # bool: selected, non-zero weight (drops ignored)
    dropped_SE: torch.Tensor  # bool: selected but dropped by the capacity limit
    rank_SE: torch.Tensor  # float64: the scores the rule ranks by
    k_S: torch.Tensor  # int64: the token's selected slots (K of the K/K+1 margin)

    @staticmethod
    def cat(parts: Sequence[_Routing]) -> _Routing:
        return _Routing(*(torch.cat([getattr(p, f) for p in parts]) for f in _FIELDS))


_FIELDS = ("computed_SE", "used_SE", "dropped_SE", "rank_SE", "k_S")


def _mask(ids_TK: torch.Tensor, on_TK: torch.Tensor, E: int) -> torch.Tensor:
    mask = torch.zeros(ids_TK.shape[0], E + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(on_TK, ids_TK.clamp(max=E), E), True)
    return mask[:, :E]


def _ranking(router: nn.Module, out: RouterOutput) -> torch.Tensor:
    """(T, E') float64: the scores a moelab Router's rule ranks by (the logits, or the
    map's values with group-limited choice or ``rank_by="probs"``, plus the balancing
    bias); another router's logits."""
    from moelab.routing.router import Router

    if not isinstance(router, Router):
        return out.logits_TE.detach().double()
    by = router.selection.ranking_scores(out.logits_TE, out.probs_TE)
    return by.detach().double() + router.bias.detach().double()


def _routing(source: RoutingSource, layer: int, out: RouterOutput, rows: slice) -> _Routing:
    E = out.n_experts
    ids = out.ids_TK[rows].cpu()
    sel, w = out.selected_TK[rows].cpu(), out.weights_TK[rows].detach().cpu()
    dropped = out.dropped_TK[rows].cpu() & sel
    used = sel & (w != 0)
    return _Routing(
        computed_SE=_mask(ids, used & ~dropped, E),
        used_SE=_mask(ids, used, E),
        dropped_SE=_mask(ids, dropped, E),
        rank_SE=_ranking(source.routers[layer], out)[rows].cpu(),
        k_S=sel.sum(dim=1).long(),
    )


def _margins(rank_SE: torch.Tensor, k_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 minus top-2, K-th minus (K+1)-th) of each token; NaN where undefined."""
    s, _ = rank_SE.sort(dim=1, descending=True)
    n = s.shape[1]
    nan = torch.full((s.shape[0],), math.nan, dtype=torch.float64)
    top2 = s[:, 0] - s[:, 1] if n > 1 else nan
    ok = (k_S >= 1) & (k_S < n)
    k = k_S.clamp(1, max(n - 1, 1))
    kk1 = s.gather(1, (k - 1)[:, None])[:, 0] - s.gather(1, k.clamp(max=n - 1)[:, None])[:, 0]
    return top2, torch.where(ok, kk1, nan)


def _summary(v: torch.Tensor) -> dict[str, Any] | None:
    v = v[~torch.isnan(v)]
    if not v.numel():
        return None
    return {"tokens": int(v.numel()), "min": float(v.min()), "median": float(v.median()),
            "mean": float(v.mean())}  # fmt: skip


class InvarianceCounts:
    """One setting's comparisons at one MoE layer: exact counts, and the reference
    margins of the changed tokens and of the rest."""

    def __init__(self) -> None:
        self.tokens = self.changed = self.selected_changed = self.dropped_changed = 0
        self.ties = self.near_ties = 0
        self.delta_max = 0.0
        self.top2: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kk1: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, ref: _Routing, new: _Routing) -> None:
        if ref.computed_SE.shape != new.computed_SE.shape:
            raise ValueError(
                f"routed {new.computed_SE.shape[0]} of the text's {ref.computed_SE.shape[0]} "
                "tokens in this setting; the comparison needs all"
            )
        changed = (ref.computed_SE != new.computed_SE).any(dim=1)
        top2, kk1 = _margins(ref.rank_SE, ref.k_S)
        delta = (ref.rank_SE - new.rank_SE).abs().amax(dim=1)
        delta = torch.nan_to_num(delta, nan=math.inf)
        self.tokens += int(changed.numel())
        self.changed += int(changed.sum())
        self.selected_changed += int((ref.used_SE != new.used_SE).any(dim=1).sum())
        self.dropped_changed += int((ref.dropped_SE != new.dropped_SE).any(dim=1).sum())
        self.ties += int((changed & (kk1 == 0)).sum())
        self.near_ties += int((changed & (kk1 <= 2 * delta)).sum())
        finite = delta[torch.isfinite(delta)]
        if finite.numel():
            self.delta_max = max(self.delta_max, float(finite.max()))
        self.top2.append((top2[changed], top2[~changed]))
        self.kk1.append((kk1[changed], kk1[~changed]))

    @staticmethod
    def merged(parts: Sequence[InvarianceCounts]) -> InvarianceCounts:
        """The counts of all ``parts`` together (the layers of a setting)."""
        total = InvarianceCounts()
        for p in parts:
            for f in ("tokens", "changed", "selected_changed", "dropped_changed", "ties",
                      "near_ties"):  # fmt: skip
                setattr(total, f, getattr(total, f) + getattr(p, f))
            total.delta_max = max(total.delta_max, p.delta_max)
            total.top2 += p.top2
            total.kk1 += p.kk1
        return total

    def result(self) -> dict[str, Any]:
        n = self.tokens

        def split(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
            ch = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0)
            rest = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0)
            return {"changed": _summary(ch), "rest": _summary(rest)}

        return {
            "tokens": n,
            "changed": self.changed / n if n else None,
            "changed_tokens": self.changed,
            "selected_changed_tokens": self.selected_changed,
            "dropped_changed_tokens": self.dropped_changed,
            "ties": self.ties,
            "near_ties": self.near_ties,
            "delta_max": self.delta_max,
            "margin_top2": split(self.top2),
            "margin_kk1": split(self.kk1),
        }


# -- running the model ------------------------------------------------------------------------


@dataclass
class _Call:
    out: RouterOutput
    x_TD: torch.Tensor
    module: nn.Module
    kwargs: dict[str, Any]


@contextlib.contextmanager
def _calls(source: RoutingSource) -> Iterator[list[list[_Call]]]:
    """Every call of every router while the block runs, per MoE layer in call order."""
    seen: list[list[_Call]] = [[] for _ in source.routers]

    def hook_for(layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, returned: Any) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            out = source.as_output(layer, returned)
            seen[layer].append(_Call(out, x.detach(), module, dict(kwargs)))

        return hook

    handles = [
        r.register_forward_hook(hook_for(i), with_kwargs=True) for i, r in enumerate(source.routers)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _hf(source: RoutingSource) -> bool:
    return source.kind == "hf"


def _forward(source: RoutingSource, ids_BS: torch.Tensor, **kw: Any) -> Any:
    """One forward without gradients: a Hugging Face model with ``kw`` (mask, positions,
    cache), a moelab source through its own forward."""
    with torch.no_grad():
        if _hf(source):
            dev = next(source.model.parameters()).device
            kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            kw.setdefault("use_cache", False)
            return source.model(input_ids=ids_BS.to(dev), **kw)
        source.forward(ids_BS)
        return None


def _one_call(seen: list[list[_Call]]) -> list[_Call]:
    bad = [i for i, c in enumerate(seen) if len(c) != 1]
    if bad:
        raise ValueError(
            f"the router of MoE layer {bad[0]} ran {len(seen[bad[0]])} times in one forward "
            "pass; the analysis reads one call per layer"
        )
    return [c[0] for c in seen]


def _route_rows(source: RoutingSource, ids_BS: torch.Tensor, **kw: Any) -> list[RouterOutput]:
    with _calls(source) as seen:
        _forward(source, ids_BS, **kw)
    return [c.out for c in _one_call(seen)]


def _texts(source: RoutingSource, data: Any, n: int, length: int) -> torch.Tensor:
    """(n, length) token ids: the start of the data, cut into n pieces."""
    need, got, have = n * length, [], 0
    for x_BS in source.batches(data):
        flat = x_BS.reshape(-1).cpu()
        got.append(flat)
        have += flat.numel()
        if have >= need:
            break
    if have < need:
        raise ValueError(
            f"the text holds {have} tokens; --texts {n} x --length {length} needs {need} "
            "(give more text, or fewer or shorter texts)"
        )
    return torch.cat(got)[:need].reshape(n, length)


def _pad_id(source: RoutingSource) -> int:
    tok = getattr(source, "tokenizer", None) or getattr(getattr(source, "loaded", None),
                                                         "tokenizer", None)  # fmt: skip
    for name in ("pad_token_id", "eos_token_id", "eos_id"):
        v = getattr(tok, name, None)
        if isinstance(v, int):
            return v
    return 0


def _router_call(c: _Call, x_TD: torch.Tensor, ids: torch.Tensor | None, seq_len: int) -> Any:
    """The router of ``c`` called again (no hooks) on ``x_TD``, its token ids and
    sequence length adjusted."""
    kw = dict(c.kwargs)
    if "token_ids_T" in kw:
        if ids is None:
            raise NotApplicable("this router routes by token id")
        kw["token_ids_T"] = ids.to(x_TD.device)
    if "seq_len" in kw:
        kw["seq_len"] = seq_len
    with torch.no_grad():
        return c.module(x_TD, **kw)


# -- the settings -----------------------------------------------------------------------------

_Compare = Callable[[int, int, _Routing], None]  # (text, layer, its routing in the setting)


def _batch(source: RoutingSource, texts_BS: torch.Tensor, add: _Compare, rolls: range) -> None:
    n, S = texts_BS.shape
    for r in rolls:
        outs = _route_rows(source, texts_BS.roll(r, dims=0))
        for i in range(n):
            row = (i + r) % n
            for layer, out in enumerate(outs):
                add(i, layer, _routing(source, layer, out, slice(row * S, (row + 1) * S)))


def _padded(
    source: RoutingSource, texts_BS: torch.Tensor, add: _Compare, pad: int, left: bool,
    pad_x: list[torch.Tensor] | None, alone: list[list[_Call]],
) -> None:  # fmt: skip
    n, S = texts_BS.shape
    pid = _pad_id(source)
    pads = torch.full((1, pad), pid, dtype=texts_BS.dtype)
    for i in range(n):
        x = texts_BS[i : i + 1]
        if left and not _hf(source):  # router level: pad rows before the text's inputs
            assert pad_x is not None
            for layer, c in enumerate(alone[i]):
                x_TD = c.x_TD.reshape(-1, c.x_TD.shape[-1])
                ids = torch.cat([pads[0], x[0]])
                out = source.as_output(
                    layer, _router_call(c, torch.cat([pad_x[layer], x_TD]), ids, pad + S)
                )
                add(i, layer, _routing(source, layer, out, slice(pad, pad + S)))
            continue
        ids = torch.cat([pads, x] if left else [x, pads], dim=1)
        kw: dict[str, Any] = {}
        if _hf(source):
            mask = (torch.arange(pad + S) >= pad) if left else (torch.arange(pad + S) < S)
            mask = mask.long()[None]
            kw["attention_mask"] = mask
            if left:
                kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        outs = _route_rows(source, ids, **kw)
        rows = slice(pad, pad + S) if left else slice(0, S)
        for layer, out in enumerate(outs):
            add(i, layer, _routing(source, layer, out, rows))


def _chunks(
    source: RoutingSource, texts_BS: torch.Tensor, add: _Compare, size: int,
    alone: list[list[_Call]],
) -> None:  # fmt: skip
    n, S = texts_BS.shape
    for i in range(n):
        x = texts_BS[i : i + 1]
        parts: list[list[_Routing]] = [[] for _ in source.routers]
        if not _hf(source):  # router level: the reference inputs, size tokens per call
            for layer, c in enumerate(alone[i]):
                x_TD = c.x_TD.reshape(-1, c.x_TD.shape[-1])
                for a in range(0, S, size):
                    b = min(a + size, S)
                    out = source.as_output(layer, _router_call(c, x_TD[a:b], x[0, a:b], b - a))
                    parts[layer].append(_routing(source, layer, out, slice(None)))
        else:
            # NOTE: transformers 5 names the cache argument and output "cache", older
            # versions "past_key_values"
            params = inspect.signature(source.model.forward).parameters
            key = "cache" if "cache" in params else "past_key_values"
            past = None
            with _calls(source) as seen:
                for a in range(0, S, size):
                    b = min(a + size, S)
                    got = _forward(
                        source, x[:, a:b], **{key: past}, use_cache=True,
                        attention_mask=torch.ones(1, b, dtype=torch.long),
                    )  # fmt: skip
                    past = getattr(got, key, None)
                    if past is None:
                        raise NotApplicable("the model returned no KV cache")
            for layer, calls in enumerate(seen):
                for c in calls:
                    parts[layer].append(_routing(source, layer, c.out, slice(None)))
        for layer, p in enumerate(parts):
            add(i, layer, _Routing.cat(p))


@contextlib.contextmanager
def _training(source: RoutingSource) -> Iterator[Callable[[torch.Tensor], Any]]:
    """Training mode with activation recomputation; the block gets the forward to
    differentiate. Restores modes, requires_grad and gradients after."""
    from moelab.model.transformer import Transformer

    model = source.model
    modes = {m: m.training for m in model.modules()}
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    undo: list[Callable[[], None]] = []
    from torch.utils.checkpoint import checkpoint

    if isinstance(model, Transformer):  # as --checkpoint-activations wraps each block
        for block in model.blocks:
            inner = block.forward

            def fwd(*a: Any, _inner: Any = inner, **k: Any) -> Any:
                return checkpoint(_inner, *a, use_reentrant=False, **k)

            block.forward = fwd  # type: ignore[method-assign]
            undo.append(lambda b=block: b.__dict__.pop("forward", None))

        def run(x: torch.Tensor) -> Any:
            return model(x)
    elif _hf(source) and getattr(model, "supports_gradient_checkpointing", False):
        # NOTE: transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
            undo.append(model.activation_checkpointing_disable)
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            undo.append(model.gradient_checkpointing_disable)

        def run(x: torch.Tensor) -> Any:
            return model(input_ids=x.to(params[0].device), use_cache=False)
    else:  # the whole forward recomputed

        def run(x: torch.Tensor) -> Any:
            if _hf(source):
                return checkpoint(lambda y: model(input_ids=y, use_cache=False), x,
                                  use_reentrant=False)  # fmt: skip
            return checkpoint(model, x, use_reentrant=False)

    try:
        model.train()
        for p in params:
            p.requires_grad_(True)
        yield run
    finally:
        for f in undo:
            f()
        for m, mode in modes.items():
            m.train(mode)
        for p, f, g in zip(params, flags, grads, strict=True):
            p.requires_grad_(f)
            p.grad = g


def _scalar(out: Any) -> torch.Tensor:
    """A scalar of the forward's output to differentiate."""
    for name in ("logits", "logits_BSV", "probs_TE"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t.float().square().mean()
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return out.float().square().mean()
    raise NotApplicable("the forward returned no output to differentiate")


def _recompute(
    source: RoutingSource, texts_BS: torch.Tensor, counts: list[InvarianceCounts]
) -> None:
    n, S = texts_BS.shape
    from torch.utils.checkpoint import set_checkpoint_early_stop

    # NOTE: without early stop the recomputation runs each checkpointed forward to its
    # end, so a router whose output no backward needs still runs (and is hooked) again
    with _calls(source) as seen, _training(source) as run, torch.enable_grad():
        with set_checkpoint_early_stop(False):
            _scalar(run(texts_BS)).backward()
    runs = [len(c) for c in seen]
    if any(c != 2 for c in runs):
        raise NotApplicable(
            f"the routers ran {runs} times (one forward and one recomputation each "
            "expected); the recomputation did not rerun them all"
        )
    for layer, (first, again) in enumerate(seen):
        for i in range(n):
            rows = slice(i * S, (i + 1) * S)
            a = _routing(source, layer, first.out, rows)
            counts[layer].update(a, _routing(source, layer, again.out, rows))


# -- the analysis -----------------------------------------------------------------------------


def _verdict(total: InvarianceCounts) -> str:
    if not total.changed:
        return "invariant"
    if total.changed == total.ties:
        return "ties"
    if total.changed == total.near_ties:
        return "near-ties"
    return "batch-dependent"


_ROUTER_LEVEL = {
    "pad_left": "moelab's Transformer has no attention mask or position ids: the router of "
    "each MoE layer routes the pad tokens' router inputs followed by the text's reference "
    "inputs",
    "router_decode": "the router of each MoE layer routes the text's reference inputs one "
    "token per call",
    "router_chunked": "the router of each MoE layer routes the text's reference inputs {chunk} "
    "tokens per call",
}
_NO_CACHE = (
    "moelab's Transformer has no KV cache (its forward takes whole sequences); "
    "router_decode and router_chunked route its routers one token / chunk per call instead"
)
_HAS_CACHE = "measured with the model's KV cache (decode, chunked)"


def invariance(
    source: RoutingSource,
    data: Any = None,
    n_texts: int = 4,
    length: int = 32,
    pad: int = 8,
    chunk: int = 8,
    settings: Sequence[str] = SETTINGS,
) -> dict[str, Any]:
    """Invariance of ``source``'s routing on ``n_texts`` texts of ``length`` tokens from
    ``data`` under each of ``settings`` (:data:`SETTINGS`); see the module docstring."""
    if n_texts < 2:
        raise ValueError(f"--texts must be >= 2 (a batch of other texts), got {n_texts}")
    if length < 2:
        raise ValueError(f"--length must be >= 2, got {length}")
    if pad < 1 or chunk < 1:
        raise ValueError(f"--pad and --chunk must be >= 1, got {pad} and {chunk}")
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not settings:
        raise ValueError(f"settings must be among {', '.join(SETTINGS)}, got {list(settings)}")
    cfg = getattr(source.model, "config", None)
    limit = getattr(cfg, "max_seq_len", None) or getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and length + pad > limit:
        raise ValueError(
            f"--length {length} + --pad {pad} exceeds the model's {limit} positions; "
            "give a shorter --length or --pad"
        )
    texts_BS = _texts(source, data, n_texts, length)
    L = source.n_layers
    mechanisms = batch_mechanisms(source)

    # the reference: each text alone (and, for moelab's router-level settings, its calls)
    alone: list[list[_Call]] = []
    ref: list[list[_Routing]] = []
    for i in range(n_texts):
        with _calls(source) as seen:
            _forward(source, texts_BS[i : i + 1])
        calls = _one_call(seen)
        alone.append(calls)
        ref.append([_routing(source, j, c.out, slice(None)) for j, c in enumerate(calls)])
    pad_x = None
    if not _hf(source) and "pad_left" in settings:
        pads = torch.full((1, pad), _pad_id(source), dtype=texts_BS.dtype)
        with _calls(source) as seen:
            _forward(source, pads)
        pad_x = [c.x_TD.reshape(-1, c.x_TD.shape[-1]) for c in _one_call(seen)]

    results = []
    for name in settings:
        counts = [InvarianceCounts() for _ in range(L)]
        level = "model"
        note = None
        if name in _ROUTER_LEVEL and (name.startswith("router_") or not _hf(source)):
            level, note = "router", _ROUTER_LEVEL[name].format(chunk=chunk)

        def add(i: int, layer: int, new: _Routing, _c: Any = counts) -> None:
            _c[layer].update(ref[i][layer], new)

        try:
            if name == "batch":
                _batch(source, texts_BS, add, range(1))
            elif name == "batch_position":
                _batch(source, texts_BS, add, range(1, n_texts))
            elif name in ("pad_right", "pad_left"):
                _padded(source, texts_BS, add, pad, name == "pad_left", pad_x, alone)
            elif name in ("decode", "chunked") and not _hf(source):
                raise NotApplicable(_NO_CACHE)
            elif name.startswith("router_") and _hf(source):
                raise NotApplicable(_HAS_CACHE)
            elif name in ("decode", "chunked", "router_decode", "router_chunked"):
                size = 1 if name.endswith("decode") else chunk
                _chunks(source, texts_BS, add, size, alone)
            else:
                _recompute(source, texts_BS, counts)
        except NotApplicable as err:
            results.append({"setting": name, "applies": False, "reason": str(err),
                            "level": level, "note": note})  # fmt: skip
            continue
        applies = [m["mechanism"] for m in mechanisms if m["when"] == "always"]
        if name == "recompute":
            applies = [m["mechanism"] for m in mechanisms]
        total = InvarianceCounts.merged(counts)
        verdict = _verdict(total)
        results.append({
            "setting": name,
            "applies": True,
            "reason": None,
            "level": level,
            "note": note,
            **total.result(),
            "verdict": verdict,
            "mechanisms": applies if verdict == "batch-dependent" else [],
            "layers": [{"layer": j, **c.result()} for j, c in enumerate(counts)],
        })  # fmt: skip
    doc = source.describe()
    doc.update(
        analysis="invariance",
        data=None if data is None else str(data),
        texts=n_texts,
        length=length,
        pad=pad,
        chunk=chunk,
        tokens=n_texts * length,
        n_layers=L,
        batch_mechanisms=mechanisms,
        batch_invariant=not any(m["when"] == "always" for m in mechanisms),
        settings=results,
    )
    return doc
