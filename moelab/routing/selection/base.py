"""The selection stage's base classes and registry: what every rule imports.

:class:`SelectionConfig` (the stage's settings), :class:`Selection` (the base class of
the rules), :class:`Budget` (what one router call routes with), :class:`Selected` (the
slots a rule fills) and the registry of rules by name (:func:`register`, :func:`get`,
...). The rules, one file each, import this module;
the package ``__init__`` imports the rules and registers them (see
:mod:`moelab.routing.selection`). Everything here is also importable from the package.

Shape suffixes: T, V, E, K (moelab.shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from moelab.routing import balancing
from moelab.routing._registry import Registry
from moelab.routing.selection import groups

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
    "register",
    "unregister",
]

SWEEPS = ("top_k", "threshold_scale")
"""The inference-time budget sweeps moelab.diagnostics runs (a rule's ``sweep``)."""

RANK_BY = ("logits", "probs")
"""The values of ``SelectionConfig.rank_by``."""

HASH_TABLES = ("random", "balanced")
"""The built tables of ``SelectionConfig.hash_table`` (:mod:`moelab.routing.selection.hash`);
besides them it takes a table read from a file, ``"file:PATH"`` or ``"file:PATH#KEY"``."""

HASH_TABLE_FILE = "file:"
"""The prefix of a ``hash_table`` read from a file
(:func:`moelab.routing.selection.hash.read_table`)."""


@dataclass(frozen=True)
class SelectionConfig:
    """The selection stage's settings, checked on construction (the general checks,
    then the rule's own, :meth:`Selection.check`). Each field is the ``RouterConfig``
    key of the same name (see there for what it means), which the Router passes on."""

    n_experts: int
    """E, the real experts the rule chooses among."""
    selection: str = "topk"
    """The rule, a name of :func:`available`."""
    top_k: int = 2
    noise_std: float = 0.0
    sample_extra: int = 0
    rank_by: str = "logits"
    n_groups: int | None = None
    topk_groups: int | None = None
    truncation: float = 0.0
    truncation_relative: bool = False
    token_cap_factor: float | None = None
    top_p: float = 0.4
    top_p_cap: int | None = None
    sinkhorn_iters: int = 8
    vocab_size: int | None = None
    hash_table: str = "random"
    # NOTE: the three below are other stages' settings that a rule reads as given (each
    # stage checks its own): the map's budget k, ReLU routing's target k (balancing) and
    # the capacity factor (balancing), which expert choice takes as its cf
    lapsum_k: float | None = None
    """The map's budget k, when it has one: a relative cut and a cut's nominal k read it."""
    l1_target: float | None = None
    """ReLU routing's target k (None: off): a cut then keeps every positive gate."""
    capacity_factor: float | None = None
    """The per-expert capacity factor (None: dropless)."""

    def __post_init__(self) -> None:
        rule = get(self.selection)
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must lie in [1, n_experts={self.n_experts}], got {self.top_k}")
        rule.check(self)
        if self.token_cap_factor is not None and not self.token_cap_factor > 0:
            raise ValueError(
                f"token_cap_factor (cap_factor) must be > 0, got {self.token_cap_factor}"
            )
        if self.noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {self.noise_std}")
        if self.sample_extra < 0:
            raise ValueError(f"sample_extra (c) must be >= 0, got {self.sample_extra}")
        if self.top_k + self.sample_extra > self.n_experts:
            raise ValueError(
                f"top_k + sample_extra = {self.top_k + self.sample_extra} exceeds "
                f"n_experts = {self.n_experts}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_p_cap is not None and not rule.takes_top_p_cap:
            raise ValueError(
                f"top_p_cap caps selection='top_p'; selection={self.selection!r} does not "
                "read it (unset top_p_cap)"
            )
        balancing.check_capacity_factor(self.capacity_factor)
        groups.check(self, rule.limits_groups)  # n_groups, topk_groups
        if self.sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive (or None), got {self.vocab_size}")
        from_file = self.hash_table.startswith(HASH_TABLE_FILE)
        if self.hash_table not in HASH_TABLES and not from_file:
            raise ValueError(
                f"hash_table must be one of {HASH_TABLES} or {HASH_TABLE_FILE}PATH[#KEY] (a "
                f"(V, K) table of expert ids in a file), got {self.hash_table!r}"
            )
        if from_file and not self.hash_table[len(HASH_TABLE_FILE) :].partition("#")[0]:
            raise ValueError(f"hash_table={self.hash_table!r} names no file: give file:PATH[#KEY]")
        if self.rank_by not in RANK_BY:
            raise ValueError(f"rank_by must be one of {RANK_BY}, got {self.rank_by!r}")


@dataclass(frozen=True)
class Budget:
    """What one router call routes with, besides the scores."""

    top_k: int
    """K of this call: ``Router.top_k``, or the ``top_k=`` of the call."""
    lapsum_k: float | torch.Tensor | None
    """The map's budget k of this call (a learned per-layer k_l, possibly a 0-d tensor);
    None: the configured ``lapsum_k``."""
    truncation: float
    """``Router.truncation``: the cut on p as stored (a calibrated one, or the
    configured ``RouterConfig.truncation``); :meth:`Selection.cut` reads it."""
    training: bool
    """The router is in training mode (exploration applies)."""
    generator: torch.Generator | None = None
    """Random numbers of the exploration (noise, sampling)."""
    token_ids_T: torch.Tensor | None = None
    """The input token id of each of the T tokens (int64), when the caller knows them
    (the model passes them down; a rule that routes by token id needs them)."""
    seq_len: int | None = None
    """S when the T tokens are B whole sequences of length S laid out sequence-major
    (T = B * S, as the model flattens (B, S, D)); None: no sequence structure known."""


class Selected(NamedTuple):
    """The slots a selection rule fills."""

    ids_TK: torch.Tensor
    """int64 expert of each slot."""
    selected_TK: torch.Tensor
    """bool: the slot holds a selected expert (False: an unused slot, weight 0)."""


class Selection(nn.Module):
    """Base class of the selection rules: the ranking shared by all of them, and the
    answers of a rule that states nothing else (a fixed ``top_k`` experts per token)."""

    name: ClassVar[str] = ""
    """The registry key, the value of ``SelectionConfig.selection``."""
    truncates: ClassVar[bool] = False
    """A token-dependent number of experts (a cut on p), not a fixed count."""
    sweep: ClassVar[str] = "top_k"
    """What the inference-time budget sweep varies: one of :data:`SWEEPS`."""
    calibrates: ClassVar[bool] = False
    """The rule cuts p at ``Router.truncation`` and training calibrates that cut so that
    about k experts pass it (k: the map's budget, ``lapsum_k`` or a learned k_l)."""
    limits_groups: ClassVar[bool] = False
    """The rule may follow group-limited choice (``n_groups`` > 1): it chooses among the
    experts whose ranking score is finite, at most ``top_k`` of them; the config refuses
    ``n_groups`` with a rule that answers False."""
    takes_top_p_cap: ClassVar[bool] = False
    """The rule reads ``top_p_cap`` (its K); the config refuses that key elsewhere."""
    learns_through_gate: ClassVar[bool] = False
    """The router learns the rule's choice only through the gate weights of its K slots
    (top-K): a gate that is constant with one slot (renorm with K = 1) would leave it
    untrained, a pairing the Router's wiring refuses
    (:func:`moelab.routing.pairings.one_slot_gate`)."""
    learned_choice: ClassVar[bool] = True
    """The choice follows the router's scores, so the balancing bias can move it (hash
    routing: False, and the wiring refuses ``bias_rate``)."""
    reads_batch: ClassVar[str] = ""
    """When a token's choice depends on the other tokens of the call: ``""`` never
    (each token's choice reads its own scores), ``"always"`` or ``"training"``; with
    :attr:`reads_batch_why`, the reason (``moelab analyze invariance`` names it)."""
    reads_batch_why: ClassVar[str] = ""

    def __init__(self, config: SelectionConfig) -> None:
        super().__init__()
        self.config = config

    # ---------------------------------------------------------- questions on the config

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        """Raise ValueError, saying what to change, for settings this rule cannot use.
        Called when the :class:`SelectionConfig` is built, after the first general
        checks (a known rule, ``top_k`` in [1, E])."""

    @classmethod
    def slots(cls, config: SelectionConfig, lapsum_k: float | torch.Tensor | None = None) -> int:
        """K, the slots per token (the width of ids_TK), for the map's budget
        ``lapsum_k`` of a call (None: the configured one)."""
        return config.top_k

    @classmethod
    def router_top_k(cls, config: SelectionConfig) -> int:
        """The K a router of this rule starts with (``Router.top_k``, what a call routes
        with unless it passes ``top_k=``): ``top_k``."""
        return config.top_k

    @classmethod
    def expected_experts(cls, config: SelectionConfig) -> float:
        """The experts a token is expected to reach per layer: what ``moelab params``
        counts as active (a truncating rule: its nominal k)."""
        return float(cls.slots(config))

    # ---------------------------------------------------------------- the computation

    def rank(self, logits_TE: torch.Tensor, bias_E: torch.Tensor, budget: Budget) -> torch.Tensor:
        """The scores experts are ranked by: the detached logits plus the balancing
        bias (it moves the choice, never the gate) and, in training, Gaussian noise of
        std ``noise_std`` (exploration). With group-limited choice :meth:`forward`
        passes the map's values in place of the logits (DeepSeek-V3 adds the bias to
        the sigmoid affinities), and so does ``rank_by="probs"`` (LongCat-Flash adds it
        to the softmax values)."""
        rank_TE = logits_TE.detach() + bias_E
        std = self.config.noise_std
        if budget.training and std > 0:
            noise = torch.randn(rank_TE.shape, generator=budget.generator, device=rank_TE.device)
            rank_TE = rank_TE + std * noise
        return rank_TE

    def select(self, rank_TE: torch.Tensor, probs_TE: torch.Tensor, budget: Budget) -> Selected:
        """The rule itself: the slots of each token from the ranking scores and the
        map's values."""
        raise NotImplementedError(f"selection {self.name!r} does not implement select()")

    def ranking_scores(self, logits_TE: torch.Tensor, probs_TE: torch.Tensor) -> torch.Tensor:
        """The scores the rule ranks, before the bias and any noise: the map's values
        under ``rank_by="probs"`` or group-limited choice (DeepSeek-V3 chooses by a + b),
        else the logits."""
        if self.config.rank_by == "probs" or groups.enabled(self.config):
            return probs_TE
        return logits_TE

    def forward(
        self, logits_TE: torch.Tensor, probs_TE: torch.Tensor, bias_E: torch.Tensor, budget: Budget
    ) -> Selected:
        rank_TE = self.rank(self.ranking_scores(logits_TE, probs_TE), bias_E, budget)
        if groups.enabled(self.config):  # DeepSeek-V3: choose by a + b, within M groups
            rank_TE = groups.limit_groups(rank_TE, self.config, budget.top_k, budget.training)
        return self.select(rank_TE, probs_TE, budget)

    @property
    def needs_token_counts(self) -> bool:
        """The rule builds state from the training data's token frequencies: training
        calls :meth:`balance` with them once, before the first step."""
        return False

    def balance(self, counts_V: torch.Tensor) -> None:
        """Build the rule's state from ``counts_V`` (V,), how often each token id occurs
        in the training data; only for a rule whose ``needs_token_counts`` is true."""
        raise ValueError(f"selection {self.name!r} builds nothing from token counts")

    # ----------------------------------------------------------------- the cut on p

    def cut(
        self, truncation: float, lapsum_k: float | torch.Tensor | None = None
    ) -> float | torch.Tensor | None:
        """The cut on p a call applies, from the stored ``truncation`` and the map's
        budget ``lapsum_k`` of the call; None: the rule has no cut."""
        return None

    def stored(self, cut: float, lapsum_k: float | torch.Tensor) -> float:
        """The ``Router.truncation`` whose :meth:`cut` at ``lapsum_k`` is ``cut`` (what
        :meth:`Router.calibrate` stores)."""
        raise ValueError(
            f"selection {self.name!r} has no cut on p to calibrate (calibrates = False)"
        )


def _check_sweep(rule: type[Selection]) -> None:
    if rule.sweep not in SWEEPS:
        raise ValueError(f"{rule.__name__}.sweep must be one of {SWEEPS}, got {rule.sweep!r}")


_RULES: Registry[type[Selection]] = Registry("selection", validate=_check_sweep)
register = _RULES.register
unregister = _RULES.unregister
available = _RULES.available
get = _RULES.get
