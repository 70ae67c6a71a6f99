"""The cut on p of truncating moelab routers in a torchtitan model, set from the first
batches before training, as moelab's own training does
(:func:`moelab.train.calibrate_thresholds`): layer after layer, about k experts per token
pass the cut, k the layer's learned k_l (``swap_routers(..., k_total=...)``) or the
experts its rule expects (``lapsum_k``, else ``top_k``).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from moelab.integrations.torchtitan.router import MoelabRouter, moelab_routers
from moelab.routing.allocation import ThresholdCalibrator

__all__ = ["calibrate_routers", "layer_target"]


def layer_target(router: MoelabRouter) -> float:
    """The experts per token ``router``'s cut aims at: its k_l, else its rule's."""
    k = router.lapsum_k()
    if k is not None:
        return float(k.detach())
    return router.router.config.expected_experts


@torch.no_grad()
def calibrate_routers(
    model: nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any]
) -> list[float]:
    """Set the cut (``truncation``) of every moelab router of ``model`` whose rule
    calibrates (``selection="threshold"``), layer after layer, on ``forward(batch)`` of
    each of ``batches`` (a forward of the model, e.g. ``lambda t: model(t,
    attention_masks=...)``), in eval mode. Returns every moelab router's cut.

    Raises:
        ValueError: the model has no moelab router.
    """
    routers = [r for _, r in moelab_routers(model)]
    if not routers:
        raise ValueError("the model has no moelab router: call swap_routers(model, ...) first")
    batches = list(batches)
    was_training = model.training
    model.eval()
    try:
        for router in routers:
            if not router.router.selection.calibrates:
                continue
            calibrator = ThresholdCalibrator()
            for batch in batches:
                forward(batch)
                assert router.last is not None
                calibrator.observe(router.last.probs_TE)
            router.router.calibrate(calibrator, layer_target(router))
    finally:
        model.train(was_training)
    return [r.router.truncation for r in routers]
