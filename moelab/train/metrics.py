"""The metrics rows of training (the file they go to, ``RUN/metrics.jsonl``:
moelab.runs.metrics).

:class:`Metrics` decides when a step is logged (``should_log(step)``: every
``log_every`` steps and the last) and builds its row (loss, lr, tokens, throughput,
time, the routing numbers of :func:`routing_numbers`, dead experts of the window and
:func:`router_state`); :func:`write_row` is the one place a row is written.

Shape suffixes: T, E, K, L (moelab.shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moelab import maps
from moelab.model import Transformer
from moelab.routing.certification import gate_lipschitz
from moelab.routing.measures import expert_counts, load_cv, token_measures
from moelab.routing.output import RouterOutput
from moelab.runs.metrics import append_metrics

from . import distributed as D
from . import health as H
from . import parallel as P
from .config import TrainConfig
from .dead_experts import ExpertLoad
from .progress import RunClock, Throughput
from .threads import oversubscribed

__all__ = [
    "Metrics",
    "router_state",
    "routing_numbers",
    "write_row",
]


@torch.no_grad()
def routing_numbers(outs: list[RouterOutput], discarded: bool = True) -> dict[str, float]:
    """Headline routing numbers of one forward pass, averaged over the MoE layers
    (the per-token measures of moelab.routing.measures that moelab.diagnostics
    accumulates, here on one batch):
    ``discarded_mass`` (1 - map mass on the selected experts), ``contributors``
    (selected slots with weight > 0 per token), ``singleton_rate`` (tokens whose
    map support is one expert), ``load_cv`` (std / mean of the computed load per
    expert) and ``active_experts`` (computed slots per token); ``active_experts.i``
    is layer i's. Only log steps pay for it. ``discarded=False`` (a map without a fixed
    total, ``MapInfo.fixed_total``) leaves ``discarded_mass`` out."""
    if not outs:
        return {}
    fields: dict[str, list[torch.Tensor]] = {
        "discarded_mass": [],
        "contributors": [],
        "singleton_rate": [],
        "load_cv": [],
        "active_experts": [],
    }
    for o in outs:
        m = token_measures(o)
        n_experts = o.n_experts  # the real experts (null ones excluded)
        fields["discarded_mass"].append(m.discarded_T.mean())
        fields["contributors"].append(m.contrib_TK.sum(-1).float().mean())
        fields["singleton_rate"].append((m.support_T == 1).float().mean())
        load_E = expert_counts(o.ids_TK, m.computed_TK, n_experts)
        fields["load_cv"].append(load_cv(load_E).nan_to_num(0.0))  # no load: 0
        fields["active_experts"].append(m.computed_TK.sum(-1).float().mean())
    if not discarded:
        del fields["discarded_mass"]
    numbers = {name: float(torch.stack(values).mean()) for name, values in fields.items()}
    for i, value in enumerate(fields["active_experts"]):
        numbers[f"active_experts.{i}"] = float(value)
    return numbers


@torch.no_grad()
def router_state(model: Transformer) -> dict[str, float | list[float]]:
    """Per MoE layer, the state of the routers themselves (the same on every rank):
    ``tau_layers`` (temperature), ``lipschitz_layers`` (the gate's Lipschitz constant
    ``||W||_2 / (2 tau)``, exact spectral norm), ``weight_norm_layers`` (``||W||_2``),
    under loss-free or quantile balancing (``bias_rate`` > 0, ``bias_update="quantile"``)
    ``bias_abs_mean_layers`` and ``bias_abs_max_layers`` (mean and largest ``|b|`` of the
    selection bias) and, under learned allocation, ``k_layers`` (each layer's LapSum
    budget k_l). Under ReLU routing's adaptive L1 (``router.l1_target``) also the
    model's one ``l1_coef`` (lambda, after this step's update) and ``l1_sparsity`` (the
    zero-gate fraction over all MoE layers and ranks that moved it; its target is
    1 - l1_target / E)."""
    routers = [layer.router for layer in model.moe_layers]
    if not routers:
        return {}
    state: dict[str, float | list[float]] = {
        "tau_layers": [r.temperature.value for r in routers],
        "lipschitz_layers": [
            float(gate_lipschitz(r.weight.detach(), r.temperature.value)) for r in routers
        ],
    }
    state["weight_norm_layers"] = [
        float(torch.linalg.matrix_norm(r.weight.detach().double(), ord=2)) for r in routers
    ]
    # loss-free or quantile balancing: the selection bias b (0 in the layers without it,
    # such as the hash layers of a router_layers mix)
    if any(r.balancing_config.moves_bias for r in routers):
        state["bias_abs_mean_layers"] = [float(r.bias.detach().abs().mean()) for r in routers]
        state["bias_abs_max_layers"] = [float(r.bias.detach().abs().max()) for r in routers]
    k_L = model.layer_budgets()
    if k_L is not None:
        state["k_layers"] = k_L.detach().float().cpu().tolist()
    if routers[0].l1_coef is not None:  # one lambda, the same in every router
        state["l1_coef"] = float(routers[0].l1_coef)
        state["l1_sparsity"] = float(routers[0].l1_sparsity)
    return state


_HEADLINE = {
    "discarded_mass": "discarded",
    "contributors": "contributors",
    "singleton_rate": "singleton",
    "load_cv": "load_cv",
    "active_experts": "active",
}
"""The scalar routing numbers of a row (the mean over the MoE layers, as
:func:`routing_numbers` gives them) and the per-layer list each averages."""


def write_row(run: Path, row: dict[str, Any]) -> None:
    """Write one row of training's metrics (rank 0 calls it): the one place rows go out,
    today as a line of ``RUN/metrics.jsonl`` (:func:`append_metrics`)."""
    append_metrics(run, row)


class Metrics:
    """The metrics rows of steps ``start`` to ``end`` of a run: which steps are logged
    (:meth:`should_log`), the row of a logged step (:meth:`row`, collective under
    torchrun), its progress-bar postfix and the writing (rank 0, :func:`write_row`).
    ``loss``, ``rates`` and ``routing`` hold the last logged numbers; ``window`` counts
    the experts' tokens of the logging window (dead experts)."""

    def __init__(
        self,
        run: Path,
        config: TrainConfig,
        par: P.Parallel,
        start: int,
        end: int,
        clock: RunClock,
        threads: int,
    ) -> None:
        model = par.model
        assert isinstance(model, Transformer)
        self.run, self.config, self.par, self.end, self.clock = run, config, par, end, clock
        self.info, self.model, self.threads = par.info, model, threads
        self.tokens_per_step = config.batch_size * config.seq_len
        # a discarded mass only where the map's values have a fixed total (not sigmoid,
        # relu, sqrtsoftplus)
        rcs = [layer.router.config for layer in model.moe_layers]  # may differ per layer
        self.has_mass_share = any(maps.info(rc.map).fixed_total for rc in rcs)
        self.share = D.local_world_size()
        self.speed = Throughput(start, self.tokens_per_step)
        self.loss = float("nan")
        self.rates = {"tokens_per_s": 0.0, "tokens_per_s_avg": 0.0}
        self.routing: dict[str, float] = {}
        self.n_moe = len(model.moe_layers)
        self.window = ExpertLoad()  # dead experts: the logging window
        self.start = start  # the steps before it were trained by an earlier part
        self.since = start  # the window holds the steps after this one
        self.window_since = start  # the window of the last row: the steps after this one
        self.dead_LE: torch.Tensor | None = None  # the last row's dead experts, per layer
        self.capacity = any(rc.capacity_factor is not None for rc in rcs)
        self.balance_on = any(rc.aux_weight > 0 for rc in rcs)

    def should_log(self, step: int) -> bool:
        """Whether the step that ends at ``step`` steps is logged."""
        return step % self.config.log_every == 0 or step == self.end

    def row(self, done: int, lr: float, out: Any, grad_norm: float | None = None) -> dict[str, Any]:
        """The row of logged step ``done`` (``out``: its forward pass; ``grad_norm``: the
        gradients' global norm before clipping); collective under torchrun (every number
        is global over the ranks, see moelab.train.health)."""
        info, n_moe = self.info, self.n_moe
        local = {"loss": float(out.loss.detach())}
        if n_moe:
            local["aux_loss"] = float(out.aux_loss.detach())
            for i, o in enumerate(out.router_outputs):
                if "switch" in o.losses and self.balance_on:
                    local[f"balance_loss.{i}"] = float(o.losses["switch"].detach())
        reduced = D.all_reduce_mean(local, info)
        self.loss = reduced["loss"]
        self.rates = self.speed.rates(done)
        row: dict[str, Any] = {
            "step": done,
            "loss": self.loss,
            "lr": lr,
            "tokens": done * self.tokens_per_step,
            **self.rates,
            **self.clock.stamp(),
        }
        if grad_norm is not None:
            row["grad_norm"] = grad_norm
        if not n_moe:
            self.routing = {}
            return row
        row["aux_loss"] = reduced["aux_loss"]
        health = H.step_health(
            out.router_outputs,
            self.config.seq_len,
            info,
            discarded=self.has_mass_share,
            capacity=self.capacity,
            ep=self.par.ep,
        )
        # the headline numbers: the mean over the MoE layers
        self.routing = {
            name: sum(health[f"{key}_layers"]) / n_moe
            for name, key in _HEADLINE.items()
            if f"{key}_layers" in health
        }
        row.update(self.routing)
        for i, value in enumerate(health["active_layers"]):
            row[f"active_experts.{i}"] = value
        row["active_layers"] = health.pop("active_layers")
        row.update(health)
        if self.balance_on:
            # None: a layer without the Switch loss (router_layers may switch it off)
            row["balance_loss_layers"] = [reduced.get(f"balance_loss.{i}") for i in range(n_moe)]
        load_LE = self.window.take(info)
        self.window_since, self.since = self.since, done
        self.dead_LE = None
        if load_LE is not None:
            load_LE = load_LE.double().cpu()
            self.dead_LE = torch.stack(
                [H.dead_mask(load_E, self.config.dead_fraction) for load_E in load_LE]
            )
            row["dead_layers"] = [int(n) for n in self.dead_LE.sum(-1).tolist()]
            total_L = load_LE.sum(-1, keepdim=True)
            share_LE = torch.where(total_L > 0, load_LE / total_L.clamp_min(1.0), 0.0)
            row["load_share_layers"] = share_LE.tolist()
            # every step of the window, not only the logged one: computed slots per token
            window_steps = done - self.window_since
            if window_steps > 0:
                tokens = window_steps * self.tokens_per_step
                row["window_steps"] = window_steps
                row["active_window_layers"] = (total_L.squeeze(-1) / tokens).tolist()
        else:
            row["dead_layers"] = []
        row["dead_experts"] = sum(row["dead_layers"])
        with self.par.routers_gathered():
            row.update(router_state(self.model))
        row.update(H.summaries(row))
        return row

    def window_state(self) -> dict[str, Any]:
        """The logging window so far (collective under torchrun): ``{"since", "counts"}``,
        what a checkpoint keeps so that the first row after a resume covers the same
        steps as without the stop (:meth:`restore_window`)."""
        return {"since": self.since, "counts": self.window.state(self.info)}

    def restore_window(self, state: dict[str, Any] | None) -> None:
        """Continue the window a checkpoint kept (:meth:`window_state`); None (a
        checkpoint of a moelab before this one): a new window from the checkpoint's
        step."""
        if state:
            self.since = int(state["since"])
            self.window.restore(state.get("counts"), self.info)

    def write(self, row: dict[str, Any]) -> None:
        """Write ``row`` (rank 0 only)."""
        if self.info.is_main:
            write_row(self.run, row)

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """What the progress bar shows of ``row``."""
        postfix = {
            "loss": f"{self.loss:.3f}",
            "tok_s": f"{self.rates['tokens_per_s']:,.0f}",
        }
        if "active_experts" in self.routing:  # (a dense model routes nothing: no "nan")
            postfix["active"] = f"{self.routing['active_experts']:.2f}"
        if row.get("dead_experts"):
            postfix["dead"] = str(row["dead_experts"])
        if "val_loss" in row:
            postfix["val_loss"] = f"{row['val_loss']:.3f}"
        if self.info.device.type == "cpu" and self.config.progress:
            short = oversubscribed(self.threads, self.share, self.speed.seconds())
            if short is not None:
                postfix["threads"] = f"{self.threads}>{short} free cores"
        return postfix

    def next_window(self, done: int) -> None:
        """After step ``done``: a new throughput window starts at each multiple of
        ``log_every``."""
        if done % self.config.log_every == 0:
            self.speed.next_window(done)
