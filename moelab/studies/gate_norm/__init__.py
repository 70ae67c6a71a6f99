"""The gate-normalisation study (``moelab study gate-norm``): eight ways of turning router
scores into gate weights, trained side by side with the same model, data and seeds.

The essay (Su, 2026; ``router-gate-normalisation.txt`` among the papers) asks whether
the gate that multiplies the experts should be normalised, and whether top-k should come
after the normalisation or be followed by a re-normalisation. It derives, from a
REINFORCE view of top-1 routing, that the gate should be a normalised distribution p and
an expert's output should be weighted by p_i itself (no re-normalisation), and it lists
the alternatives this study trains:

``softmax-topk``
    p = softmax(s), keep the top-2, weights p_i (top-k after normalisation).
``softmax-renorm``
    the same top-2, weights p_i / (p_i + p_j) (Re-Norm; Mixtral's router). With K = 1
    every weight is 1 and the router gets no gradient, so moelab refuses that config
    (the report shows the refusal).
``sigmoid-bias``
    weights sigmoid(s_i), not normalised, with auxiliary-loss-free bias balancing
    (DeepSeek's Loss-Free balancing: a selection-only bias moved by the load).
``deepseek-v3``
    DeepSeek-V3's router: sigmoid affinities, top-2 by affinity + bias (loss-free, rate
    0.001), the two gates renormalised and scaled by 2.5, its sequence-wise balance loss.
``relu``
    ReLU gates, every positive one kept (ReMoE), their number steered to k = 2 on
    average by the adaptive L1 penalty.
``straight-through``
    weight 1 forward, the gradient of log p backward (the essay's straight-through
    estimator).
``sample``
    K = 2 experts drawn from the top K + c = 3 in proportion to p (training only).
``noisy``
    Gaussian noise on the scores before top-2 (training only; the weights are p of the
    clean scores).

Every arm routes top-2 (ReLU: 2 on average) with the same seed and data. The softmax
arms balance with the Switch loss (weight 0.01); the sigmoid arm with the loss-free
bias alone and the ReLU arm with its L1 term alone, as their recipes do. The essay has
no experiment of its own, so the ``paper`` scale is refused.

Measured on each trained run (:func:`measure`, one pass over the first validation
batches with :func:`moelab.diagnostics.stats`): the validation loss and perplexity, the
active experts and contributors per token, the discarded mass (for maps on the simplex,
where it is a share of probability), the mean sum of a token's gate weights, and the CV
of the experts' load; and how often training-time routing (noise, sampling) leaves the
evaluation-time choice (:func:`exploration`). The K = 1 renormalised router is built and
refused (:func:`k1_refusal`), beside the gradient that explains why: on random scores
(:func:`gate_gradient`) and through the trained renorm routers forced to K = 1
(:func:`k1_checkpoint_gradient`). The loss oracle (:func:`oracle`) measures the essay's
principle, argmax rho = argmin l: each expert's loss on sampled validation tokens at the
last MoE layer beside the router's ranking (:func:`oracle_agreement`).

The report opens with the essay's claims (:data:`CLAIMS`, :func:`findings`): the K = 1
identity, checked seed by seed, and each arm against the reference ``softmax-topk`` as a
paired difference over seeds (every seed of every arm reads one corpus, so seed ``s`` of
two arms differs by the gate alone) with its 95% interval; :func:`checks` says whether
the mechanisms the claims rest on acted (exploration, the ReLU arm's expert count).

The parts, as every study has them: ``grid`` (the arms and their settings at each scale),
``run`` (what is measured on each trained run), ``findings`` (the essay's claims and the
checks), ``figures`` and ``analysis`` (the report's sections).

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import Arm, Context, Section, Study
from moelab.studies.gate_norm import analysis, grid
from moelab.studies.gate_norm.findings import (
    CLAIMS,
    K1_CLAIM,
    ORACLE_CLAIM,
    REFERENCE,
    findings,
)
from moelab.studies.gate_norm.grid import ARMS, PAPER_REFUSAL
from moelab.studies.gate_norm.run import (
    exploration,
    gate_gradient,
    k1_checkpoint_gradient,
    k1_refusal,
    measure,
    oracle,
    oracle_agreement,
    selected_TE,
)

__all__ = [
    "ARMS",
    "CLAIMS",
    "ORACLE_CLAIM",
    "GateNormStudy",
    "exploration",
    "findings",
    "gate_gradient",
    "k1_checkpoint_gradient",
    "k1_refusal",
    "measure",
    "oracle",
    "oracle_agreement",
    "selected_TE",
]


class GateNormStudy(Study):
    """Gate normalisation: eight gates, top-2, same seeds and data (see the module
    docstring)."""

    name = "gate-norm"
    reference = REFERENCE
    claims = (K1_CLAIM, *(c.key for c in CLAIMS), ORACLE_CLAIM)
    title = (
        "Gate normalisation: softmax with and without renorm, sigmoid, ReLU, "
        "straight-through, sampling, noise"
    )
    paper = "a blog essay on whether MoE gates should be normalised (Su, 2026)"
    paper_refusal = PAPER_REFUSAL

    def common(self, scale: str) -> dict[str, Any]:
        return grid.common(scale)

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        return grid.arms(scale, options)

    def analyse(self, ctx: Context) -> list[Section]:
        return analysis.analyse(ctx)
