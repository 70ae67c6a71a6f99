"""Routing records in the forms inference and training engines exchange them: the plain
integer array of vLLM's and SGLang's ``routed_experts`` output, and the per-layer index
tensors of Megatron-Core's ``router_replay``, converted to and from a moelab
:class:`~moelab.diagnostics.replay.RoutingRecord` and checked on read.

What the engines hand over (read from their sources; described here in our words):

* **vLLM** (vllm-project/vllm, ``vllm/model_executor/layers/fused_moe/
  routed_experts_capturer.py`` at commit 42fa4c0 and 00bd149, ``vllm/v1/core/sched/
  scheduler.py`` ``_get_routed_experts``). With ``enable_return_routed_experts`` each
  finished request carries ``routed_experts``, a numpy int32 array of shape
  ``(num_tokens - 1, num_hidden_layers, num_experts_per_tok)``: one row per token of the
  prompt *and* the generated text, in sequence order, except the last sampled token,
  which never went through the model. The middle axis has one entry per decoder layer
  of the Hugging Face config (``num_hidden_layers``), indexed by the layer's number
  (the capture is bound with the MoE module's ``layer_id``); a dense layer's entry is
  never written and stays 0 (the buffers are zero-filled). The ids are the router's
  logical expert ids, taken before the expert-parallel load balancer remaps them; the
  K ids of a row are in the order top-k returned them. No value marks padding: a
  request's array has exactly its own tokens (the rows are read from the request's KV
  slots). Fused shared experts get extra columns on the device that are not copied out.
* **SGLang** (sgl-project/sglang, ``python/sglang/srt/layers/moe/
  routed_experts_capturer.py`` at commit d4d0fc5; vLLM's capturer is adapted from it).
  ``--enable-return-routed-experts`` and the request's ``return_routed_experts``: the
  same int32 ``(seqlen - 1, num_hidden_layers, num_experts_per_tok)`` rows, read through
  the request's token-to-KV map, returned in ``meta_info["routed_experts"]`` as the
  base64 of the raw int32 bytes (flat: the client reshapes it to ``(-1, num_hidden_layers,
  top_k)``).
* **Megatron-Core** (NVIDIA/Megatron-LM, ``megatron/core/transformer/moe/
  router_replay.py`` and ``docs/api-guide/router_replay.md`` at commit d98e8a6).
  ``RouterReplay`` keeps one instance per MoE layer (in the order the routers were
  built); ``set_replay_data`` takes a Python list with one tensor per MoE layer, each
  ``(num_tokens, topk)`` of expert indices (int64: what ``torch.topk`` returns and what
  ``get_recorded_data`` hands back), and the replayed layer gathers its scores at those
  indices. It has no file format of its own: its guide saves the recorded tensors with
  ``torch.save`` and loads them with ``torch.load``. ``set_global_static_buffers`` takes
  the same indices as one ``[max_tokens, num_layers, topk]`` tensor (for CUDA graphs).
  Its router flattens a ``[seq_length, batch]`` micro-batch sequence-first, so with a
  batch of B > 1 sequences the rows are ``s * B + b``; moelab's are ``b * S + s``.

The forms this module writes and reads:

* **array** (:func:`save_array`, :func:`load_array`): a ``.npz`` file with
  ``routed_experts`` int32 (T, L, K), ``token_ids`` int64 (T,) when known,
  ``moe_layer_ids`` int64 (L,) (the model layer of each MoE layer), ``n_experts`` and
  ``n_null`` (0-d int64) and ``format`` (the string :data:`ARRAY_FORMAT`). A bare
  ``.npy`` array as an engine returns it reads too, with E given by the caller; an
  engine's array with one entry per decoder layer is narrowed to the MoE layers by
  ``moe_layer_ids``.
* **megatron** (:func:`save_megatron`, :func:`load_megatron`): what
  ``RouterReplay.set_replay_data`` consumes, written with ``torch.save``: a list of L
  int64 (T, K) tensors, so that ``RouterReplay.set_replay_data(torch.load(path))`` loads
  it. The static-buffer form, one (T, L, K) tensor, reads too. It holds the indices only:
  E comes from the caller and token ids do not travel through it.

Unfilled slots (``chosen`` False: a truncating rule such as the threshold rule left the
slot empty) are written as :data:`UNFILLED` (-1) in the array form and read back as
``chosen`` False with id 0: the id a moelab rule leaves in an unfilled slot is not kept
(no stage reads it: the gate, the counts and the losses take the chosen slots only), so
the round trip keeps every chosen flag and every filled slot's id exactly. Null experts
keep their ids E .. E + M - 1 (``n_null`` in the file). The Megatron form has neither:
its router fills K real experts in every row, so a record with unfilled slots or null
experts is refused there in one line.

Every mismatch on read is a one-line ValueError that names the field, e.g.
``routed_experts: 3 MoE layers, the model has 4``.

Shape suffixes: T, L, K (moelab.shapes).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moelab._io import write_atomic
from moelab.diagnostics.replay import RoutingRecord, routers_of

__all__ = [
    "ARRAY_FORMAT",
    "FORMATS",
    "UNFILLED",
    "Converted",
    "check_record",
    "detect_format",
    "from_array",
    "load_any",
    "load_array",
    "load_megatron",
    "moe_layer_ids",
    "save_array",
    "save_as",
    "save_megatron",
    "to_array",
]

ARRAY_FORMAT = "moelab-routed-experts"
"""The ``format`` string of the array form's ``.npz`` file."""
UNFILLED = -1
"""The array form's value for an unfilled slot (``chosen`` False)."""
FORMATS = ("moelab", "array", "megatron")
"""The forms :func:`save_as` writes: moelab's safetensors record, the array ``.npz``,
Megatron-Core's list of per-layer tensors."""

_FIELD = "routed_experts"


def moe_layer_ids(model: nn.Module) -> list[int]:
    """The model layer (block) number of each MoE layer of ``model``, in record order: the
    first all-digit part of each router's module name (``blocks.3.ff.router`` -> 3;
    ``model.layers.5.mlp.gate`` -> 5), the router's position when its name has none."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, router in enumerate(routers_of(model)):
        digits = [p for p in names.get(id(router), "").split(".") if p.isdigit()]
        out.append(int(digits[0]) if digits else i)
    return out


# ------------------------------------------------------------------ the array form


def to_array(rec: RoutingRecord) -> torch.Tensor:
    """int32 (T, L, K): ``rec``'s expert ids, layer l in ``[:, l]``, unfilled slots
    :data:`UNFILLED`. ValueError when the layers have different K (the array has one)."""
    rec.validate()
    if rec.n_layers and rec.top_k is None:
        raise ValueError(
            f"{_FIELD}: the layers hold K = {rec.slots}; the array form has one K for all"
        )
    if not rec.n_layers:
        return torch.zeros(rec.tokens, 0, 0, dtype=torch.int32)
    experts_TLK = torch.stack(
        [
            ids.masked_fill(~chosen, UNFILLED)
            for ids, chosen in zip(rec.ids_TK, rec.chosen_TK, strict=True)
        ],
        dim=1,
    )
    return experts_TLK.to(torch.int32)


def from_array(
    routed_experts: Any,
    n_experts: int,
    *,
    n_null: int = 0,
    token_ids: Any = None,
    map: str = "",
) -> RoutingRecord:
    """The record of an int32 (or int64) array (T, L, K) of expert ids (a numpy array
    or a tensor), :data:`UNFILLED` for an empty slot. ValueError (one line naming the
    field) for another rank or dtype, ids outside [0, E + M) other than -1, or token
    ids of another length or type."""
    experts_TLK = _as_tensor(routed_experts, _FIELD)
    if experts_TLK.dim() != 3:
        raise ValueError(
            f"{_FIELD}: shape {tuple(experts_TLK.shape)}, expected (tokens, MoE layers, top_k)"
        )
    if experts_TLK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{_FIELD}: dtype {_dtype_name(experts_TLK)}, expected int32")
    if n_experts < 1 or n_null < 0:
        raise ValueError(f"n_experts: {n_experts} (n_null {n_null}); E must be >= 1, M >= 0")
    n_scored = n_experts + n_null
    if experts_TLK.numel():
        low, high = int(experts_TLK.min()), int(experts_TLK.max())
        if low < UNFILLED or high >= n_scored:
            what = f"{n_experts} experts" + (f" and {n_null} null experts" if n_null else "")
            raise ValueError(
                f"{_FIELD}: expert ids span [{low}, {high}], outside [0, {n_scored - 1}] for "
                f"{what} (-1: an unfilled slot); give the model's E"
            )
    experts_TLK = experts_TLK.long()
    chosen_TLK = experts_TLK != UNFILLED
    ids_TLK = experts_TLK.clamp(min=0)
    tokens = None
    if token_ids is not None:
        tokens = _as_tensor(token_ids, "token_ids")
        if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"token_ids: {_dtype_name(tokens)} {tuple(tokens.shape)}, expected int64 (T,)"
            )
        if tokens.shape[0] != experts_TLK.shape[0]:
            raise ValueError(
                f"token_ids: {tokens.shape[0]} tokens, {_FIELD} has {experts_TLK.shape[0]}"
            )
        tokens = tokens.long()
    n_layers = experts_TLK.shape[1]
    return RoutingRecord(
        [ids_TLK[:, i].contiguous() for i in range(n_layers)],
        [chosen_TLK[:, i].contiguous() for i in range(n_layers)],
        n_experts,
        n_null,
        map,
        token_ids=tokens,
    )


def save_array(rec: RoutingRecord, path: str | Path, layer_ids: list[int] | None = None) -> None:
    """Write ``rec`` in the array form, a ``.npz`` file (module docstring), atomically.
    ``layer_ids``: the model layer of each MoE layer (:func:`moe_layer_ids`; default
    0 .. L-1)."""
    experts_TLK = to_array(rec)
    layers_L = _layer_ids(layer_ids, rec.n_layers)
    arrays = {
        "format": np.array(ARRAY_FORMAT),
        _FIELD: experts_TLK.numpy(),
        "moe_layer_ids": np.asarray(layers_L, dtype=np.int64),
        "n_experts": np.array(rec.n_experts, dtype=np.int64),
        "n_null": np.array(rec.n_null, dtype=np.int64),
    }
    if rec.token_ids is not None:
        arrays["token_ids"] = rec.token_ids.cpu().numpy().astype(np.int64)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(Path(path), buf.getvalue())


def load_array(
    path: str | Path,
    n_experts: int | None = None,
    *,
    n_null: int | None = None,
    layer_ids: list[int] | None = None,
) -> tuple[RoutingRecord, list[int]]:
    """The record in an array-form ``.npz`` or a bare ``.npy`` (T, L, K) at ``path``, and
    the model layer of each of its MoE layers. ``n_experts`` (E): needed for a ``.npy``;
    for a ``.npz``, checked against the file's. ``layer_ids``: the model layer of each
    MoE layer; an array whose L is larger (an engine's, one entry per decoder layer,
    dense layers 0) is narrowed to those entries. ValueError (one line naming the
    field) for a file of another kind or a mismatch."""
    path = Path(path)
    kind = detect_format(path)
    if kind == "npy":
        array = _read_npy(path)
        if n_experts is None:
            raise ValueError(
                f"{path}: a bare {_FIELD} array does not say how many experts the model "
                "has; give n_experts (--n-experts E)"
            )
        return _with_layers(array, None, n_experts, n_null or 0, None, layer_ids, path)
    if kind != "array":
        raise ValueError(f"{path}: a {kind} file, not a {_FIELD} array (.npz or .npy)")
    try:
        with np.load(path, allow_pickle=False) as z:
            held = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a readable .npz file ({err})") from None
    if _FIELD not in held:
        raise ValueError(f"{path}: the .npz holds no {_FIELD!r} array (it has {sorted(held)})")
    stored_e = _scalar(held, "n_experts", path)
    stored_m = _scalar(held, "n_null", path)
    if stored_e is not None and n_experts is not None and stored_e != n_experts:
        raise ValueError(f"n_experts: the file says {stored_e}, the model has {n_experts}")
    e = stored_e if stored_e is not None else n_experts
    if e is None:
        raise ValueError(f"{path}: the .npz holds no n_experts; give n_experts (--n-experts E)")
    m = stored_m if stored_m is not None else (n_null or 0)
    if n_null is not None and m != n_null:
        raise ValueError(f"n_null: the file says {m} null experts, the model has {n_null}")
    stored_layers = held.get("moe_layer_ids")
    return _with_layers(held[_FIELD], held.get("token_ids"), e, m, stored_layers, layer_ids, path)


def _with_layers(
    array: Any,
    token_ids: Any,
    n_experts: int,
    n_null: int,
    stored: Any,
    wanted: list[int] | None,
    path: Path,
) -> tuple[RoutingRecord, list[int]]:
    """The record of ``array`` with its layer map: the file's (``stored``), checked against
    ``wanted``, or ``wanted`` itself (an engine's all-layer array narrowed to it)."""
    experts_TLK = _as_tensor(array, _FIELD)
    if experts_TLK.dim() != 3:
        raise ValueError(
            f"{_FIELD}: shape {tuple(experts_TLK.shape)}, expected (tokens, MoE layers, top_k)"
        )
    n_layers = experts_TLK.shape[1]
    if stored is not None:
        layers = _as_tensor(stored, "moe_layer_ids")
        if layers.dim() != 1 or layers.shape[0] != n_layers:
            raise ValueError(
                f"moe_layer_ids: shape {tuple(layers.shape)}, {_FIELD} has {n_layers} layers"
            )
        layer_map = [int(x) for x in layers]
        if wanted is not None and layer_map != list(wanted):
            raise ValueError(
                f"moe_layer_ids: the file's MoE layers are {layer_map}, the model's {list(wanted)}"
            )
    elif wanted is not None and n_layers != len(wanted):
        if n_layers <= max(wanted, default=-1):
            raise ValueError(
                f"{_FIELD}: {n_layers} layers, the model has {len(wanted)} MoE layers "
                f"({list(wanted)})"
            )
        # NOTE: an engine's array has one entry per decoder layer (dense ones left 0):
        # keep the MoE layers' entries, in the model's order
        experts_TLK = experts_TLK[:, list(wanted)]
        layer_map = list(wanted)
    else:
        layer_map = list(wanted) if wanted is not None else list(range(n_layers))
    rec = from_array(experts_TLK, n_experts, n_null=n_null, token_ids=token_ids)
    return rec, layer_map


# ------------------------------------------------------------------ Megatron-Core


def save_megatron(rec: RoutingRecord, path: str | Path) -> None:
    """Write ``rec`` as Megatron-Core's ``RouterReplay.set_replay_data`` takes it: a list of
    L int64 (T, K) index tensors, with ``torch.save`` (atomically). ValueError for a
    record with unfilled slots or null experts (Megatron's router fills K real experts)."""
    rec.validate()
    for i, (ids, chosen) in enumerate(zip(rec.ids_TK, rec.chosen_TK, strict=True)):
        if not bool(chosen.all()):
            raise ValueError(
                f"layer {i}: {int((~chosen).sum())} unfilled slots; Megatron-Core's "
                "router_replay takes K filled slots per token (use --to array, which marks "
                "them -1)"
            )
        if rec.n_null and ids.numel() and int(ids.max()) >= rec.n_experts:
            raise ValueError(
                f"layer {i}: null expert ids (>= {rec.n_experts}); Megatron-Core's "
                "router_replay has no null experts"
            )
    buf = io.BytesIO()
    torch.save([ids.detach().cpu().long().contiguous() for ids in rec.ids_TK], buf)
    write_atomic(Path(path), buf.getvalue())


def load_megatron(path: str | Path, n_experts: int) -> RoutingRecord:
    """The record in a ``torch.save`` file of Megatron-Core's router-replay indices at
    ``path``: a list (or tuple) of L (T, K) integer tensors, or one (T, L, K) tensor
    (the static-buffer layout). ``n_experts``: E (the file does not say). ValueError (one
    line naming the field) for other contents."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a torch.save file of index tensors ({first})") from None
    except Exception as err:  # NOTE: weights_only refuses pickled objects it does not know
        raise ValueError(
            f"{path}: not a router_replay file ({type(err).__name__}); expected a list of "
            "(tokens, top_k) tensors"
        ) from None
    if isinstance(obj, torch.Tensor):
        if obj.dim() != 3:
            raise ValueError(
                f"{_FIELD}: a tensor of shape {tuple(obj.shape)}; Megatron's static buffer is "
                "(tokens, MoE layers, top_k)"
            )
        layers = [obj[:, i] for i in range(obj.shape[1])]
    elif isinstance(obj, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in obj):
        layers = list(obj)
    else:
        raise ValueError(
            f"{path}: holds a {type(obj).__name__}; Megatron-Core's router_replay takes a "
            "list of (tokens, top_k) index tensors, one per MoE layer"
        )
    for i, t in enumerate(layers):
        if t.dim() != 2:
            raise ValueError(f"layer {i}: shape {tuple(t.shape)}, expected (tokens, top_k)")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"layer {i}: dtype {_dtype_name(t)}, expected int64 indices")
    shapes = {tuple(t.shape) for t in layers}
    if len(shapes) > 1:
        raise ValueError(f"{_FIELD}: the layers have shapes {sorted(shapes)}; expected one (T, K)")
    if not layers:
        return RoutingRecord([], [], n_experts)
    experts_TLK = torch.stack(layers, dim=1)
    if experts_TLK.numel() and int(experts_TLK.min()) < 0:
        raise ValueError(
            f"{_FIELD}: expert id {int(experts_TLK.min())}; Megatron-Core's indices are >= 0"
        )
    return from_array(experts_TLK, n_experts)


# ------------------------------------------------------------------ any form


def detect_format(path: str | Path) -> str:
    """The form of the file at ``path`` from its bytes: ``moelab`` (a safetensors routing
    record), ``array`` (an ``.npz``), ``npy`` (a bare numpy array) or ``megatron`` (a
    ``torch.save`` file). ValueError for anything else; OSError when it cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile:
            names = []
        if names and all(n.endswith(".npy") for n in names):
            return "array"
        if any(n.endswith("data.pkl") for n in names):
            return "megatron"
    if len(head) >= 9 and head[8:9] == b"{":
        return "moelab"
    raise ValueError(
        f"{path}: not a routing record this moelab reads (a moelab .safetensors record, a "
        f"{_FIELD} .npz or .npy array, or a Megatron router_replay torch.save file)"
    )


@dataclass
class Converted:
    """A record read by :func:`load_any`: the record, the form it was read from and the
    model layer of each of its MoE layers."""

    record: RoutingRecord
    source: str
    layer_ids: list[int]


def load_any(
    path: str | Path,
    n_experts: int | None = None,
    *,
    layer_ids: list[int] | None = None,
) -> Converted:
    """The record at ``path`` in whichever form :func:`detect_format` finds. ``n_experts``
    is needed where the file does not carry E (a ``.npy``, a Megatron file) and checked
    where it does; ``layer_ids`` (the model layer of each MoE layer) likewise."""
    path = Path(path)
    kind = detect_format(path)
    if kind == "moelab":
        rec = RoutingRecord.load(path)
        if n_experts is not None and n_experts != rec.n_experts:
            raise ValueError(f"n_experts: the file says {rec.n_experts}, the model has {n_experts}")
        layers = _layer_ids(layer_ids, rec.n_layers)
        return Converted(rec, kind, layers)
    if kind in ("array", "npy"):
        rec, layers = load_array(path, n_experts, layer_ids=layer_ids)
        return Converted(rec, kind, layers)
    if n_experts is None:
        raise ValueError(
            f"{path}: a Megatron router_replay file does not say how many experts the model "
            "has; give n_experts (--n-experts E)"
        )
    rec = load_megatron(path, n_experts)
    return Converted(rec, kind, _layer_ids(layer_ids, rec.n_layers))


def save_as(
    rec: RoutingRecord, path: str | Path, to: str, layer_ids: list[int] | None = None
) -> None:
    """Write ``rec`` to ``path`` in the form ``to`` (:data:`FORMATS`)."""
    if to == "moelab":
        rec.save(path)
    elif to == "array":
        save_array(rec, path, layer_ids)
    elif to == "megatron":
        save_megatron(rec, path)
    else:
        raise ValueError(f"unknown routing format {to!r}; choose one of {', '.join(FORMATS)}")


def check_record(
    rec: RoutingRecord,
    *,
    model: nn.Module | None = None,
    n_layers: int | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
    text: Any = None,
) -> None:
    """ValueError (one line naming the field) unless ``rec`` fits the model and the text:
    its MoE layers and experts (and null experts) those of ``model``'s routers (or
    ``n_layers`` and ``n_experts``), its K ``top_k`` when given (replay checks K against
    the router's own at each call), and its rows the tokens of ``text`` (token
    ids, any integer sequence or tensor, flattened): the same count, and the same ids
    where the record holds token ids."""
    if model is not None:
        routers = routers_of(model)
        n_layers = len(routers)
        cfg = routers[0].config
        n_experts = cfg.n_experts
        if rec.n_null != cfg.n_null_experts:
            raise ValueError(
                f"n_null: the record has {rec.n_null} null experts, the model {cfg.n_null_experts}"
            )
    if n_layers is not None and rec.n_layers != n_layers:
        raise ValueError(f"{_FIELD}: {rec.n_layers} MoE layers, the model has {n_layers}")
    if n_experts is not None and rec.n_experts != n_experts:
        raise ValueError(
            f"n_experts: the record has {rec.n_experts} experts, the model {n_experts}"
        )
    if top_k is not None and rec.n_layers and rec.slots != [top_k] * rec.n_layers:
        raise ValueError(f"top_k: the record has K = {rec.slots}, the model's router K={top_k}")
    if text is None:
        return
    text_T = torch.as_tensor(np.asarray(text)).reshape(-1).long()
    if text_T.shape[0] != rec.tokens:
        hint = (
            " (an engine's array has no row for the last sampled token: give the text without it)"
            if text_T.shape[0] == rec.tokens + 1
            else ""
        )
        raise ValueError(f"{_FIELD}: {rec.tokens} tokens, the text has {text_T.shape[0]}{hint}")
    if rec.token_ids is not None:
        differ = int((rec.token_ids != text_T).sum())
        if differ:
            first = int((rec.token_ids != text_T).nonzero()[0, 0])
            raise ValueError(
                f"token_ids: differ from the text's at {differ} of {rec.tokens} positions "
                f"(first at {first}): a record of another text"
            )


# ------------------------------------------------------------------ helpers


def _layer_ids(layer_ids: list[int] | None, n_layers: int) -> list[int]:
    if layer_ids is None:
        return list(range(n_layers))
    if len(layer_ids) != n_layers:
        raise ValueError(
            f"moe_layer_ids: {len(layer_ids)} given, the record has {n_layers} MoE layers"
        )
    if len(set(layer_ids)) != len(layer_ids) or min(layer_ids, default=0) < 0:
        raise ValueError(f"moe_layer_ids: {list(layer_ids)} must be distinct and >= 0")
    return list(layer_ids)


def _as_tensor(value: Any, field: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{field}: dtype {array.dtype}, expected int32")
    if array.dtype.kind == "u":
        array = array.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(array))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _scalar(held: dict[str, np.ndarray], key: str, path: Path) -> int | None:
    if key not in held:
        return None
    value = held[key]
    if value.shape != () or value.dtype.kind not in "iu":
        raise ValueError(f"{key}: {value.dtype} {value.shape} in {path}, expected one integer")
    return int(value)


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable .npy array ({err})") from None
