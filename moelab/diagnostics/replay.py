"""Routing replay: record the experts every MoE layer chose for some batches, and replay
those choices in a later forward, so that the expert *sets* are fixed while the gate
weights stay differentiable (as reinforcement-learning pipelines do: record at rollout,
replay in training, so that the policy trained is the one that acted).

    with record(model) as rec:        # every router call inside is kept, in call order
        model(x_BS)
    rec.save("routing.safetensors")

    rec = RoutingRecord.load("routing.safetensors")
    with replay(model, rec):          # each router call takes the next T recorded rows
        out = model(x_BS, y_BS)       # gates: the map's values at the recorded experts
    out.loss.backward()               # reaches router.weight through the gate weights

Under :func:`replay` a router computes its scores, temperature and map as usual; only
its selection stage is replaced: it returns the recorded ``(ids_TK, chosen_TK)`` of the
call, and the gate then weighs ``probs_TE.gather(-1, ids_TK)`` as always, so the gate
weights are differentiable with respect to the router's weight. Balancing (the capacity
limit, the auxiliary losses) runs on the replayed slots. The rule itself still runs (its
output is only read for its width K, which must equal the recording's), so exploration
draws the same random numbers as without replay.

The routers are found generically, the :class:`~moelab.routing.router.Router` modules of
``model.modules()`` in module order: the MoE layers of a :class:`moelab.model.Transformer`
(``[m.router for m in model.moe_layers]``, checked) or the swapped routers of a Hugging
Face model (:func:`moelab.integrations.hf.swap.swap_routers`). Layer l of a record is the
l-th of them.

The file (:meth:`RoutingRecord.save`) is one safetensors file: tensors ``layer_00.ids``
(int64, (T, K)) and ``layer_00.chosen`` (bool, (T, K)) per MoE layer, and in its header
the string metadata ``format`` ("moelab-routing-replay"), ``version``, ``n_layers``,
``n_experts``, ``n_null``, ``K``, ``tokens`` and ``map``; optionally ``token_ids`` (int64,
(T,)), the token of each row, when the record knows it (a record converted from an
engine's array, :mod:`moelab.diagnostics.replay_formats`). Optional too, where
:func:`record` could measure them: a tensor ``layer_00.margins`` (float32, (T, 2),
:attr:`RoutingRecord.margins_T2`) per layer and ``seq_len`` in the header. A file
without the optional parts loads as before, with None in their place. docs/replay.md
has the details.

Limits: every router call counts, so a forward recomputed under
``torch.utils.checkpoint`` (activation checkpointing) would be recorded twice and would
take the next rows at replay; recompute is not supported. Record and replay the same
batches in the same order, with the same batch shapes.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save
from torch import nn

from moelab._io import write_atomic
from moelab.routing.output import RouterOutput
from moelab.routing.router import Router
from moelab.routing.selection import Budget, Selected

__all__ = [
    "MARGIN_RULES",
    "REPLAY_FORMAT",
    "REPLAY_VERSION",
    "RoutingRecord",
    "ranking_margins",
    "record",
    "replay",
    "routers_of",
]

REPLAY_FORMAT = "moelab-routing-replay"
"""The ``format`` of a routing record's safetensors header."""
REPLAY_VERSION = 1
"""The ``version`` of the file layout this module writes and reads."""

_META_KEYS = ("format", "version", "n_layers", "n_experts", "n_null", "K", "tokens", "map")

MARGIN_RULES = ("topk", "threshold", "top_p")
"""The selection rules whose slots are each token's experts in the order of its ranking
scores, so that :func:`record` keeps their margins. Expert choice and Sinkhorn rank
over the batch, hash routing does not rank: their records hold no margins."""


def _key(layer: int, name: str) -> str:
    return f"layer_{layer:02d}.{name}"


def routers_of(model: nn.Module) -> list[Router]:
    """The moelab Routers of ``model`` in module order: one per MoE layer of a moelab
    Transformer (checked against ``model.moe_layers``) or of a Hugging Face model with
    swapped routers. ValueError when there is none."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    layers = getattr(model, "moe_layers", None)
    if isinstance(layers, list):
        own = [layer.router for layer in layers]
        if len(own) != len(routers) or any(a is not b for a, b in zip(own, routers, strict=False)):
            raise ValueError(
                "the model's MoE layers do not hold exactly its moelab Routers in block order "
                "(a custom router?); routing replay needs one moelab Router per MoE layer"
            )
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no moelab Router: routing replay needs a moelab "
            "model with MoE layers, or a Hugging Face model after swap_routers(model)"
        )
    return routers


def _chosen_sets(ids_TK: torch.Tensor, chosen_TK: torch.Tensor, n_scored: int) -> torch.Tensor:
    """bool (T, n_scored): the experts each token's chosen slots name (its chosen set)."""
    hits_TE = torch.zeros(ids_TK.shape[0], n_scored, dtype=torch.int64, device=ids_TK.device)
    return hits_TE.scatter_add_(1, ids_TK, chosen_TK.long()) > 0


@dataclass
class RoutingRecord:
    """The chosen slots of every MoE layer over some tokens: ``ids_TK[l]`` (int64) and
    ``chosen_TK[l]`` (bool: the slot was filled by the selection rule, a real or a null
    expert, :attr:`RouterOutput.chosen_TK`) of layer l, on the CPU, the T rows of every
    router call recorded concatenated in call order.

    ``consumed[l]`` is how many rows of layer l the latest :func:`replay` has taken (its
    cursor); :meth:`rewind` sets them back to 0 (a new replay context does too)."""

    ids_TK: list[torch.Tensor]
    chosen_TK: list[torch.Tensor]
    n_experts: int
    """E, the real experts of each layer."""
    n_null: int = 0
    """M, the null experts (ids E .. E + M - 1)."""
    map: str = ""
    """The map of the recorded routers (for information; replay does not check it)."""
    token_ids: torch.Tensor | None = None
    """int64 (T,): the token id of each row, when known (optional; replay does not read
    it). Saved as the tensor ``token_ids``; files without it load with None."""
    consumed: list[int] = field(default_factory=list)
    margins_T2: list[torch.Tensor] | None = None
    """Optional: per layer, float32 (T, 2), each token's ``[s(1) - s(2), s(K) - s(K + 1)]``,
    s(i) its i-th largest ranking score: the values its selection rule ranks (the
    logits, i.e. the scores after temperature, plus the balancing bias; the map's values
    plus the bias with ``rank_by="probs"`` and with group-limited choice, there before
    the group limit). 0 is a tie; +inf where there is no (K + 1)-th (or second) expert.
    None: not recorded (an older file; a rule that does not rank each token's experts,
    :data:`MARGIN_RULES`; exploration in training)."""
    seq_len: int | None = None
    """Optional: S, when every recorded call routed whole sequences of one length S
    (T = B * S per call, sequence-major); None: not known."""

    def __post_init__(self) -> None:
        self.validate()
        self.consumed = [0] * len(self.ids_TK)

    def validate(self) -> None:
        """ValueError (one line) unless every layer holds (T, K) int64 ids and bool chosen
        slots, the same T in every layer, and ids in [0, E + M)."""
        if len(self.ids_TK) != len(self.chosen_TK):
            raise ValueError(
                f"a routing record needs ids and chosen slots for every layer, got "
                f"{len(self.ids_TK)} and {len(self.chosen_TK)} layers"
            )
        for i, (ids, chosen) in enumerate(zip(self.ids_TK, self.chosen_TK, strict=True)):
            if ids.dim() != 2 or ids.shape != chosen.shape:
                raise ValueError(
                    f"layer {i}: ids {tuple(ids.shape)} and chosen {tuple(chosen.shape)} must "
                    "be two (T, K) tensors of one shape"
                )
            if ids.dtype != torch.int64 or chosen.dtype != torch.bool:
                raise ValueError(
                    f"layer {i}: ids must be int64 and chosen bool, got {ids.dtype} and "
                    f"{chosen.dtype}"
                )
        tokens = {ids.shape[0] for ids in self.ids_TK}
        if len(tokens) > 1:
            raise ValueError(
                f"the layers of a routing record hold different token counts {sorted(tokens)}; "
                "record whole forwards of the model"
            )
        if self.token_ids is not None:
            t = self.token_ids
            if t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != self.tokens:
                raise ValueError(
                    f"token_ids: {t.dtype} {tuple(t.shape)}, expected int64 ({self.tokens},), "
                    "one id per recorded row"
                )
        n_scored = self.n_experts + self.n_null
        for i, ids in enumerate(self.ids_TK):
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n_scored):
                raise ValueError(
                    f"layer {i}: recorded expert ids span [{int(ids.min())}, {int(ids.max())}], "
                    f"outside [0, {n_scored - 1}] for {self.n_experts} experts and "
                    f"{self.n_null} null experts"
                )
        if self.margins_T2 is not None:
            if len(self.margins_T2) != len(self.ids_TK):
                raise ValueError(
                    f"a routing record's margins need one tensor per layer, got "
                    f"{len(self.margins_T2)} for {len(self.ids_TK)} layers"
                )
            for i, (m, ids) in enumerate(zip(self.margins_T2, self.ids_TK, strict=True)):
                if m.dtype != torch.float32 or tuple(m.shape) != (ids.shape[0], 2):
                    raise ValueError(
                        f"layer {i}: margins must be float32 ({ids.shape[0]}, 2), got "
                        f"{m.dtype} {tuple(m.shape)}"
                    )
                if m.numel() and not bool((m >= 0).all()):
                    raise ValueError(
                        f"layer {i}: margins must be >= 0 or +inf (gaps between sorted "
                        "scores), got a negative or NaN one"
                    )
        if self.seq_len is not None and not (
            self.seq_len > 0 and (not self.ids_TK or self.ids_TK[0].shape[0] % self.seq_len == 0)
        ):
            raise ValueError(
                f"a routing record's seq_len must be positive and divide its {self.tokens} "
                f"tokens, got {self.seq_len}"
            )

    @property
    def n_layers(self) -> int:
        """L, the MoE layers recorded."""
        return len(self.ids_TK)

    @property
    def tokens(self) -> int:
        """T, the tokens recorded (every layer holds as many)."""
        return self.ids_TK[0].shape[0] if self.ids_TK else 0

    @property
    def slots(self) -> list[int]:
        """K of each layer (the width of its ids)."""
        return [ids.shape[1] for ids in self.ids_TK]

    @property
    def top_k(self) -> int | None:
        """K, the slots per token, when every layer has the same (None otherwise: see
        :attr:`slots`)."""
        widths = set(self.slots)
        return widths.pop() if len(widths) == 1 else None

    def rewind(self) -> None:
        """Set every layer's replay cursor back to the first row."""
        self.consumed = [0] * self.n_layers

    def chosen_sets(self, layer: int) -> torch.Tensor:
        """bool (T, E + M): the experts each token's chosen slots name, at ``layer``."""
        return _chosen_sets(self.ids_TK[layer], self.chosen_TK[layer], self.n_experts + self.n_null)

    def changed_fraction(self, other: RoutingRecord) -> float:
        """The share of (token, layer) states whose chosen set differs between this record
        and ``other``, over the tokens both hold (the first min(T, T') of each layer)."""
        if other.n_layers != self.n_layers or other.n_experts != self.n_experts:
            raise ValueError(
                f"cannot compare a record of {self.n_layers} layers x {self.n_experts} experts "
                f"with one of {other.n_layers} x {other.n_experts}"
            )
        n = min(self.tokens, other.tokens)
        if n == 0 or self.n_layers == 0:
            return 0.0
        changed = 0
        for i in range(self.n_layers):
            mine, theirs = self.chosen_sets(i)[:n], other.chosen_sets(i)[:n]
            changed += int((mine != theirs).any(-1).sum())
        return changed / (n * self.n_layers)

    # ------------------------------------------------------------------ the file

    def metadata(self) -> dict[str, str]:
        """The safetensors header's metadata (strings, as the format requires)."""
        widths = self.slots
        k = str(widths[0]) if len(set(widths)) == 1 else ",".join(map(str, widths))
        meta = {
            "format": REPLAY_FORMAT,
            "version": str(REPLAY_VERSION),
            "n_layers": str(self.n_layers),
            "n_experts": str(self.n_experts),
            "n_null": str(self.n_null),
            "K": k,
            "tokens": str(self.tokens),
            "map": self.map,
        }
        if self.seq_len is not None:
            meta["seq_len"] = str(self.seq_len)
        return meta

    def save(self, path: str | Path) -> None:
        """Write the record to ``path``: one safetensors file, ``layer_NN.ids`` and
        ``layer_NN.chosen`` (and ``layer_NN.margins`` when held) per layer and
        :meth:`metadata` in its header, atomically (a temporary renamed over the target,
        :func:`moelab._io.write_atomic`)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, (ids, chosen) in enumerate(zip(self.ids_TK, self.chosen_TK, strict=True)):
            tensors[_key(i, "ids")] = ids.detach().cpu().contiguous()
            tensors[_key(i, "chosen")] = chosen.detach().cpu().contiguous()
            if self.margins_T2 is not None:
                tensors[_key(i, "margins")] = self.margins_T2[i].detach().cpu().contiguous()
        if self.token_ids is not None:
            tensors["token_ids"] = self.token_ids.detach().cpu().contiguous()
        write_atomic(Path(path), st_save(tensors, metadata=self.metadata()))

    @classmethod
    def load(cls, path: str | Path) -> RoutingRecord:
        """The record :meth:`save` wrote to ``path``. ValueError (one line) for a file that
        is not safetensors, another format or version, missing metadata or layers, or
        tensors of the wrong shape or type; OSError for a file that cannot be read."""
        path = Path(path)
        redo = "record it again with moelab.diagnostics.record or moelab eval --record"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                tensors = {k: f.get_tensor(k) for k in keys}
        except SafetensorError as err:
            raise ValueError(
                f"{path} is not a safetensors file ({err}); a routing record is one: {redo}"
            ) from None
        if meta.get("format") != REPLAY_FORMAT:
            raise ValueError(
                f"{path} is a safetensors file but not a routing record (format "
                f"{meta.get('format')!r}, expected {REPLAY_FORMAT!r}): {redo}"
            )
        missing = [k for k in _META_KEYS if k not in meta]
        if missing:
            raise ValueError(f"{path}: the routing record lacks the metadata {missing}: {redo}")
        if meta["version"] != str(REPLAY_VERSION):
            raise ValueError(
                f"{path}: routing record version {meta['version']}, this moelab reads version "
                f"{REPLAY_VERSION}: {redo}"
            )
        try:
            n_layers, n_experts, n_null = (int(meta[k]) for k in _META_KEYS[2:5])
        except ValueError:
            raise ValueError(
                f"{path}: the routing record's n_layers, n_experts and n_null must be integers, "
                f"got {meta['n_layers']!r}, {meta['n_experts']!r}, {meta['n_null']!r}: {redo}"
            ) from None
        wanted = [_key(i, n) for i in range(n_layers) for n in ("ids", "chosen")]
        absent = [k for k in wanted if k not in keys]
        if absent:
            raise ValueError(
                f"{path}: the routing record says {n_layers} layers but lacks "
                f"{', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}: {redo}"
            )
        held_margins = [_key(i, "margins") in keys for i in range(n_layers)]
        if any(held_margins) and not all(held_margins):
            raise ValueError(
                f"{path}: the routing record holds margins for layers "
                f"{[i for i, h in enumerate(held_margins) if h]} only, not all {n_layers}: {redo}"
            )
        try:
            seq_len = int(meta["seq_len"]) if "seq_len" in meta else None
        except ValueError:
            raise ValueError(
                f"{path}: the routing record's seq_len must be an integer, got "
                f"{meta['seq_len']!r}: {redo}"
            ) from None
        try:
            rec = cls(
                [tensors[_key(i, "ids")] for i in range(n_layers)],
                [tensors[_key(i, "chosen")] for i in range(n_layers)],
                n_experts,
                n_null,
                meta["map"],
                token_ids=tensors.get("token_ids"),
                margins_T2=(
                    [tensors[_key(i, "margins")] for i in range(n_layers)]
                    if n_layers and all(held_margins)
                    else None
                ),
                seq_len=seq_len,
            )
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        held = rec.metadata()
        if (held["tokens"], held["K"]) != (meta["tokens"], meta["K"]):
            raise ValueError(
                f"{path}: the routing record's tensors hold T={held['tokens']}, K={held['K']} "
                f"but its header says T={meta['tokens']}, K={meta['K']}: {redo}"
            )
        return rec


# ------------------------------------------------------------------ recording


@contextlib.contextmanager
def record(model: nn.Module) -> Iterator[RoutingRecord]:
    """Within the block, keep the chosen slots of every router call of ``model`` (a
    moelab Transformer or an HF model with swapped routers), per MoE layer, concatenated
    along T in call order: a whole evaluation pass of many batches can be recorded. The
    yielded record is empty inside the block and complete when it exits (also when the
    block raises, with the calls made so far).

    Forward hooks on the Router modules, removed on exit: nothing changes in a router's
    cost outside the block. ValueError on exit when a layer's calls had different K (a
    ``top_k=`` changed inside the block)."""
    routers = routers_of(model)
    rc = routers[0].config
    kinds = {(r.config.n_null_experts, r.config.map) for r in routers}
    if len(kinds) > 1:  # router_layers: a record holds one M and one map
        raise ValueError(
            "the MoE layers' routers differ in their null experts or map (router_layers: "
            f"{sorted(kinds)}); a routing record holds one of each: record a model whose "
            "layers share them"
        )
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]

    def keep(i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: RouterOutput) -> None:
            ids_TK = out.ids_TK.detach().to("cpu", torch.int64).contiguous()
            chunks[i].append((ids_TK, out.chosen_TK.detach().to("cpu").contiguous()))

        return hook

    rec = RoutingRecord([], [], rc.n_experts, rc.n_null_experts, rc.map)
    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    # the margins and S of each call, beside the chunks: kept only where every call has them
    margins: list[list[torch.Tensor | None]] = [[] for _ in routers]
    lengths: set[int | None] = set()

    def measure(i: int) -> Any:
        def hook(module: Router, args: tuple, kwargs: dict, out: RouterOutput) -> None:
            margins[i].append(ranking_margins(module, out))
            lengths.add(kwargs.get("seq_len"))

        return hook

    handles += [
        r.register_forward_hook(measure(i), with_kwargs=True) for i, r in enumerate(routers)
    ]
    try:
        yield rec
    except BaseException:
        _assemble(rec, chunks, strict=False)
        raise
    else:
        _assemble(rec, chunks, strict=True)
    finally:
        for h in handles:
            h.remove()
    _add_margins(rec, margins, lengths)


def ranking_margins(router: Router, out: RouterOutput) -> torch.Tensor | None:
    """float32 (T, 2) on the CPU: each token's ``[s(1) - s(2), s(K) - s(K + 1)]`` in the
    router call ``out`` of ``router``, s(i) the i-th largest of the scores its selection
    rule ranks (:attr:`RoutingRecord.margins_T2`), computed as the rule computes them;
    +inf where there is no second or (K + 1)-th expert. None for a rule outside
    :data:`MARGIN_RULES`, under exploration (training with ``noise_std`` or
    ``sample_extra``: the rule ranked noisy or sampled scores this cannot see) and under
    :func:`replay` (the slots are the recorded ones, not the ranking's)."""
    rule = router.selection
    cfg = rule.config
    if rule.name not in MARGIN_RULES or "forward" in rule.__dict__:
        return None
    if router.training and (cfg.noise_std > 0 or cfg.sample_extra > 0):
        return None
    by_TE = rule.ranking_scores(out.logits_TE, out.probs_TE)
    rank_TE = by_TE.detach() + router.bias  # Selection.rank without noise: the same floats
    n_tokens, n_slots = out.ids_TK.shape
    top = rank_TE.topk(min(n_slots + 1, rank_TE.shape[1]), dim=-1).values.double()
    inf_T = torch.full((n_tokens,), math.inf, dtype=torch.float64, device=top.device)
    first_T = top[:, 0] - top[:, 1] if top.shape[1] > 1 else inf_T
    kth_T = top[:, n_slots - 1] - top[:, n_slots] if top.shape[1] > n_slots else inf_T
    return torch.stack([first_T, kth_T], dim=1).float().cpu()


def _add_margins(
    rec: RoutingRecord, margins: list[list[torch.Tensor | None]], lengths: set[int | None]
) -> None:
    """Give the assembled ``rec`` its margins where every call of every layer had them,
    and its S where every call routed sequences of one length."""
    kept = None
    if margins and all(m is not None for layer in margins for m in layer):
        kept = [torch.cat(layer) if layer else torch.zeros(0, 2) for layer in margins]  # type: ignore[arg-type]
        if any(m.shape[0] < rec.tokens for m in kept):  # a layer left empty: none at all
            kept = None
        else:
            kept = [m[: rec.tokens] for m in kept]
    seq_len = lengths.pop() if len(lengths) == 1 else None
    if seq_len is not None and (seq_len <= 0 or rec.tokens % seq_len):
        seq_len = None
    rec.margins_T2, rec.seq_len = kept, seq_len
    rec.validate()


def _assemble(
    rec: RoutingRecord, chunks: list[list[tuple[torch.Tensor, torch.Tensor]]], strict: bool
) -> None:
    """Fill ``rec`` with the recorded calls of each layer, concatenated along T. ``strict``
    (a block that exited normally): ValueError for calls of different K in one layer;
    otherwise (the block raised) such a layer is left empty."""
    ids, chosen = [], []
    for i, layer in enumerate(chunks):
        widths = sorted({c[0].shape[1] for c in layer})
        if len(widths) > 1:
            if strict:
                raise ValueError(
                    f"layer {i} was called with K = {widths} inside one record(); record "
                    "each budget in a record of its own"
                )
            layer = []
        ids.append(torch.cat([c[0] for c in layer]) if layer else torch.zeros(0, 0).long())
        chosen.append(torch.cat([c[1] for c in layer]) if layer else torch.zeros(0, 0).bool())
    if not strict and len({t.shape[0] for t in ids}) > 1:  # a forward cut short
        n = min(t.shape[0] for t in ids)
        ids, chosen = [t[:n] for t in ids], [t[:n] for t in chosen]
    full = RoutingRecord(ids, chosen, rec.n_experts, rec.n_null, rec.map)
    rec.ids_TK, rec.chosen_TK, rec.consumed = full.ids_TK, full.chosen_TK, full.consumed


# ------------------------------------------------------------------ replaying


def check_record_fits(rec: RoutingRecord, routers: list[Router]) -> None:
    """The record fits the model: layers, experts, null experts."""
    if rec.n_layers != len(routers):
        raise ValueError(
            f"the routing record has {rec.n_layers} MoE layers, the model {len(routers)}: "
            "replay a record of this model"
        )
    for i, r in enumerate(routers):
        cfg = r.config
        if (cfg.n_experts, cfg.n_null_experts) != (rec.n_experts, rec.n_null):
            raise ValueError(
                f"the routing record has {rec.n_experts} experts (+{rec.n_null} null) per "
                f"layer, the model's layer {i} {cfg.n_experts} (+{cfg.n_null_experts} null): "
                "replay a record of this model"
            )


def _replayed_forward(rec: RoutingRecord, layer: int, rule: nn.Module) -> Any:
    """The selection call of ``layer`` under replay: the rule's own call (for its width)
    and then the next T recorded rows, checked."""
    own_forward = rule.forward

    def forward(
        logits_TE: torch.Tensor, probs_TE: torch.Tensor, bias_E: torch.Tensor, budget: Budget
    ) -> Selected:
        own_ids_TK, _ = own_forward(logits_TE, probs_TE, bias_E, budget)
        n_tokens, n_slots = own_ids_TK.shape
        ids_TK, chosen_TK = rec.ids_TK[layer], rec.chosen_TK[layer]
        start = rec.consumed[layer]
        if start + n_tokens > ids_TK.shape[0]:
            raise ValueError(
                f"layer {layer}: the call routes T={n_tokens} tokens from row {start}, past the "
                f"end of the routing record (T={ids_TK.shape[0]}, K={ids_TK.shape[1]}): replay "
                "the batches that were recorded, in order (rec.rewind() restarts)"
            )
        if ids_TK.shape[1] != n_slots:
            raise ValueError(
                f"layer {layer}: the routing record has K={ids_TK.shape[1]} slots per token "
                f"(T={ids_TK.shape[0]}), the model's router K={n_slots}: replay with the "
                "recorded top_k"
            )
        rec.consumed[layer] = start + n_tokens
        device = own_ids_TK.device
        return Selected(
            ids_TK[start : start + n_tokens].to(device),
            chosen_TK[start : start + n_tokens].to(device),
        )

    return forward


@contextlib.contextmanager
def replay(model: nn.Module, rec: RoutingRecord) -> Iterator[RoutingRecord]:
    """Within the block, every router call of layer l of ``model`` (a moelab Transformer
    or an HF model with swapped routers) chooses the next T rows of ``rec``'s layer l
    instead of its own experts (a cursor per layer, :attr:`RoutingRecord.consumed`, from
    0 at entry): the scores, temperature and map are computed as usual, the selection
    stage returns the recorded ``(ids_TK, chosen_TK)``, and the gate weights
    ``gate(probs_TE.gather(-1, ids_TK))`` stay differentiable. Yields ``rec``.

    The router's selection rule is wrapped for the block (its instance ``forward``;
    the rule, its state dict and its answers stay as they were) and restored on exit,
    also on error. Stopping before the record's end is fine: ``rec.consumed`` says how
    far each layer got.

    Raises:
        ValueError: the record's layer count or expert count differs from the model's
            (at entry); in a call, a T that would run past the record's end or a K
            that differs from the router's.
    """
    routers = routers_of(model)
    rec.validate()
    check_record_fits(rec, routers)
    rules = [r.selection for r in routers]
    if any("forward" in rule.__dict__ for rule in rules):
        raise ValueError("this model is replaying a routing record already; nest no replay")
    rec.rewind()
    try:
        for i, rule in enumerate(rules):
            rule.forward = _replayed_forward(rec, i, rule)
        yield rec
    finally:
        for rule in rules:
            rule.__dict__.pop("forward", None)
