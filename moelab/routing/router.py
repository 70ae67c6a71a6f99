"""The router: a pipeline of small stages, wired together.

    x_TD --(jitter)--scorer--> scores_TE --temperature--> logits_TE --map--> probs_TE
         --selection--> ids_TK, selected_TK --gate--> weights_TK
         --balancing--> dropped_TK, aux_loss

Shape suffixes: T, D, E, K (moelab.shapes).

Every stage is independent of the others' variants: any map works with any
selection, gate and balancing method. Each stage takes a small config of its own
settings, which ``RouterConfig`` (the flat, public front) builds; the Router only wires
the stages. The pairings that cannot train are refused by
:mod:`moelab.routing.pairings`: at construction (``RouterConfig``) and, for the K of a
call, in :meth:`Router.forward`. The selection rules are plug-ins
(:mod:`moelab.routing.selection`): the router asks its rule, never its name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from moelab import maps
from moelab.routing import balancing, gates, losses, mapping, pairings, relu_l1, scorer
from moelab.routing.allocation import ThresholdCalibrator
from moelab.routing.config import RouterConfig
from moelab.routing.gates import gate_weights
from moelab.routing.losses import Routed
from moelab.routing.output import RouterOutput
from moelab.routing.selection import Budget
from moelab.routing.temperature import Temperature

__all__ = ["Router", "apply_map", "gate_weights", "routers_top_k", "split_null", "step_routers"]


def apply_map(
    config: RouterConfig, logits_TE: torch.Tensor, lapsum_k: float | torch.Tensor | None = None
) -> torch.Tensor:
    """The configured probability map on all E logits, with its parameters from the
    config (``config.map_params``) and, for a map with a budget k, the ``lapsum_k`` of
    this call when given (a learned per-layer k): :func:`moelab.routing.mapping.apply_map`
    of ``config.map_config``."""
    return mapping.apply_map(config.map_config, logits_TE, lapsum_k)


def split_null(
    config: RouterConfig, ids_TK: torch.Tensor, chosen_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Null experts (ids >= E): ``(selected_TK, null_TK, gated_TK)``, the slots of a real
    expert, those of a null one (None without null experts) and those the gate weighs.
    An "identity" null expert outputs x times its weight (a "constant" one its weight
    times a mix of x and its vector), so the gate weighs (and renorm normalises over)
    every chosen slot; a "zero" one outputs nothing, so only
    the real slots are weighed: renorm normalises over the selected real experts, as
    AdaMoE's code does, and a zero null slot keeps weight 0."""
    if not config.n_null_experts:
        return chosen_TK, None, chosen_TK
    null_TK = chosen_TK & (ids_TK >= config.n_experts)
    selected_TK = chosen_TK & ~null_TK
    return selected_TK, null_TK, chosen_TK if config.null_outputs else selected_TK


class Router(nn.Module):
    """Scores tokens against E experts (and M null experts, ``n_null_experts``: the
    weight and the bias have E + M rows) and decides where each token goes.

    ``top_k`` and ``truncation`` (the cut on p of a truncating rule; old name
    ``threshold``) are plain attributes: change them at inference to route with
    another budget without touching the weights, or pass ``top_k=`` to a call.
    ``selection`` is the selection rule (:mod:`moelab.routing.selection`), built from
    ``config.selection``.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        # NOTE: a map with fused CPU kernels loads them now, in eager mode, so that a
        # compiled forward finds them loaded (loading cannot be traced); the others never
        # build or import them
        if maps.info(config.map).cpu_kernels:
            maps.backend()
        # the scorer's weight and optional bias (scorer_bias); a bias that is off is None,
        # so that the state dict keeps its keys
        self.weight, bias = scorer.scorer_parameters(config.scorer_config)
        self.register_parameter("scorer_bias", bias)
        self.temperature = Temperature(config.temperature_config)
        self.map_config = config.map_config
        selection_config = config.selection_config
        self.selection = config.selection_rule(selection_config)
        self.gate = gates.build(config.gate_config)
        # the pairing refused at construction, for the K of a call (Router.top_k may change)
        self.one_slot_refused = (
            self.selection.learns_through_gate and self.gate.constant_at_one_slot
        )
        self.balancing_config = balance = config.balancing_config
        self.aux_losses = losses.losses_on(balance)
        # auxiliary-loss-free balancing: shifts selection only, never the gate
        self.register_buffer("bias", torch.zeros(balance.n_scored))
        # ReLU routing's adaptive L1 (l1_target): lambda, the same in every router, and
        # the zero-gate fraction S it last moved by (not saved); None buffers otherwise
        on = balance.l1_target is not None
        self.register_buffer("l1_coef", torch.tensor(balance.l1_init) if on else None)
        self.register_buffer("l1_sparsity", torch.tensor(float("nan")) if on else None, False)
        self.top_k = config.selection_rule.router_top_k(selection_config)
        self.truncation = config.truncation

    @property
    def threshold(self) -> float:
        """Old name of ``truncation`` (an alias)."""
        return self.truncation

    @threshold.setter
    def threshold(self, value: float) -> None:
        self.truncation = value

    def forward(
        self,
        x_TD: torch.Tensor,
        top_k: int | None = None,
        lapsum_k: float | torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        token_ids_T: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> RouterOutput:
        """Route the tokens ``x_TD`` (T, D) with K = ``top_k`` (None: ``self.top_k``),
        the map's budget ``lapsum_k`` (None: the configured one) and the ``generator`` of
        the exploration and the input jitter (training only). ``token_ids_T`` (T,) are
        the tokens' input ids and ``seq_len`` the length S of the sequences the T = B * S
        tokens come from, when known (the MoE layer passes both; see :class:`Budget`).

        The forward has no host sync: it compiles to one graph (``torch.compile(router,
        fullgraph=True)``) with every map and selection rule. Under compile the input
        checks that read values are skipped (:func:`moelab.maps.checks`) and exploration
        draws from the global RNG (a ``generator`` cannot be traced)."""
        cfg = self.config
        budget = self._budget(x_TD, top_k, lapsum_k, generator, token_ids_T, seq_len)
        # NOTE: the router runs in float32 even under bf16 autocast: small score
        # differences decide the selection and the sparse maps' supports.
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            if budget.training and cfg.jitter > 0:  # the router's copy of x only
                x_TD = scorer.jitter(x_TD, cfg.jitter, self.weight, budget.generator)
            scores_TE = scorer.scores(x_TD, self.weight, self.scorer_bias)  # scorer
            logits_TE = self.temperature(scores_TE)  # temperature
            probs_TE = mapping.apply_map(self.map_config, logits_TE, lapsum_k)  # map
            pairings.one_slot_gate_in_training(self.one_slot_refused, budget.top_k, budget.training)
            ids_TK, chosen_TK = self.selection(logits_TE, probs_TE, self.bias, budget)
            selected_TK, null_TK, gated_TK = split_null(cfg, ids_TK, chosen_TK)
            weights_TK = self.gate(probs_TE.gather(-1, ids_TK), gated_TK)  # gate
            routed = Routed(logits_TE, probs_TE, ids_TK, chosen_TK, weights_TK, budget.seq_len)
            dropped_TK, aux, named = self.balance(routed)  # balancing
        return RouterOutput(
            scores_TE=scores_TE,
            logits_TE=logits_TE,
            probs_TE=probs_TE,
            ids_TK=ids_TK,
            weights_TK=weights_TK,
            selected_TK=selected_TK,
            dropped_TK=dropped_TK,
            aux_loss=aux,
            losses=named,
            temperature=self.temperature.tau.detach(),
            null_TK=null_TK,
            n_null=cfg.n_null_experts,
        )

    def balance(self, routed: Routed) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The balancing stage: ``(dropped_TK, aux_loss, losses)``, the slots the
        capacity limit refuses, the weighted sum of the auxiliary losses that are on
        (:mod:`moelab.routing.losses`) and each of them unweighted, by name."""
        cfg, r = self.balancing_config, routed
        # NOTE: fillers (weight exactly 0) are never computed, so they take no capacity;
        # the Switch rule runs over the slots that would be computed. Null slots take
        # no capacity either; with null experts the capacity is over the E + M experts.
        routed_TK = r.chosen_TK & (r.weights_TK.detach() != 0) & (r.ids_TK < cfg.n_experts)
        dropped_TK = balancing.capacity_drop(r.ids_TK, routed_TK, cfg.n_scored, cfg.capacity_factor)
        named = {loss.name: loss(r) for loss in self.aux_losses}
        aux = r.logits_TE.new_zeros(())
        for loss in self.aux_losses:
            aux = aux + loss.weight(self) * named[loss.name]
        return dropped_TK, aux, named

    def _budget(
        self,
        x_TD: torch.Tensor,
        top_k: int | None,
        lapsum_k: float | torch.Tensor | None,
        generator: torch.Generator | None,
        token_ids_T: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> Budget:
        """What this call routes with, checked."""
        n_experts, d_model = self.config.n_experts, self.config.d_model
        k = self.top_k if top_k is None else int(top_k)
        if not 1 <= k <= n_experts:
            raise ValueError(f"top_k must lie in [1, {n_experts}], got {k}")
        if x_TD.dim() != 2 or x_TD.shape[-1] != d_model:
            raise ValueError(f"expected tokens of shape (T, {d_model}), got {tuple(x_TD.shape)}")
        T = x_TD.shape[0]
        if token_ids_T is not None and tuple(token_ids_T.shape) != (T,):
            raise ValueError(
                f"token_ids_T must have shape (T,) = ({T},), got {tuple(token_ids_T.shape)}"
            )
        if seq_len is not None and (seq_len <= 0 or T % seq_len):
            raise ValueError(f"seq_len = {seq_len} must be positive and divide T = {T}")
        return Budget(k, lapsum_k, self.truncation, self.training, generator, token_ids_T, seq_len)

    def effective_truncation(
        self, lapsum_k: float | torch.Tensor | None = None
    ) -> float | torch.Tensor | None:
        """The cut on the map's values this router applies with the LapSum budget
        ``lapsum_k`` (None: the configured one), :meth:`Selection.cut`: ``truncation``,
        or with ``truncation_relative`` ``truncation * k / E``; None for a rule without
        a cut (top-K). A tensor ``k`` (a learned k_l) gives a detached 0-d tensor."""
        return self.selection.cut(self.truncation, lapsum_k)

    effective_threshold = effective_truncation  # the old name

    @torch.no_grad()
    def step(self, out: RouterOutput | None = None, activity: torch.Tensor | None = None) -> None:
        """Once per optimiser step: advance the temperature schedule and, with
        auxiliary-loss-free balancing, move the selection bias toward even load
        using the routing in ``out`` (under data parallelism: the load summed over
        the ranks, so every rank moves the bias alike); with quantile balancing
        (``bias_update="quantile"``), set it from the quantiles of ``out``'s scores
        (under data parallelism: averaged over the ranks). With ``l1_target``, move the
        L1 coefficient ``l1_coef`` by ``activity``, the (active, all) gates of every
        MoE layer and rank (:func:`moelab.routing.relu_l1.global_activity`, which
        :func:`step_routers` passes); without it, by ``out`` alone."""
        self.temperature.update(self.weight)
        if self.l1_coef is not None and (activity is not None or out is not None):
            if activity is None:
                assert out is not None
                activity = relu_l1.global_activity([self], [out])
            assert activity is not None
            cfg = self.balancing_config
            assert cfg.l1_target is not None
            new = relu_l1.coef_update(
                self.l1_coef, activity, cfg.l1_target, cfg.n_experts, cfg.l1_rate
            )
            self.l1_coef.copy_(new)
            self.l1_sparsity.copy_(relu_l1.sparsity(activity))
        cfg = self.balancing_config
        if cfg.bias_update == "quantile" and out is not None:
            self.bias.copy_(self._quantile_bias(out, cfg.bias_ema))
        if cfg.bias_rate > 0 and out is not None:
            local_E = balancing.expert_counts(out.ids_TK, out.chosen_TK, cfg.n_scored)
            load_E = balancing.global_load(local_E)
            if cfg.null_target is None:
                self.bias.copy_(balancing.bias_update(self.bias, load_E, cfg.bias_rate))
            else:  # LongCat-Flash: the null experts' bias steers the real experts per token
                new = balancing.null_target_update(
                    self.bias,
                    load_E,
                    cfg.n_experts,
                    out.ids_TK.shape[1],
                    cfg.null_target,
                    cfg.bias_rate,
                )
                self.bias.copy_(new)

    def _quantile_bias(self, out: RouterOutput, ema: float) -> torch.Tensor:
        """Quantile balancing's next bias from the routing in ``out``: the bias that gives
        each expert its share of the slots on this batch, from the scores the selection
        ranks by (``rank_by``; without noise), averaged over the data-parallel ranks
        (:func:`balancing.global_mean`, as Megatron-Core averages its ranks' quantiles),
        blended by ``ema`` and centred (:func:`balancing.quantile_update`)."""
        rank_TE = self.selection.ranking_scores(out.logits_TE, out.probs_TE)
        local_E = balancing.quantile_bias(rank_TE, self.bias, out.ids_TK.shape[1])
        return balancing.quantile_update(self.bias, balancing.global_mean(local_E), ema)

    def calibrate(self, calibrator: ThresholdCalibrator, k: float | torch.Tensor) -> float:
        """Set the cut on p (``truncation``) so that, on the batches the calibrator has
        observed (the map's values), about ``k`` experts per token pass it. With
        ``truncation_relative`` the cut found is stored in units of ``k / E``. Only for
        a rule whose ``calibrates`` is true (ValueError otherwise)."""
        self.truncation = self.selection.stored(calibrator.threshold(k), k)
        return self.truncation

    def get_extra_state(self) -> dict:
        # the inference budget and a calibrated cut travel with the weights
        return {"top_k": self.top_k, "truncation": self.truncation}

    def set_extra_state(self, state: dict) -> None:
        self.top_k = int(state["top_k"])
        # NOTE: checkpoints written before the rename hold the cut as "threshold"
        self.truncation = float(state.get("truncation", state.get("threshold")))

    def extra_repr(self) -> str:
        c = self.config
        alpha = f", alpha={c.alpha}" if c.alpha is not None else ""
        return (
            f"d_model={c.d_model}, n_experts={c.n_experts}, map={c.map}{alpha}, top_k={self.top_k}"
        )


def step_routers(routers: list[Router], outs: list[RouterOutput]) -> None:
    """``router.step(out, activity)`` for every router of a model, once per optimiser
    step. ``activity`` is what ReLU routing's adaptive L1 reads, the (active, all) gates
    of every router and data-parallel rank (:func:`relu_l1.global_activity`), so that
    the model's one lambda moves alike in every router; the other routers step as with
    ``router.step(out)``."""
    activity = relu_l1.global_activity(routers, outs)
    for router, out in zip(routers, outs, strict=True):
        router.step(out, activity)


@contextlib.contextmanager
def routers_top_k(routers: Sequence[Router], k: int) -> Iterator[None]:
    """Inside the block every one of ``routers`` takes ``k`` experts per token; each
    gets its own K back after, also when the block raises."""
    old = [r.top_k for r in routers]
    try:
        for r in routers:
            r.top_k = k
        yield
    finally:
        for r, k_old in zip(routers, old, strict=True):
            r.top_k = k_old
