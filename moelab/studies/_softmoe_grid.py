"""The SoftMoE paper's constants that the ``softmoe`` study's arms, tables and findings
share (:mod:`moelab.studies.softmoe`)."""

from __future__ import annotations

SPARSE_KS = (1, 2, 4)
"""k of the sparse MoE baselines."""
JITTER_KS = (1, 2)
"""k of the sparse baselines trained again with router jitter."""
JITTER = 0.05
"""The jitter of the paper's Table 8 (moelab: Gaussian noise of this std on the router
logits in training, ``router.noise_std``)."""
SOFT_K = 2.0
"""k of the SoftMoE arms (LapSum's budget; under learned allocation K / L)."""
ALPHA = 2.0
"""alpha, the per-token cap ceil(k alpha) of the SoftMoE arms."""
FIXED_TAUS = (1.1, 1.3)
"""Train-time thresholds tau (in units of k / E) of the Table 6 arms: values of the
paper's grid."""
INFER_SCALES = (2.0, 1.5, 1.0, 0.5)
"""Inference-time factors on the trained threshold (Table 7: tau 2.4, 1.8, 1.2, 0.6 for
a model trained with 1.2)."""
