"""The router: a pipeline of small stages, wired together.

    x_TD --scorer--> scores_TE --temperature--> logits_TE --map--> probs_TE
         --select--> ids_TK, selected_TK --gate--> weights_TK --capacity--> dropped_TK

Shape legend: T tokens, D model width, E experts, K selection slots per token.

Every stage is independent of the others' variants: any map works with any
selection, gate and balancing method. Construction (RouterConfig) rejects the
pairings that cannot train.
"""

from __future__ import annotations

import torch
from torch import nn

from moelab import maps
from moelab.routing import balancing
from moelab.routing.allocation import ThresholdCalibrator, cap, to_float
from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput
from moelab.routing.temperature import Temperature


def apply_map(
    config: RouterConfig, logits_TE: torch.Tensor, lapsum_k: float | torch.Tensor | None = None
) -> torch.Tensor:
    """The configured probability map on all E logits."""
    if config.map in ("entmax", "normmax"):
        return maps.get(config.map)(logits_TE, alpha=config.alpha)
    if config.map == "lapsum":
        k = config.lapsum_k if lapsum_k is None else lapsum_k
        return maps.lapsum(logits_TE, k)
    return maps.get(config.map)(logits_TE)


def select_topk(
    rank_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    top_k: int,
    sample_extra: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """ids_TK of the top_k experts by ``rank_TE``; with ``sample_extra`` = c > 0,
    top_k experts sampled without replacement from the top top_k + c in
    proportion to their probability (exploration, as the gate essay suggests)."""
    if sample_extra == 0:
        return rank_TE.topk(top_k, dim=-1).indices
    cand_TC = rank_TE.topk(top_k + sample_extra, dim=-1).indices
    p_TC = probs_TE.detach().gather(-1, cand_TC).float()
    # NOTE: sparse maps give zeros; a tiny floor lets multinomial draw them last
    # instead of failing when fewer than top_k candidates have positive mass.
    pick_TK = torch.multinomial(p_TC + 1e-12, top_k, replacement=False, generator=generator)
    return cand_TC.gather(-1, pick_TK)


def gate_weights(
    probs_TK: torch.Tensor, selected_TK: torch.Tensor, renorm: bool, straight_through: bool
) -> torch.Tensor:
    """Gate weights of the selected slots from the map's values at them.

    map values (default): w = p.  renorm: w = p / sum_selected p.
    straight-through: w = 1 forward, d w = d log p backward (w = 1 + log p - sg(log p)).
    A selected slot with p = 0 keeps weight 0 (a filler) in every mode.
    """
    p = torch.where(selected_TK, probs_TK, 0)
    if renorm:
        total = p.sum(-1, keepdim=True)
        return torch.where(total > 0, p / total.clamp_min(torch.finfo(p.dtype).tiny), 0)
    if straight_through:
        positive = p > 0
        log_p = torch.log(torch.where(positive, p, 1))
        return torch.where(positive, 1 + log_p - log_p.detach(), 0)
    return p


class Router(nn.Module):
    """Scores tokens against E experts and decides where each token goes.

    ``top_k`` (and ``threshold``) are plain attributes: change them at
    inference to route with another budget without touching the weights, or
    pass ``top_k=`` to a call.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.d_model))
        nn.init.normal_(self.weight, std=config.init_std)
        self.temperature = Temperature(config)
        # auxiliary-loss-free balancing: shifts selection only, never the gate
        self.register_buffer("bias", torch.zeros(config.n_experts))
        self.top_k = config.top_k
        self.threshold = config.threshold

    def forward(
        self,
        x_TD: torch.Tensor,
        top_k: int | None = None,
        lapsum_k: float | torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> RouterOutput:
        cfg = self.config
        k = self.top_k if top_k is None else int(top_k)
        if not 1 <= k <= cfg.n_experts:
            raise ValueError(f"top_k must lie in [1, {cfg.n_experts}], got {k}")
        if self.training and cfg.renorm and cfg.selection == "topk" and k == 1:
            raise ValueError("renorm with top_k=1 gives the router no gradient; train with K>=2")
        if x_TD.dim() != 2 or x_TD.shape[-1] != cfg.d_model:
            raise ValueError(
                f"expected tokens of shape (T, {cfg.d_model}), got {tuple(x_TD.shape)}"
            )

        # NOTE: the router runs in float32 even under bf16 autocast: small score
        # differences decide the selection and the sparse maps' supports.
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            scores_TE = x_TD.float() @ self.weight.float().t()
            tau = self.temperature.value
            logits_TE = scores_TE / tau
            probs_TE = apply_map(cfg, logits_TE, lapsum_k)

            rank_TE = logits_TE.detach() + self.bias
            if self.training and cfg.noise_std > 0:
                noise = torch.randn(rank_TE.shape, generator=generator, device=rank_TE.device)
                rank_TE = rank_TE + cfg.noise_std * noise
            if cfg.selection == "topk":
                extra = cfg.sample_extra if self.training else 0
                ids_TK = select_topk(rank_TE, probs_TE, k, extra, generator)
                selected_TK = torch.ones_like(ids_TK, dtype=torch.bool)
            else:
                slots = cfg.slots
                if lapsum_k is not None and cfg.cap_factor is not None:
                    # a learned per-layer k moves the cap ceil(k * cap_factor) with it
                    slots = min(cfg.n_experts, cap(lapsum_k, cfg.cap_factor))
                ids_TK = rank_TE.topk(slots, dim=-1).indices
                cut = self.effective_threshold(lapsum_k)
                selected_TK = probs_TE.detach().gather(-1, ids_TK) > cut
            probs_TK = probs_TE.gather(-1, ids_TK)
            weights_TK = gate_weights(probs_TK, selected_TK, cfg.renorm, cfg.straight_through)

            # NOTE: fillers (weight exactly 0) are never computed, so they take no
            # capacity; the Switch rule runs over the slots that would be computed.
            dropped_TK = balancing.capacity_drop(
                ids_TK, selected_TK & (weights_TK.detach() != 0), cfg.n_experts, cfg.capacity_factor
            )
            losses: dict[str, torch.Tensor] = {}
            aux = scores_TE.new_zeros(())
            if cfg.aux_weight > 0:
                source = probs_TE if cfg.aux_probs == "map" else torch.softmax(logits_TE, -1)
                losses["switch"] = balancing.switch_loss(source, ids_TK, selected_TK, cfg.n_experts)
                aux = aux + cfg.aux_weight * losses["switch"]
            if cfg.z_loss_weight > 0:
                losses["z"] = balancing.z_loss(logits_TE)
                aux = aux + cfg.z_loss_weight * losses["z"]
        return RouterOutput(
            scores_TE=scores_TE,
            logits_TE=logits_TE,
            probs_TE=probs_TE,
            ids_TK=ids_TK,
            weights_TK=weights_TK,
            selected_TK=selected_TK,
            dropped_TK=dropped_TK,
            aux_loss=aux,
            losses=losses,
            temperature=tau,
        )

    def effective_threshold(
        self, lapsum_k: float | torch.Tensor | None = None
    ) -> float | torch.Tensor:
        """The cut on the map's values of a truncating router: ``threshold``, or with
        ``threshold_relative`` ``threshold * k / E`` for the LapSum budget ``k`` of this
        call (``lapsum_k``, else the configured one). A tensor ``k`` (a learned k_l)
        gives a detached 0-d tensor, so the forward pass needs no host sync for it."""
        if not self.config.threshold_relative:
            return self.threshold
        k = self.config.lapsum_k if lapsum_k is None else lapsum_k
        assert k is not None  # RouterConfig: threshold_relative needs lapsum (and its k)
        if isinstance(k, torch.Tensor):
            return self.threshold * k.detach() / self.config.n_experts
        return self.threshold * float(k) / self.config.n_experts

    @torch.no_grad()
    def step(self, out: RouterOutput | None = None) -> None:
        """Once per optimiser step: advance the temperature schedule and, with
        auxiliary-loss-free balancing, move the selection bias toward even load
        using the routing in ``out`` (under data parallelism: the load summed over
        the ranks, so every rank moves the bias alike)."""
        self.temperature.update(self.weight)
        if self.config.bias_rate > 0 and out is not None:
            local_E = balancing.expert_counts(out.ids_TK, out.selected_TK, self.config.n_experts)
            load_E = balancing.global_load(local_E)
            self.bias.copy_(balancing.bias_update(self.bias, load_E, self.config.bias_rate))

    def calibrate(self, calibrator: ThresholdCalibrator, k: float | torch.Tensor) -> float:
        """Set the truncation threshold so that, on the batches the calibrator has
        observed (the map's values), about ``k`` experts per token pass it. With
        ``threshold_relative`` the cut found is stored in units of ``k / E``."""
        cut = calibrator.threshold(k)
        if self.config.threshold_relative:
            cut = cut * self.config.n_experts / to_float(k)
        self.threshold = cut
        return self.threshold

    def get_extra_state(self) -> dict:
        # the inference budget and a calibrated threshold travel with the weights
        return {"top_k": self.top_k, "threshold": self.threshold}

    def set_extra_state(self, state: dict) -> None:
        self.top_k = int(state["top_k"])
        self.threshold = float(state["threshold"])

    def extra_repr(self) -> str:
        c = self.config
        alpha = f", alpha={c.alpha}" if c.alpha is not None else ""
        return (
            f"d_model={c.d_model}, n_experts={c.n_experts}, map={c.map}{alpha}, top_k={self.top_k}"
        )
