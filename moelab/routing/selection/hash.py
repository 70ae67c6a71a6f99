"""Hash routing (``selection="hash"``; Roller et al., 2021, *Hash Layers For Large Sparse
Models*, https://arxiv.org/abs/2106.04426).

A fixed table sends each input token id to its experts, whatever the hidden state: there
is no learned choice. The table ``table_VK`` holds K = ``top_k`` distinct experts for
each of the V = ``vocab_size`` token ids (Roller et al. mostly route to K = 1); it is a
buffer of the rule, so it lives in the router's state dict and travels with checkpoints.
The rule needs the tokens' ids (``Budget.token_ids_T``; the model passes its input ids
through ``MoE.forward(token_ids=...)``) and refuses a call without them, such as a
``Router`` called on bare hidden states. ``RouterConfig.vocab_size`` gives V; the model
sets it from ``ModelConfig.vocab_size``.

Tables (``RouterConfig.hash_table``):

* ``"random"`` (default, the paper's random hash): each token id gets K distinct experts
  drawn uniformly at construction, from torch's global RNG, so the table follows the
  model's seed.
* ``"balanced"`` (the paper's balanced assignment): token ids are assigned, most frequent
  first, to the expert of least load so far (the load: the summed frequencies of the
  ids already assigned; ties go to the lower expert index): Roller et al.'s greedy
  filling of the emptiest bucket, most frequent token first; for K > 1 the pass repeats
  once per column on the accumulated load, each id skipping the experts already in its
  row (:func:`balanced_table`). The frequencies come from the training data: training
  calls :meth:`Hash.balance` once before the first step with the token counts of the
  training shard. Ids that never occur (count 0, and every id before
  :meth:`Hash.balance` is called) take experts round-robin in id order.
* ``"file:PATH"`` or ``"file:PATH#KEY"`` (a table made elsewhere, e.g. DeepSeek-V4's
  ``tid2eid``, the (V, K) token id -> experts buffer of its hash-routed layers, as its
  checkpoint stores it): the table is read from PATH (:func:`read_table`: a
  ``.safetensors`` file, the tensor named KEY, or its only tensor; a sharded checkpoint
  folder and KEY; a ``.npy`` array; a ``.pt`` file of a tensor or a dict of them) when
  the rule is built, and checked (:func:`check_table`: integer ids in [0, E), K
  distinct experts per row, V rows = ``vocab_size``, K = ``top_k``). Checking the
  config reads it too, so a bad file fails at once, but for its rows: a training run
  checks its config before its tokenizer sets the model's V, so V is checked when the
  rule is built. The file must stay readable wherever the config is built again (a
  loaded run reads it, then takes the checkpoint's copy of the table). A table in
  memory goes in with :meth:`Hash.load_table`.

The gate stage weights the chosen experts as for any rule: by default the map's value at
the chosen expert, a learned score (the router's weight gets its gradient from it);
``renorm=True`` with K = 1 gives weight 1 (the paper's plain hash layer: the router's
weight then gets a zero gradient). The balancing bias and the exploration do not apply
(no learned choice), so ``bias_rate``, ``noise_std`` and ``sample_extra`` are refused.

At inference K may change: a call with K below the table's width (the trained
``top_k``) uses the first K experts of each id's row (for a random table, a random
subset of K); a call with K above it routes to the table's experts and leaves the other
slots unused (``selected_TK`` false, weight 0), since the table knows no more experts
for an id: ``moelab eval --top-k`` then reports the trained width as
``active_experts``. Each token is routed on its own id: the rule is causal.

Shape suffixes: T, V, E, K (moelab.shapes).
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moelab.maps import host_checks
from moelab.routing.selection.base import (
    HASH_TABLE_FILE,
    HASH_TABLES,
    Budget,
    Selected,
    Selection,
    SelectionConfig,
)

__all__ = ["TABLES", "Hash", "balanced_table", "check_table", "random_table", "read_table"]

TABLES = HASH_TABLES
"""The built tables of ``SelectionConfig.hash_table`` (besides ``"file:PATH[#KEY]"``)."""


def random_table(
    vocab_size: int, n_experts: int, top_k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """int64 (V, K): each row K distinct experts, uniformly at random (the first K of a
    random permutation of the E experts)."""
    return torch.rand(vocab_size, n_experts, generator=generator).argsort(dim=1)[:, :top_k]


def balanced_table(counts_V: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """int64 (V, K): the greedy balanced assignment of the token ids by frequency.

    Column by column: the ids of positive count, most frequent first (ties: lower id
    first), each take the expert of least load (ties: lower expert first) among those not
    yet in its row, which then carries the id's count; column 0 is Roller et al.'s
    balanced assignment. (Taking an id's K least-loaded experts at once would move the
    experts in fixed groups of K that always see the same ids.) Ids of count 0 take
    experts round-robin in id order, the j-th of them experts (j * K + i) mod E, i < K."""
    counts = [int(c) for c in counts_V.tolist()]
    rows: list[list[int]] = [[] for _ in counts]
    order = sorted((v for v, c in enumerate(counts) if c > 0), key=lambda v: -counts[v])
    heap = [(0, e) for e in range(n_experts)]  # (load, expert): a valid heap as it is
    for _ in range(top_k):
        for v in order:
            skipped = []
            while heap[0][1] in rows[v]:  # at most K - 1 experts are in the row
                skipped.append(heapq.heappop(heap))
            load, e = heapq.heappop(heap)
            rows[v].append(e)
            heapq.heappush(heap, (load + counts[v], e))
            for item in skipped:
                heapq.heappush(heap, item)
    unseen = [v for v, c in enumerate(counts) if c == 0]
    for j, v in enumerate(unseen):
        rows[v] = [(j * top_k + i) % n_experts for i in range(top_k)]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(counts), top_k)


def read_table(spec: str) -> torch.Tensor:
    """The table a ``hash_table="file:PATH[#KEY]"`` names, as stored (not yet checked,
    see :func:`check_table`): from a ``.safetensors`` file the tensor KEY (without KEY:
    its only tensor), from a folder of a sharded ``save_pretrained`` checkpoint the
    tensor KEY of the shard its ``model.safetensors.index.json`` names (DeepSeek-V4:
    ``file:CKPT#model.layers.0.mlp.gate.tid2eid``, the key as the checkpoint spells
    it), from a ``.npy`` file its array, from a ``.pt`` / ``.pth`` file its tensor or,
    in a dict of tensors, KEY (or the only one).

    Raises:
        ValueError: not a ``file:`` spec, a missing file, an unknown suffix, a missing
            KEY, or a file of several tensors and no KEY (the message lists some).
    """
    if not spec.startswith(HASH_TABLE_FILE):
        raise ValueError(f"a table file is named {HASH_TABLE_FILE}PATH[#KEY], got {spec!r}")
    path, _, key = spec[len(HASH_TABLE_FILE) :].partition("#")
    if not path:
        raise ValueError(f"hash_table={spec!r} names no file: give file:PATH[#KEY]")
    file = Path(path).expanduser()
    if file.is_dir():  # a sharded checkpoint folder: the shard its index names for KEY
        file = _shard_of(spec, file, key)
    if not file.is_file():
        raise ValueError(f"hash_table={spec!r}: no file {file}")
    suffix = file.suffix.lower()
    if suffix == ".npy":
        if key:
            raise ValueError(f"hash_table={spec!r}: a .npy file holds one array, drop #{key}")
        return torch.from_numpy(np.load(file, allow_pickle=False))
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            return f.get_tensor(_one_key(spec, names, key))
    if suffix in (".pt", ".pth"):
        data = torch.load(file, map_location="cpu", weights_only=True)
        if isinstance(data, torch.Tensor):
            if key:
                raise ValueError(f"hash_table={spec!r}: the file holds one tensor, drop #{key}")
            return data
        if isinstance(data, dict):
            return data[_one_key(spec, list(data), key)]
        raise ValueError(f"hash_table={spec!r}: the file holds {type(data).__name__}, not a tensor")
    raise ValueError(
        f"hash_table={spec!r}: read tables from .safetensors, .npy or .pt files, not {suffix!r}"
    )


def _shard_of(spec: str, folder: Path, key: str) -> Path:
    """The ``.safetensors`` shard of ``folder`` (a ``save_pretrained`` checkpoint) that
    holds tensor ``key``, from its ``model.safetensors.index.json``."""
    index = folder / "model.safetensors.index.json"
    if not key or not index.is_file():
        raise ValueError(
            f"hash_table={spec!r}: a folder is read as a sharded checkpoint: it needs "
            "model.safetensors.index.json and the tensor's name, file:FOLDER#KEY"
        )
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    if key not in weight_map:
        raise ValueError(f"hash_table={spec!r}: the checkpoint's index has no tensor {key!r}")
    return folder / weight_map[key]


def _one_key(spec: str, names: list[str], key: str) -> str:
    if key:
        if key not in names:
            raise ValueError(f"hash_table={spec!r}: the file has no tensor {key!r}")
        return key
    if len(names) != 1:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(
            f"hash_table={spec!r}: the file holds {len(names)} tensors ({shown}); name one "
            "as file:PATH#KEY"
        )
    return names[0]


def check_table(
    table_VK: torch.Tensor, vocab_size: int | None, n_experts: int, top_k: int
) -> torch.Tensor:
    """``table_VK`` as the int64 table of a hash rule over ``vocab_size`` ids and
    ``n_experts`` experts with K = ``top_k``, after checking it: 2-D of shape (V, K),
    integer dtype, every id in [0, E), K distinct experts per row (``vocab_size`` None:
    any V).

    Raises:
        ValueError: in one line, what is wrong and what the rule expects.
    """
    table = torch.as_tensor(table_VK)
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise ValueError(f"a hash table holds integer expert ids, got dtype {table.dtype}")
    if table.dim() != 2:
        raise ValueError(f"a hash table is (V, K), got shape {tuple(table.shape)}")
    V, K = table.shape
    if vocab_size is not None and V != vocab_size:
        raise ValueError(
            f"the hash table has {V} rows but the model's vocab_size is {vocab_size}: it "
            "needs one row per token id (a table for another tokenizer?)"
        )
    if K != top_k:
        raise ValueError(
            f"the hash table has K = {K} experts per token id but router.top_k = {top_k}: "
            f"set top_k = {K}"
        )
    table = table.to(torch.int64)
    if bool(((table < 0) | (table >= n_experts)).any()):
        raise ValueError(
            f"the hash table's expert ids must lie in [0, n_experts = {n_experts}), got "
            f"[{int(table.min())}, {int(table.max())}]"
        )
    repeats_V = (table.sort(dim=1).values.diff(dim=1) == 0).any(dim=1)  # (V,); K = 1: none
    if bool(repeats_V.any()):
        bad = int(repeats_V.nonzero()[0, 0])
        raise ValueError(
            f"the hash table lists an expert twice for token id {bad} ({table[bad].tolist()}); "
            "each row needs K distinct experts"
        )
    return table


class Hash(Selection):
    """The K experts of each token's id in a fixed table; every slot is selected."""

    name = "hash"
    learned_choice = False  # the wiring refuses bias_rate

    def __init__(self, config: SelectionConfig) -> None:
        super().__init__(config)
        assert config.vocab_size is not None  # check() refuses hash without it
        V, E, K = config.vocab_size, config.n_experts, config.top_k
        if config.hash_table == "random":
            table_VK = random_table(V, E, K)
        elif config.hash_table == "balanced":
            table_VK = balanced_table(torch.zeros(V, dtype=torch.int64), E, K)
        else:  # "file:PATH[#KEY]"; check() checked it but for V
            try:
                table_VK = check_table(read_table(config.hash_table), V, E, K)
            except ValueError as err:
                raise ValueError(f"hash_table={config.hash_table!r}: {err}") from None
        self.register_buffer("table_VK", table_VK)

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        if config.vocab_size is None:
            raise ValueError(
                "selection='hash' maps token ids to experts and needs vocab_size (V): "
                "set RouterConfig(vocab_size=V); a model sets it from ModelConfig.vocab_size"
            )
        for key in ("noise_std", "sample_extra"):
            if getattr(config, key):
                raise ValueError(
                    f"selection='hash' has no learned choice for {key} to act on: set {key}=0"
                )
        if config.hash_table.startswith(HASH_TABLE_FILE):
            table_VK = read_table(config.hash_table)  # its messages name the file
            try:  # NOTE: V when the rule is built (a run's tokenizer sets it after this)
                check_table(
                    table_VK,
                    None,
                    config.n_experts,
                    config.top_k,
                )
            except ValueError as err:
                raise ValueError(f"hash_table={config.hash_table!r}: {err}") from None

    @property
    def needs_token_counts(self) -> bool:
        """The table is built from the training data's token frequencies: training calls
        :meth:`balance` with them before the first step (``hash_table="balanced"``)."""
        return self.config.hash_table == "balanced"

    @torch.no_grad()
    def balance(self, counts_V: torch.Tensor) -> None:
        """Rebuild the ``"balanced"`` table from ``counts_V`` (V,), the number of times
        each token id occurs in the training data (:func:`balanced_table`)."""
        if not self.needs_token_counts:
            raise ValueError(
                f"hash_table={self.config.hash_table!r} is drawn at construction; balance() "
                "builds the frequency-balanced table of hash_table='balanced'"
            )
        counts_V = torch.as_tensor(counts_V)
        V = self.config.vocab_size
        if tuple(counts_V.shape) != (V,) or bool((counts_V < 0).any()):
            raise ValueError(
                f"counts_V must hold a count >= 0 for each of the V = {V} token ids, got "
                f"shape {tuple(counts_V.shape)}"
            )
        K = self.table_VK.shape[1]
        self.table_VK.copy_(balanced_table(counts_V, self.config.n_experts, K))

    @torch.no_grad()
    def load_table(self, table_VK: torch.Tensor) -> None:
        """Route by ``table_VK`` (V, K) from now on (e.g. DeepSeek-V4's ``tid2eid`` of one
        layer), checked by :func:`check_table` against this rule's V, E and K; the table
        is the rule's buffer, so it is saved with the router."""
        V, E = self.config.vocab_size, self.config.n_experts
        assert V is not None
        self.table_VK.copy_(check_table(table_VK, V, E, self.table_VK.shape[1]))

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        ids_T = budget.token_ids_T
        if ids_T is None:
            raise ValueError(
                "selection='hash' routes by token id: pass the tokens' input ids "
                "(Router(..., token_ids_T=ids), MoE(..., token_ids=ids)); the model passes "
                "them, a router called on bare hidden states cannot hash"
            )
        V, width = self.table_VK.shape
        if host_checks() and bool(((ids_T < 0) | (ids_T >= V)).any()):
            raise ValueError(f"token ids must lie in [0, vocab_size = {V})")
        ids_TK = self.table_VK[ids_T, : budget.top_k]
        selected_TK = torch.ones_like(ids_TK, dtype=torch.bool)
        if budget.top_k > width:  # the table's experts, then unused slots
            spare = budget.top_k - width
            ids_TK = torch.cat([ids_TK, ids_TK[:, :1].expand(-1, spare)], dim=1)
            selected_TK = F.pad(selected_TK, (0, spare), value=False)
        return Selected(ids_TK, selected_TK)
