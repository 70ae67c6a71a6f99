"""The ``softmoe`` study: *SoftMoE: Soft Differentiable Routing for Mixture-of-Experts in
LLMs* (LapSum soft top-k routing with truncation, a per-token cap and a learned per-layer
allocation of the expert budget).

Arms (every scale):

- sparse MoE (softmax, top-k, no renormalisation) with k = 1, 2, 4, router jitter off;
- the same with jitter on for k = 1, 2 (the paper's Table 8);
- SoftMoE* k = 2, alpha = 2: LapSum soft top-k with k = 2, the cut on p calibrated on the
  first batches so that about k experts pass (``calibrate_batches``), at most
  ceil(k alpha) experts per token (``router.token_cap_factor``);
- SoftMoE k = 2, alpha = 2: the same with learned k_l under the global budget K = 2 L
  (``model.k_total``);
- SoftMoE* with a fixed train-time threshold tau (no calibration) for two values of the
  paper's Table 6 grid.

Measured (Tables 1, 5, 6, 7, 8 of the paper, in their layouts, without the downstream
columns): AE (the mean number of experts a token activates per MoE layer) during training
(Train-AE: the mean over training of the logged ``active_experts``) and at inference
(Infer-AE: ``moelab.diagnostics.stats`` on validation batches), the mean active
parameters at inference, the validation loss, the relative load variance (Var / mean^2 of
the tokens per expert, mean over layers), the train-time threshold ablation, the
inference-time truncation sweep (``evaluate_truncation``), jitter on and off; and the
figure of every layer's k_l over training (``moelab.report.plots.plot_allocation``).

The report opens with the paper's claims as findings (``CLAIM_KEYS``; reference arm
``sparse-k2``): the last MoE layer's final k_l minus the first's, paired differences of
loss, Train-AE, Infer-AE and load variance between arms, the train-time threshold's and
jitter's effects, and the inference-time cut at 2 x against 1 x; then checks that the
k_l separated, that the calibrated arms compute about their budget k, and that the
fixed thresholds route every token.

The parts, as every study has them: ``grid`` (the arms, their settings at each scale and
the paper's constants), ``run`` (what is measured on each trained run), ``findings`` (the
paper's claims and the checks), ``figures`` and ``analysis`` (the report's sections).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import Arm, Context, Section, Study
from moelab.studies.softmoe import analysis, grid
from moelab.studies.softmoe.findings import CLAIM_KEYS, REFERENCE
from moelab.studies.softmoe.grid import (
    ALPHA,
    FIXED_TAUS,
    INFER_SCALES,
    JITTER,
    JITTER_KS,
    SOFT_K,
    SPARSE_KS,
)
from moelab.studies.softmoe.run import (
    MAX_BATCHES,
    k_layer_series,
    load_relative_variance,
    train_ae,
)

__all__ = [
    "ALPHA",
    "CLAIM_KEYS",
    "FIXED_TAUS",
    "INFER_SCALES",
    "JITTER",
    "JITTER_KS",
    "MAX_BATCHES",
    "REFERENCE",
    "SOFT_K",
    "SPARSE_KS",
    "SoftMoEStudy",
    "k_layer_series",
    "load_relative_variance",
    "train_ae",
]


class SoftMoEStudy(Study):
    """SoftMoE vs sparse MoE: AE, active parameters, loss, load variance, the truncation
    ablations, jitter, and the learned allocation over training."""

    name = "softmoe"
    title = "SoftMoE: LapSum soft top-k routing, truncation and learned allocation"
    paper = "SoftMoE: Soft Differentiable Routing for Mixture-of-Experts in LLMs"
    reference = REFERENCE
    claims = CLAIM_KEYS

    def common(self, scale: str) -> dict[str, Any]:
        return grid.common(scale)

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        return grid.arms(scale, options)

    def k_lr_scale(self, scale: str) -> float:
        """The learned arm's ``model.k_lr_scale`` (:func:`.grid.k_lr_scale`)."""
        return grid.k_lr_scale(scale)

    def paper_sources(self) -> dict[str, str]:
        return grid.paper_sources()

    def analyse(self, ctx: Context) -> list[Section]:
        return analysis.analyse(ctx)
