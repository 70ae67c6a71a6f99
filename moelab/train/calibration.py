"""Router calibration, before the first step of a new run (a resumed run reads the
routers' state back from its checkpoint): the token counts of rules that balance on the
training data (:func:`fit_token_counts`) and the cuts on p of rules that calibrate
(:func:`calibrate_before_training`, :func:`calibrate_thresholds`).

Shape suffixes: B, S, T, V, E, L (moelab.shapes).
"""

from __future__ import annotations

import numpy as np
import torch

from moelab.data import TokenShard, batches
from moelab.model import Transformer
from moelab.routing.allocation import ThresholdCalibrator

from . import distributed as D
from .config import TrainConfig


def _layer_target(model: Transformer, i: int) -> float:
    """How many experts per token layer i's cut on p aims at: its learned k_l, else the
    experts its rule expects a token to reach (lapsum_k, else top_k)."""
    k_L = model.layer_budgets()
    if k_L is not None:
        return float(k_L[i].detach())
    return model.moe_layers[i].router.config.expected_experts


@torch.no_grad()
def calibrate_thresholds(
    model: Transformer, xy_batches: list[tuple[torch.Tensor, torch.Tensor]], autocast: bool = False
) -> list[float]:
    """Set the cut on p (``truncation``) of every router whose selection rule
    ``calibrates`` (selection = "threshold") so that, on ``xy_batches``, about k experts
    per token pass it (:meth:`Router.calibrate`).

    Layer after layer: layer i is calibrated on the map values it sees once the layers
    before it truncate with their new thresholds (its input does not depend on the
    layers after it). Returns the cuts (one per MoE layer; unchanged for rules that do
    not calibrate, such as top-k). Runs in eval mode, so exploration noise is off."""
    layers = model.moe_layers
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for i, layer in enumerate(layers):
            if not layer.router.selection.calibrates:
                continue
            calibrator = ThresholdCalibrator()
            for x_BS, _ in xy_batches:
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    out = model(x_BS.to(device))
                calibrator.observe(out.router_outputs[i].probs_TE)
            layer.router.calibrate(calibrator, _layer_target(model, i))
    finally:
        model.train(was_training)
    return [layer.router.truncation for layer in layers]


def fit_token_counts(model: Transformer, train_shard: TokenShard) -> None:
    """Before the first step: the routers whose rule builds state from the training
    data's token frequencies (``needs_token_counts``: hash routing's balanced table)
    get the training shard's count of each token id (every rank alike, no communication;
    a resumed run reads the state back from the checkpoint)."""
    rules = [
        layer.router.selection
        for layer in model.moe_layers
        if layer.router.selection.needs_token_counts
    ]
    if not rules:
        return
    counts_V = np.zeros(train_shard.vocab_size, dtype=np.int64)
    for start in range(0, len(train_shard), 1 << 24):  # NOTE: chunks bound the int64 copy
        chunk = train_shard.tokens[start : start + (1 << 24)]
        counts_V += np.bincount(chunk, minlength=train_shard.vocab_size)
    for rule in rules:
        rule.balance(torch.from_numpy(counts_V))


def calibrate_before_training(
    model: Transformer,
    config: TrainConfig,
    train_shard: TokenShard,
    per_rank: int,
    info: D.DistInfo,
) -> list[float] | None:
    """Before the first step: the cuts of routers whose rule calibrates (calibrate_batches);
    returns every MoE layer's cut (:func:`calibrate_thresholds`), None when nothing
    calibrates."""
    if not config.calibrate_batches or not any(
        layer.router.selection.calibrates for layer in model.moe_layers
    ):
        return None
    # NOTE: every rank calibrates on the same tokens, the first global batches of a
    # single process, in chunks of the per-rank size: the thresholds agree across
    # ranks without communication and match a single-process run. A resumed run
    # reads them back from the checkpoint (the routers' extra state).
    first = batches(train_shard, config.batch_size, config.seq_len, config.seed, 0, 1)
    calib = [
        (xr_BS, yr_BS)
        for x_BS, y_BS in (next(first) for _ in range(config.calibrate_batches))
        for xr_BS, yr_BS in zip(x_BS.split(per_rank), y_BS.split(per_rank), strict=True)
    ]
    return calibrate_thresholds(model, calib, info.device.type == "cuda")
