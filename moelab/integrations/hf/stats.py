"""Routing statistics of a Hugging Face MoE model, collected while text passes through it.

A forward hook on every router module (:func:`~moelab.integrations.hf.families.moe_routers`)
reads what the router returned, ``(logits_TE, weights_TK, ids_TK)``, turns it into a
:class:`~moelab.routing.RouterOutput` (:func:`router_output`) and adds it to that layer's
:class:`~moelab.diagnostics.RoutingStats` at once, so memory stays flat however many
tokens pass. The choice and the gate weights are the model's own (its router computed
them); ``probs_TE``, the distribution over all E experts that the discarded mass and the
support sizes read, is :func:`~moelab.integrations.hf.families.stats_probs`: the softmax of
the logits, or DeepSeek-V3's sigmoid scores normalised over all E (GPT-OSS's gate weights
are a softmax over the chosen k only, so its statistics use the softmax over all E). The
map of the statistics is then ``softmax`` or ``sigmoid``, neither with a singleton
threshold (``threshold`` is null). ``score_rms`` and the top-2 gaps read the raw logits.

Text: a text file, or a folder of ``.txt`` / ``.md`` / ``.rst`` files (one document each,
sorted by path), tokenised with the model's tokenizer (in pieces of about
:data:`CHUNK_CHARS` characters cut at line ends), each document followed by EOS, and cut
into consecutive windows of ``seq_len`` tokens (:func:`token_batches`); ``max_tokens``
bounds the tokens fed to the model, and reading stops there.

Every MoE layer is read or the model is refused:
:func:`~moelab.integrations.hf.families.moe_routers` refuses a model with an MoE block
whose router it cannot hook, and :class:`Seen` (what the hooks captured per layer)
refuses, after the pass, a layer whose router never ran. A layer
that chooses by token id (DeepSeek-V4's hash-routed layers) is read like the others and
marked ``"routed_by": "token_id"`` (``"scores"`` otherwise). The budget sweep checks on
the same capture that every layer chose K distinct experts per token (:meth:`Seen.check_k`).

A folder written from a swapped model (``save_pretrained`` / ``save_swapped``: it holds
``moelab_routers.json``) is loaded with its moelab Routers
(:func:`~moelab.integrations.hf.saved.load_swapped`) by the statistics and the sweep,
which then read the Routers' own outputs and map (:func:`collect_swapped`); the other
readers of :func:`load_hf` refuse it, since a plain load routes with the family's own
rule instead.

Shape suffixes: T, E, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from moelab.diagnostics.accumulators import ModelRoutingStats
from moelab.integrations.hf.families import (
    RouterSite,
    UnsupportedModelError,
    family_of,
    first_rule,
    import_transformers,
    moe_routers,
    stats_probs,
)
from moelab.integrations.hf.folder import UTF8_HINT, check_folder, first_not_utf8, not_utf8
from moelab.integrations.hf.rules import rule_probs
from moelab.routing.output import RouterOutput

__all__ = [
    "CHUNK_CHARS",
    "TEXT_SUFFIXES",
    "ModelCodeError",
    "Seen",
    "check_max_tokens",
    "collect",
    "collect_swapped",
    "forward",
    "hf_stats",
    "load_hf",
    "nll_pass",
    "read_texts",
    "router_output",
    "token_batches",
]

TEXT_SUFFIXES = (".txt", ".md", ".rst")
"""Files of a --data folder that are read (one document each)."""


# -- loading -----------------------------------------------------------------------------


def _holds_routers(path: Path) -> bool:
    """Whether ``path`` is a folder that save_swapped wrote (its moelab_routers.json)."""
    from moelab.integrations.hf.saved import FORMAT, ROUTERS_JSON, read_json_or_none

    doc = read_json_or_none(path / ROUTERS_JSON)
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def load_hf(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    trust_remote_code: bool = False,
    swapped: bool = False,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local ``save_pretrained`` directory (config.json,
    safetensors weights, tokenizer.json), offline, in eval mode. ``dtype`` defaults to
    float32 on CPU and to the checkpoint's own dtype on a GPU. The folder is checked
    first (:func:`~moelab.integrations.hf.folder.check_folder`): a folder that names its
    own Python code (``auto_map``) is refused unless ``trust_remote_code`` (which lets
    transformers import and run that code), as are pickle weights and files named
    outside the folder; every loader is passed ``trust_remote_code`` explicitly, so
    nothing asks on stdin. A folder written from a swapped model (``moelab_routers.json``)
    is loaded with its moelab Routers (:func:`~moelab.integrations.hf.saved.load_swapped`)
    when ``swapped`` (the caller reads :func:`~moelab.integrations.hf.swap.swapped_routers`)
    and refused otherwise: a plain load would silently route with the family's own rule.
    Raises ValueError when the directory is not such a folder, UnsupportedModelError when
    its model is not an MoE family moelab reads."""
    from moelab.integrations.hf.saved import ROUTERS_JSON, load_swapped

    check_folder(model_dir, trust_remote_code)
    path = Path(model_dir)
    moelab_routers = _holds_routers(path)
    if moelab_routers and not swapped:
        raise ValueError(
            f"--hf {model_dir}: the folder holds the moelab routers of a swapped model "
            f"({ROUTERS_JSON}), which this command does not read (it would route with the "
            "family's own rule instead): read the folder with moelab stats --hf or moelab "
            "eval --hf, or load it in Python with moelab.integrations.hf.saved.load_swapped"
        )
    trust = bool(trust_remote_code)
    tf = import_transformers()
    tf.utils.logging.disable_progress_bar()  # moelab shows its own bar, over tokens
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
    try:
        family_of(config)
    except UnsupportedModelError:
        # NOTE: another model type may still be a generic ...TopKRouter family: look for
        # its routers on an empty (meta) model, before any weight is read
        with torch.device("meta"):
            moe_routers(tf.AutoModelForCausalLM.from_config(config, trust_remote_code=trust))
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust
        )
    except (OSError, ValueError) as err:
        bad = first_not_utf8(path)
        if bad is not None:  # a tokenizer file that is not UTF-8: name it
            raise ValueError(f"--hf {model_dir}: {bad}; {UTF8_HINT}") from err
        raise ValueError(
            f"--hf {model_dir}: no tokenizer there ({' '.join(str(err).split())[:200]}); "
            "save the tokenizer beside the model (tokenizer.save_pretrained(DIR))"
        ) from err
    cuda = torch.cuda.is_available()
    if dtype is None:
        dtype = "auto" if cuda else torch.float32  # type: ignore[assignment]
    if moelab_routers:
        model = load_swapped(path, dtype=dtype, trust_remote_code=trust)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, trust_remote_code=trust, use_safetensors=True
        )
        moe_routers(model)
    if cuda:
        model = model.cuda()
    return model.eval(), tokenizer


def read_texts(data: str | Path) -> list[Path]:
    """The text files of ``data``: the file itself, or the .txt/.md/.rst files of a
    folder (recursively, sorted). ValueError when there are none."""
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"--data {data}: the folder holds no {'/'.join(TEXT_SUFFIXES)} files")
        return files
    raise ValueError(f"--data {data}: no such file or folder; give a text file or a folder")


CHUNK_CHARS = 1 << 20
"""A text file is read and tokenised in pieces of about this many characters, cut at
line ends, so that memory does not grow with the file."""


def _pieces(path: Path) -> Iterator[str]:
    """The text of ``path`` in pieces of about CHUNK_CHARS characters, cut at line ends;
    ValueError naming the file (and its first bad byte) when it is not UTF-8."""
    try:
        with path.open(encoding="utf-8") as f:
            piece: list[str] = []
            size = 0
            for line in f:
                piece.append(line)
                size += len(line)
                if size >= CHUNK_CHARS:
                    yield "".join(piece)
                    piece, size = [], 0
            if piece:
                yield "".join(piece)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--data: {not_utf8(path, err)}; moelab reads text as UTF-8: convert the file "
            "(e.g. iconv -f latin1 -t utf-8) or leave it out"
        ) from None


def _doc_ids(tokenizer: Any, files: Sequence[Path]) -> Iterator[list[int]]:
    eos = tokenizer.eos_token_id
    for f in files:
        for piece in _pieces(f):
            yield list(tokenizer(piece, add_special_tokens=False).input_ids)
        if eos is not None:
            yield [int(eos)]


def check_max_tokens(max_tokens: int | None) -> None:
    """ValueError unless ``max_tokens`` is None or >= 2 (one target token)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {max_tokens}")


def token_batches(
    tokenizer: Any,
    files: Sequence[Path],
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
) -> Iterator[torch.Tensor]:
    """Batches ``(B, L)`` of token ids: the documents in order, each followed by EOS,
    as one stream cut into consecutive windows of ``seq_len`` tokens, ``batch_size``
    windows a batch; the last window may be shorter (it goes alone into a batch). At
    most ``max_tokens`` tokens in all (None: every token). Streams the text piece by
    piece (:data:`CHUNK_CHARS`)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one target token per window), got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_max_tokens(max_tokens)
    buf: list[int] = []
    rows: list[list[int]] = []
    left = math.inf if max_tokens is None else max_tokens
    for ids in _doc_ids(tokenizer, files):
        buf.extend(ids)
        while len(buf) >= seq_len and left >= seq_len:
            rows.append(buf[:seq_len])
            del buf[:seq_len]
            left -= seq_len
            if len(rows) == batch_size:
                yield torch.tensor(rows, dtype=torch.long)
                rows = []
        if left < seq_len:
            break
    if rows:
        yield torch.tensor(rows, dtype=torch.long)
    tail = buf[: int(min(left, len(buf)))]
    if len(tail) >= 2:
        yield torch.tensor([tail], dtype=torch.long)


# -- statistics --------------------------------------------------------------------------


def router_output(
    site: RouterSite, logits_TE: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor
) -> RouterOutput:
    """A RouterOutput of what one router returned: its logits (as scores and logits),
    :func:`stats_probs` over all E as probs, its ids and gate weights; every slot
    selected, none dropped."""
    z = logits_TE.detach().float().reshape(-1, site.n_experts)
    if site.rule is not None and site.rule.first == "probs":  # the router returned p
        z = z.clamp_min(torch.finfo(torch.float32).tiny).log()
    ids = ids_TK.detach().long().reshape(z.shape[0], -1)
    weights = weights_TK.detach().float().reshape(ids.shape)
    return RouterOutput(
        scores_TE=z,
        logits_TE=z,
        probs_TE=stats_probs(site.family, z) if site.rule is None else rule_probs(site.rule, z),
        ids_TK=ids,
        weights_TK=weights,
        selected_TK=torch.ones_like(ids, dtype=torch.bool),
        dropped_TK=torch.zeros_like(ids, dtype=torch.bool),
        aux_loss=z.new_zeros(()),
    )


def _layer(site: RouterSite) -> str:
    token = ", routed by token id" if site.by_token_id else ""
    return f"{site.layer} ({site.name}{token})"


class Seen:
    """What the router hooks of :func:`collect` captured per MoE layer of ``model``
    (the layer order of :func:`moe_routers`): the forward calls, the widths of the
    chosen experts (experts per token: the last dimension of the ids the router
    returned) and, on the device, the number of tokens whose chosen experts repeat one.
    Reading it costs one sync per check."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.sites = moe_routers(model)
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.calls = [0] * len(self.sites)
        self.widths: list[set[int]] = [set() for _ in self.sites]
        self._repeats: list[torch.Tensor | None] = [None] * len(self.sites)

    def add(self, layer: int, ids_TK: torch.Tensor) -> None:
        """Record one router call of MoE layer ``layer`` that chose ``ids_TK`` (..., K)."""
        k = int(ids_TK.shape[-1]) if ids_TK.dim() else 1
        self.calls[layer] += 1
        self.widths[layer].add(k)
        if k > 1:
            ids = ids_TK.detach().reshape(-1, k).sort(dim=-1).values
            n = (ids[:, 1:] == ids[:, :-1]).any(dim=-1).sum()
            old = self._repeats[layer]
            self._repeats[layer] = n if old is None else old + n

    def repeats(self) -> list[int]:
        """Per layer, the tokens whose chosen experts repeat one (fewer distinct experts
        than slots)."""
        return [0 if r is None else int(r) for r in self._repeats]

    def check_read(self) -> None:
        """UnsupportedModelError naming every MoE layer whose router never ran."""
        unread = [s for s, c in zip(self.sites, self.calls, strict=True) if c == 0]
        if unread:
            raise UnsupportedModelError(
                f"the routing of {len(unread)} of the {len(self.sites)} MoE layers of this "
                f"{self.model_type!r} model (family {self.sites[0].family.name}) was not "
                f"read: the router module of MoE layer {', '.join(map(_layer, unread))} "
                "never ran (its block routes by other means)"
            )

    def check_k(self, k: int, own: int | None = None) -> None:
        """UnsupportedModelError unless every MoE layer ran and chose ``k`` distinct
        experts for every token; it names the family and each layer that did not, and
        suggests the model's own K (``own``) when that is another."""
        self.check_read()
        off: dict[str, list[str]] = {}  # what was chosen instead: the layers
        for site, widths, rep in zip(self.sites, self.widths, self.repeats(), strict=True):
            if widths != {k}:
                got = f"chose {' or '.join(map(str, sorted(widths)))} experts per token"
            elif rep:
                got = f"repeated an expert for {rep} tokens"
            else:
                continue
            off.setdefault(got, []).append(_layer(site))
        if off:
            found = "; ".join(
                f"MoE layer{'s' if len(ls) > 1 else ''} {', '.join(ls)} {got}"
                for got, ls in off.items()
            )
            hint = f": sweep its own K only (--top-k {own})" if own is not None and own != k else ""
            raise UnsupportedModelError(
                f"top-k {k} was not applied to this {self.model_type!r} model (family "
                f"{self.sites[0].family.name}): with top_k = {k} set, {found}; the sweep "
                f"cannot set K = {k} on this model{hint}"
            )


PENDING_ELEMENTS = 1 << 20
"""Router logits (entries) a layer's hook holds before adding them to the statistics:
many small batches are added as one, so the statistics' few dozen operations run once
per 2**20 logits (4 MiB in float32 per layer), not once per forward."""


@contextlib.contextmanager
def collect(
    model: torch.nn.Module, acc: ModelRoutingStats | None = None, seen: Seen | None = None
) -> Iterator[ModelRoutingStats]:
    """Inside the block, every forward of ``model`` adds its routing to ``acc`` (a new
    ModelRoutingStats of the model's MoE layers by default), which the block yields,
    and the chosen experts to ``seen`` when given (a :class:`Seen` of the same model).
    Each hook reads its router's output at once (a copy) and adds it to ``acc`` when
    the layer holds :data:`PENDING_ELEMENTS` logits and when the block ends, so read
    ``acc`` after the block. The hooks are removed on exit; when the block raises, what
    was held is dropped."""
    sites = moe_routers(model)
    if acc is None:
        acc = ModelRoutingStats(len(sites), sites[0].family.map)
    held: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
        s.layer: [] for s in sites
    }

    def add(site: RouterSite) -> None:
        parts = held[site.layer]
        if parts:
            z, w, ids = (torch.cat(list(p)) for p in zip(*parts, strict=True))
            parts.clear()
            acc.layers[site.layer].update(router_output(site, z, w, ids))

    def hook_for(site: RouterSite) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            try:
                z, w, ids = site.read(output)
            except ValueError as err:
                raise UnsupportedModelError(
                    f"router {site.name} ({type(module).__name__}): {err}; this model's "
                    "routing cannot be read"
                ) from None
            # a copy, in router_output's (T, E) and (T, K) shapes: the model may change
            # its router's output in place after the hook
            z = z.detach().reshape(-1, site.n_experts).clone()
            ids = ids.detach().reshape(z.shape[0], -1).clone()
            held[site.layer].append((z, w.detach().reshape(ids.shape).clone(), ids))
            if sum(p[0].numel() for p in held[site.layer]) >= PENDING_ELEMENTS:
                add(site)
            if seen is not None:
                seen.add(site.layer, ids)

        return hook

    handles = [s.router.register_forward_hook(hook_for(s)) for s in sites]
    try:
        yield acc
        for s in sites:
            add(s)
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def collect_swapped(routers: Sequence[Any]) -> Iterator[ModelRoutingStats]:
    """:func:`collect` for swapped moelab Routers
    (:class:`~moelab.integrations.hf.swap.SwappedRouter`): each forward adds the Routers'
    own RouterOutput, with their map, to the yielded statistics."""
    config = routers[0].router.config
    acc = ModelRoutingStats(len(routers), config.map, config.alpha)

    def hook_for(i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            acc.layers[i].update(module.last)

        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield acc
    finally:
        for h in handles:
            h.remove()


def swapped_rule(routers: Sequence[Any]) -> str:
    """How swapped moelab Routers route, for the report's head line."""
    c = routers[0].router.config
    alpha = f" (alpha {c.alpha})" if c.alpha is not None else ""
    # the layers' rules, in layer order (DeepSeek-V4: hash layers, then top-k)
    rules = " / ".join(dict.fromkeys(r.router.config.selection for r in routers))
    return f"moelab routers, map {c.map}{alpha}, selection {rules}"


def token_bar(total: int | None, enabled: bool) -> Any:
    """The token bar on stderr; shown from its first update (``delay``), so that a pass
    whose first forward fails leaves the error line alone."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="tok", unit_scale=True, file=sys.stderr, disable=not enabled,
        desc="tokens", leave=False, delay=1e-9,
    )  # fmt: skip


class ModelCodeError(UnsupportedModelError):
    """The model's own (transformers) code failed in a forward moelab ran: no moelab
    frame between the call and the error. ``what``: the error and where it was raised
    (``"RuntimeError: ... (modeling_x.py:190 in forward)"``)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


_MOELAB = str(Path(__file__).resolve().parents[2]) + "/"
_TORCH = str(Path(torch.__file__).resolve().parent) + "/"


def _model_code_error(model: torch.nn.Module, err: BaseException) -> ModelCodeError | None:
    """A ModelCodeError for ``err``, raised in a forward of ``model`` called from this
    module, when no frame of moelab lies between that call and the error (a hook or a
    swapped router is moelab's, and its error stays as it is); None otherwise."""
    tb = err.__traceback__
    tb = tb.tb_next if tb is not None else None  # the frame of the call itself
    where = family = None
    while tb is not None:
        filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
        if filename.startswith(_MOELAB):
            return None
        if not filename.startswith(_TORCH):  # the model's code, not torch's machinery
            where = f"{Path(filename).name}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
            if Path(filename).name.startswith("modeling_"):  # the family's own module
                family = where
        tb = tb.tb_next
    if family is not None and family != where:
        where = f"{where}, called from {family}"
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    what = f"{type(err).__name__}: {text}" + (f" at {where}" if where else "")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    from moelab.integrations.hf.families import import_transformers

    version = getattr(import_transformers(), "__version__", "?")
    return ModelCodeError(
        f"this {model_type!r} model's own forward fails in transformers {version}'s code "
        f"({what}), so moelab cannot read it: check the folder's config.json against the "
        f"family's (a shape error often means sizes that do not fit together)",
        what,
    )


def forward(model: torch.nn.Module, x: torch.Tensor) -> Any:
    """``model(input_ids=x, use_cache=False)``; an error raised in the model's own code
    becomes a :class:`ModelCodeError` that says what failed and where (a moelab error
    stays as it is)."""
    try:
        return model(input_ids=x, use_cache=False)
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as err:
        if isinstance(err, UnsupportedModelError):
            raise
        code = _model_code_error(model, err)
        if code is None:
            raise
        raise code from err


@torch.no_grad()
def nll_pass(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    progress: Any = None,
) -> tuple[float, int]:
    """One pass over ``batches``: (summed next-token NLL in nats, target tokens). Each
    window of L tokens predicts its last L - 1 from the ones before them. An error of the
    model's own code is a :class:`ModelCodeError` (:func:`forward`)."""
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for x in batches:
        x = x.to(device)
        logits = forward(model, x).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            x[:, 1:].reshape(-1),
            reduction="sum",
        )
        total += float(loss)
        n += x[:, 1:].numel()
        if progress is not None:
            progress.update(x.numel())
    return total, n


def seq_len_for(model: torch.nn.Module, seq_len: int | None) -> int:
    if seq_len is not None:
        return seq_len
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    return int(min(1024, limit))


def hf_stats(
    model_dir: str | Path,
    data: str | Path,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
    loaded: tuple[Any, Any] | None = None,
    *,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Routing statistics of the MoE model in ``model_dir`` on the text ``data``.

    Returns the ``moelab stats`` JSON shape: ``{"run": model_dir, "model_type",
    "family", "rule", "map", "alpha", "top_k", "n_experts", "data", "nll", "tokens",
    "targets", "mean": {field: layer average}, "layers": [{"layer": i, "name": router
    module, "routed_by": "scores" or "token_id", field: value, ...}]}`` (fields of
    DESIGN.md section 3, see :mod:`moelab.diagnostics.accumulators`). A swapped model (or a
    folder saved from one) is read through its moelab Routers: their outputs, their map
    and alpha (null otherwise), and ``rule`` says so. ``seq_len`` defaults to min(1024, the model's
    max_position_embeddings); ``loaded``: an already loaded ``(model, tokenizer)``;
    ``trust_remote_code``: let a folder that names its own code run it
    (:func:`load_hf`; it runs that Python with your permissions).
    """
    from moelab.integrations.hf.swap import SwappedRouter

    check_max_tokens(max_tokens)
    files = read_texts(data)
    model, tokenizer = (
        load_hf(model_dir, trust_remote_code=trust_remote_code, swapped=True)
        if loaded is None
        else loaded
    )
    L = seq_len_for(model, seq_len)
    swapped = [(n, m) for n, m in model.named_modules() if isinstance(m, SwappedRouter)]
    if swapped:  # a swapped model (a folder saved from one): its moelab Routers' outputs
        routers = [m for _, m in swapped]
        names = [name for name, _ in swapped]
        by_token_id = [bool(getattr(r, "by_token_id", False)) for r in routers]
        r0 = routers[0]
        family, rule, alpha = r0.family, swapped_rule(routers), r0.router.config.alpha
        k, n_experts = r0.top_k, r0.num_experts
        collecting = collect_swapped(routers)
    else:
        sites = moe_routers(model)
        names, by_token_id = [s.name for s in sites], [s.by_token_id for s in sites]
        family, alpha = sites[0].family.name, None
        rule = first_rule(sites)
        k, n_experts = sites[0].top_k, sites[0].n_experts
        seen = Seen(model)
        collecting = collect(model, seen=seen)
    bar = token_bar(max_tokens, progress)
    with bar, collecting as acc:
        total, n = nll_pass(model, token_batches(tokenizer, files, L, batch_size, max_tokens), bar)
    if n == 0:
        raise ValueError(f"--data {data}: fewer than 2 tokens of text")
    if not swapped:
        seen.check_read()
    res = acc.result()
    for lay, name, by_id in zip(res["layers"], names, by_token_id, strict=True):
        lay["name"] = name
        lay["routed_by"] = "token_id" if by_id else "scores"
    return {
        "run": str(model_dir),
        "model_type": getattr(model.config, "model_type", None),
        "family": family,
        "rule": rule,
        "map": res["map"],
        "alpha": alpha,
        "top_k": k,
        "n_experts": n_experts,
        "data": str(data),
        "nll": total / n,
        "tokens": res["mean"]["states"] // len(names),
        "targets": n,
        "mean": res["mean"],
        "layers": res["layers"],
    }
