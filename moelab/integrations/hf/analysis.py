"""A local Hugging Face MoE model as a source of ``moelab analyze``
(:class:`~moelab.diagnostics.analysis.RoutingSource`).

The routers are the ones :func:`~moelab.integrations.hf.families.moe_routers` finds (the
same hooks as ``moelab stats --hf``); what a router returns becomes a RouterOutput through
:func:`~moelab.integrations.hf.stats.router_output`. A folder saved from a swapped model
(``moelab_routers.json``: :func:`~moelab.integrations.hf.saved.save_swapped`, or a
torchtitan model through :func:`moelab.integrations.torchtitan.export.export_hf`) is
loaded with its moelab Routers (:func:`~moelab.integrations.hf.saved.load_swapped`), and
the analyses hook those Routers themselves, as in a moelab run: their RouterOutput, their
map, their weight and temperature. The text is ``--data`` (a file or a
folder of text files) cut into windows as for the statistics (``token_batches``), at most
``max_tokens`` tokens. The gate of the certified radius is the router's weight with
``tau = 1`` (its logits are ``x W^T``, plus GPT-OSS's bias). Checkpoints of a saturation
analysis are several model folders, in training order.

Shape suffixes: B, S (moelab.shapes).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moelab import maps
from moelab.diagnostics.analysis.source import RoutingSource
from moelab.integrations.hf.families import moe_routers
from moelab.integrations.hf.stats import (
    check_max_tokens,
    forward,
    load_hf,
    read_texts,
    router_output,
    seq_len_for,
    token_batches,
)
from moelab.integrations.hf.swap import swapped_routers

__all__ = ["HFSource", "folder_step"]


def folder_step(path: str | Path) -> int | None:
    """The training step a checkpoint folder's name gives (``step1000``, ``step_00000400``,
    ``checkpoint-500``: its last number), or None."""
    found = re.findall(r"\d+", Path(path).name)
    return int(found[-1]) if found else None


class HFSource(RoutingSource):
    """The MoE model in ``model_dir`` (loaded offline, float32 on CPU)."""

    def __init__(
        self,
        model_dir: str | Path,
        max_tokens: int | None = None,
        batch_size: int = 4,
        seq_len: int | None = None,
        *,
        trust_remote_code: bool = False,
        step: int | None = None,
    ) -> None:
        check_max_tokens(max_tokens)
        self.model, self.tokenizer = load_hf(
            model_dir, trust_remote_code=trust_remote_code, swapped=True
        )
        self.label, self.kind = str(model_dir), "hf"
        self.swapped = swapped_routers(self.model)
        if self.swapped:  # the moelab Routers, hooked as a run's
            self.sites = []
            self.routers = [s.router for s in self.swapped]
            rc = self.routers[0].config
            self.map, self.alpha = rc.map, rc.alpha
            self.threshold = maps.threshold(rc.map, rc.alpha)
            top_k = int(self.routers[0].top_k)
            self.top_k = top_k if rc.selection_rule.sweep == "top_k" else None
            self.n_experts = rc.n_experts
        else:
            self.sites = moe_routers(self.model)
            self.routers = [s.router for s in self.sites]
            site = self.sites[0]
            self.map, self.alpha, self.threshold = site.family.map, None, None
            self.top_k, self.n_experts = site.top_k, site.n_experts
        self.step = step
        self.tokens_per_step = None
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.seq_len = seq_len_for(self.model, seq_len)

    def batches(self, data: str | Path | None = None) -> Iterator[torch.Tensor]:
        if data is None:
            raise ValueError("--hf needs --data TEXT (a text file or a folder of them)")
        files = read_texts(data)
        yield from token_batches(
            self.tokenizer, files, self.seq_len, self.batch_size, self.max_tokens
        )

    def as_output(self, layer: int, returned: Any) -> Any:
        if self.swapped:  # a moelab Router's own RouterOutput
            return returned
        site = self.sites[layer]
        try:
            return router_output(site, *site.read(returned))
        except ValueError as err:
            raise ValueError(
                f"router {site.name}: {err}; this model's routing cannot be analysed"
            ) from None

    def gate(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        if self.swapped:
            r = self.routers[layer]
            return r.weight.detach().float(), r.temperature.tau.detach().float()
        return self.sites[layer].weight.detach().float(), 1.0

    def decode(self, token_id: int) -> str:
        return str(self.tokenizer.decode([int(token_id)]))

    @torch.no_grad()
    def forward(self, x_BS: torch.Tensor) -> None:
        forward(self.model, x_BS.to(next(self.model.parameters()).device))

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        doc["model_type"] = getattr(self.model.config, "model_type", None)
        doc["family"] = self.swapped[0].family if self.swapped else self.sites[0].family.name
        return doc
