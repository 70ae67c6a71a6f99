"""Where the analyses read routing from: a moelab run or a Hugging Face MoE model.

A :class:`RoutingSource` gives the analyses the same four things whatever the model:

- ``batches(data)``: token batches ``x_BS`` of a fixed text, in order;
- ``routers``: the router module of every MoE layer, in model order, which the
  analyses hook (:func:`capture`): a forward hook sees the router's input ``x_TD`` and
  what it returned, which ``as_output(layer, returned)`` turns into a
  :class:`~moelab.routing.RouterOutput`;
- ``gate(layer)``: the router's weight ``W`` (E, D) and temperature ``tau``, with which
  its logits are ``(x W^T + b) / tau`` (the certified radius needs them);
- ``forward(x_BS)``: one forward pass without gradients.

:class:`RunSource` reads a moelab run (one checkpoint); the Hugging Face source lives
in :mod:`moelab.integrations.hf.analysis`. Every analysis streams: it keeps counts, never
the tokens' routing, so memory does not grow with the text.

*Used experts*: the analyses count a token's *used* experts, the selected slots with a
non-zero gate weight (``selected_TK & weights_TK != 0``; a filler is no use, a slot
dropped by a capacity limit still is). :func:`used_mask` gives them as an (T, E) mask.
*Top-1 expert*: the used expert with the largest gate weight, -1 for a token without
one (:func:`top1`).

Shape suffixes: B, S, T, D, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelab.routing.output import RouterOutput

__all__ = [
    "Capture",
    "RoutingSource",
    "RunSource",
    "capture",
    "top1",
    "used_mask",
]


def used_mask(out: RouterOutput) -> torch.Tensor:
    """(T, E) bool: the token's used experts (selected, non-zero weight), real experts
    only."""
    ids, used = out.ids_TK, out.selected_TK & (out.weights_TK != 0)
    T, E = ids.shape[0], out.n_experts
    mask = torch.zeros(T, E + 1, dtype=torch.bool, device=ids.device)
    # NOTE: unused slots go to the spare column E, which is dropped
    mask.scatter_(1, torch.where(used, ids.clamp(max=E), E), True)
    return mask[:, :E]


def top1(out: RouterOutput) -> torch.Tensor:
    """(T,) int64: the used expert of largest gate weight (the first such slot on a
    tie), -1 for a token without a used expert."""
    used = out.selected_TK & (out.weights_TK != 0)
    w = torch.where(used, out.weights_TK.float(), torch.tensor(-torch.inf))
    slot = w.argmax(dim=-1, keepdim=True)
    ids = out.ids_TK.gather(1, slot).squeeze(1)
    return torch.where(used.any(dim=-1), ids, torch.full_like(ids, -1))


@dataclass
class Capture:
    """What the router hooks saw in one forward: per MoE layer, the router's input
    ``x_TD`` (float32, when asked) and its output."""

    inputs: list[torch.Tensor | None]
    outputs: list[RouterOutput | None]

    def check(self) -> list[RouterOutput]:
        """The outputs; ValueError naming the layers whose router did not run."""
        missing = [i for i, o in enumerate(self.outputs) if o is None]
        if missing:
            raise ValueError(
                f"the router of MoE layer {', '.join(map(str, missing))} did not run in the "
                "forward pass; its routing cannot be analysed"
            )
        return self.outputs  # type: ignore[return-value]


class RoutingSource:
    """What an analysis reads (see the module docstring). Subclasses set the fields
    and implement :meth:`batches`, :meth:`as_output` and :meth:`gate`."""

    label: str
    """The run folder or model folder, as given."""
    kind: str
    """``"run"`` or ``"hf"``."""
    map: str
    """The map of the routers' probabilities (``softmax``, ``sparsemax``, ...)."""
    alpha: float | None
    top_k: int | None
    n_experts: int
    step: int | None
    """The checkpoint step (None when unknown, e.g. a Hugging Face folder)."""
    model: nn.Module
    routers: list[nn.Module]
    threshold: float | None = None
    """The map's singleton threshold on the top-2 logit gap (None: no such threshold)."""
    tokens_per_step: int | None = None

    @property
    def n_layers(self) -> int:
        return len(self.routers)

    def batches(self, data: str | Path | None = None) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def as_output(self, layer: int, returned: Any) -> RouterOutput:
        raise NotImplementedError

    def gate(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        raise NotImplementedError

    def decode(self, token_id: int) -> str:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The fields every analysis's JSON starts with."""
        return {
            "source": self.label,
            "kind": self.kind,
            "map": self.map,
            "alpha": self.alpha,
            "top_k": self.top_k,
            "n_experts": self.n_experts,
            "n_layers": self.n_layers,
            "checkpoint_step": self.step,
        }

    @torch.no_grad()
    def forward(self, x_BS: torch.Tensor) -> None:
        self.model(x_BS)


@contextlib.contextmanager
def capture(
    source: RoutingSource,
    inputs: bool = False,
    also: Callable[[int, nn.Module, tuple, dict, torch.Tensor, RouterOutput], None] | None = None,
) -> Iterator[Callable[[], Capture]]:
    """Hook every router of ``source``; the block gets a function that returns (and
    clears) what the hooks saw since its last call. ``inputs``: keep the routers'
    inputs too. ``also(layer, module, args, kwargs, x_TD, out)`` runs in each hook (the
    fragility analysis calls the router a second time there; the hooks do not record
    that call)."""
    state: dict[str, Any] = {"busy": False}
    n = source.n_layers
    seen = Capture([None] * n, [None] * n)

    def hook_for(layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, returned: Any) -> None:
            if state["busy"]:
                return
            out = source.as_output(layer, returned)
            x = args[0] if args else next(iter(kwargs.values()))
            x_TD = x.detach().reshape(-1, x.shape[-1]).float()
            if seen.outputs[layer] is not None:
                raise ValueError(
                    f"the router of MoE layer {layer} ran twice in one forward pass; "
                    "the analyses read one call per layer and batch"
                )
            seen.outputs[layer] = out
            if inputs:
                seen.inputs[layer] = x_TD
            if also is not None:
                state["busy"] = True
                try:
                    also(layer, module, args, kwargs, x_TD, out)
                finally:
                    state["busy"] = False

        return hook

    handles = [
        r.register_forward_hook(hook_for(i), with_kwargs=True) for i, r in enumerate(source.routers)
    ]

    def take() -> Capture:
        got = Capture(list(seen.inputs), list(seen.outputs))
        seen.inputs[:] = [None] * n
        seen.outputs[:] = [None] * n
        return got

    try:
        yield take
    finally:
        for h in handles:
            h.remove()


def route(source: RoutingSource, x_BS: torch.Tensor) -> list[RouterOutput]:
    """The routing of every MoE layer for one batch (one forward pass)."""
    with capture(source) as take:
        source.forward(x_BS)
        return take().check()


@dataclass
class RunSource(RoutingSource):
    """A moelab run's checkpoint as a routing source (``moelab.diagnostics.load_run``).

    Text: the run's validation split (``data`` None) or a corpus tokenised with the
    run's tokenizer, in file order, the first ``max_batches`` batches (None: all),
    batches of the run's own shape."""

    loaded: Any = None
    max_batches: int | None = 16
    batch_size: int | None = None
    kind: str = "run"
    _shards: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from moelab import maps

        loaded = self.loaded
        model = loaded.model
        if not model.moe_layers:
            raise ValueError(f"{loaded.run_dir} is a dense model (no MoE layers) to analyse")
        rc = model.config.router_config()
        layer_maps = {(m.router.config.map, m.router.config.alpha) for m in model.moe_layers}
        if len(layer_maps) > 1:  # router_layers: the analyses read one map's threshold
            raise ValueError(
                f"{loaded.run_dir}: router_layers gives the MoE layers different maps "
                f"({', '.join(sorted(str(m) for m, _ in layer_maps))}); the analyses read "
                "one map: analyse runs whose layers share their map"
            )
        self.label = str(loaded.run_dir)
        self.map, self.alpha = rc.map, rc.alpha
        self.model = model
        self.routers = [m.router for m in model.moe_layers]
        sweeps_k = all(r.config.selection_rule.sweep == "top_k" for r in self.routers)
        self.top_k = int(self.routers[0].top_k) if sweeps_k else None
        self.n_experts = rc.n_experts
        self.step = loaded.step
        self.threshold = maps.threshold(rc.map, rc.alpha)
        self.tokens_per_step = loaded.config.batch_size * loaded.config.seq_len

    def batches(self, data: str | Path | None = None) -> Iterator[torch.Tensor]:
        from moelab.diagnostics.evaluate import shard_batches
        from moelab.diagnostics.load import corpus_shard

        key = "" if data is None else str(data)
        if key not in self._shards:
            self._shards[key] = (
                self.loaded.val_shard()
                if data is None
                else corpus_shard(data, self.loaded.tokenizer)
            )
        n = 0
        for x_BS, _ in shard_batches(self._shards[key], self.loaded, self.batch_size, None):
            if self.max_batches is not None and n >= self.max_batches:
                return
            n += 1
            yield x_BS

    def as_output(self, layer: int, returned: Any) -> RouterOutput:
        return returned

    def gate(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        r = self.routers[layer]
        return r.weight.detach().float(), r.temperature.tau.detach().float()

    def decode(self, token_id: int) -> str:
        return self.loaded.tokenizer.decode([int(token_id)])


def run_sources(
    run: str | Path, steps: Sequence[int | None] = (None,), **kwargs: Any
) -> Iterator[RunSource]:
    """A RunSource for each checkpoint step of ``run`` (None: the newest), loaded one
    at a time."""
    from moelab.diagnostics.load import load_run

    for step in steps:
        yield RunSource(loaded=load_run(run, step), **kwargs)
