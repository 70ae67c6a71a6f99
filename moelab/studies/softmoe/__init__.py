"""The ``softmoe`` study: *SoftMoE: Soft Differentiable Routing for Mixture-of-Experts in
LLMs* (LapSum soft top-k routing with truncation, a per-token cap and a learned per-layer
allocation of the expert budget).

Arms, in the paper's Table 1 order (budget groups "= 1", "<= 2", "<= 3", "<= 4"):

- sparse MoE (softmax, top-k, no renormalisation) with k = 1, 2, 4 (and 3 at the paper
  scale), router jitter off;
- SoftMoE* and SoftMoE k = 1.5, alpha = 2 (group <= 2, against ``sparse-k2``);
- SoftMoE* k = 2, alpha = 2 (``softmoe-star``) and SoftMoE k = 2, alpha = 2
  (``softmoe``; learned k_l under K = 2 L, ``model.k_total``), group <= 4 against
  ``sparse-k4``; at the paper scale also SoftMoE* k = 1, alpha = 4;
- SoftMoE* and SoftMoE k = 2, alpha = 4 (moelab's, in the <= 4 group);
- SoftMoE* k = 2, alpha = 2 with a fixed train-time threshold tau (no calibration) for
  two values of the paper's Table 6 grid;
- the sparse k = 1, 2 baselines with jitter (the paper's Table 8).

Every SoftMoE* / SoftMoE arm: LapSum soft top-k, the cut on p calibrated on the first
batches so that about k experts pass (``calibrate_batches``), at most ceil(k alpha)
experts per token (``router.token_cap_factor``); the learned arms' allocator at
``model.k_lr_scale`` x lr at the short scales (:func:`.grid.k_lr_scale`).

Measured (Tables 1, 5, 6, 7, 8 of the paper, in their layouts, without the downstream
columns): AE (the mean number of experts a token activates per MoE layer) during training
(Train-AE: its mean over every training step, :func:`.run.train_ae`) and at inference
(Infer-AE: ``moelab.diagnostics.stats`` on validation batches), the mean active
parameters at inference, the validation loss, the relative load variance (Var / mean^2 of
the tokens per expert, mean over layers), the train-time threshold ablation, the
inference-time truncation sweep (``evaluate_truncation``), jitter on and off; the paired
differences within each budget group; the paper's numbers beside moelab's
(:mod:`.paper`, :mod:`.beside`); and the figure of every layer's k_l over training.

The report opens with the paper's claims as findings (``CLAIM_KEYS``): each soft arm
against the sparse arm of its budget group (loss, Train-AE, Infer-AE), learned
allocation against SoftMoE*, "later layers get more" (the later half's mean k_l minus
the earlier half's), load balance, the train-time threshold, jitter and the
inference-time cut; then checks that the k_l separated and stayed off their bounds,
that each soft arm's Infer-AE falls in its budget group, and that the fixed thresholds
route every token.

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
    GROUPS,
    INFER_SCALES,
    JITTER,
    JITTER_KEY,
    JITTER_KS,
    K_LR_SCALE,
    PAPER_SPARSE_KS,
    SOFT_CONFIGS,
    SOFT_K,
    SPARSE_KS,
    SoftConfig,
)
from moelab.studies.softmoe.run import (
    MAX_BATCHES,
    k_layer_series,
    load_relative_variance,
    train_ae,
    train_ae_logged,
)

__all__ = [
    "ALPHA",
    "CLAIM_KEYS",
    "FIXED_TAUS",
    "GROUPS",
    "INFER_SCALES",
    "JITTER",
    "JITTER_KEY",
    "JITTER_KS",
    "K_LR_SCALE",
    "MAX_BATCHES",
    "PAPER_SPARSE_KS",
    "REFERENCE",
    "SOFT_CONFIGS",
    "SOFT_K",
    "SPARSE_KS",
    "SoftConfig",
    "SoftMoEStudy",
    "k_layer_series",
    "load_relative_variance",
    "train_ae",
    "train_ae_logged",
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
