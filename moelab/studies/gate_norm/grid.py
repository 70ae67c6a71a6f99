"""The arms of the ``gate-norm`` study (:mod:`moelab.studies.gate_norm`), their settings
at each scale and the table of where each setting comes from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import Arm
from moelab.studies.settings import DEFAULT, settings

TOP_K = 2
"""K of every arm (the ReLU arm's mean number of active experts)."""
AUX_WEIGHT = 0.01
"""Switch balance-loss weight of the softmax arms (Switch Transformer's alpha)."""
BIAS_RATE = 0.01
"""Loss-free balancing's bias update rate of the sigmoid arm."""
V3_BIAS_RATE = 0.001
"""DeepSeek-V3's bias update speed gamma (its report: 0.001 for most of training)."""
V3_ROUTED_SCALING = 2.5
"""DeepSeek-V3's routed scaling factor (its config's ``routed_scaling_factor``)."""
V3_AUX_WEIGHT = 1e-4
"""DeepSeek-V3's complementary sequence-wise balance loss weight alpha (its report)."""
SAMPLE_EXTRA = 1
"""c of the sampling arm: K experts drawn from the top K + c."""
NOISE_STD = 0.1
"""Standard deviation of the noise on the scores of the noisy arm."""
L1_INIT = 1e-8
"""lambda_0 of the ReLU arm's adaptive L1 (ReMoE's)."""
CPU_STEPS = 180
"""Training steps of every run at the cpu scale (the base's 250 cut to fit the budget)."""
CPU_EVAL_EVERY = 60
"""Validation interval at the cpu scale (three evaluations, the last at the end)."""
CPU_CHECKPOINT_EVERY = 90
"""Checkpoint interval at the cpu scale (the run's end is always saved)."""

_SOFTMAX_BALANCE = {"aux_weight": AUX_WEIGHT}

ARMS: list[tuple[str, str, dict[str, Any]]] = [
    ("softmax-topk", "softmax, top-2, no renorm", {"map": "softmax", "gate": "map"}),
    ("softmax-renorm", "softmax, top-2, renorm", {"map": "softmax", "gate": "renorm"}),
    (
        "sigmoid-bias",
        "sigmoid, top-2, loss-free bias",
        {"map": "sigmoid", "gate": "map", "bias_rate": BIAS_RATE},
    ),
    (
        "deepseek-v3",
        "sigmoid, top-2, renorm, bias 0.001 (DeepSeek-V3)",
        {
            "map": "sigmoid",
            "gate": "renorm",
            "rank_by": "probs",
            "bias_rate": V3_BIAS_RATE,
            "routed_scaling": V3_ROUTED_SCALING,
            "aux_weight": V3_AUX_WEIGHT,
            "aux_scope": "sequence",
            "aux_probs": "normalized",
        },
    ),
    (
        "relu",
        f"ReLU, L1 to k = {TOP_K}",
        {
            "map": "relu",
            "gate": "map",
            "selection": "threshold",
            "truncation": 0.0,
            "l1_target": float(TOP_K),
            "l1_init": L1_INIT,
        },
    ),
    (
        "straight-through",
        "softmax, top-2, straight-through",
        {"map": "softmax", "gate": "straight_through"},
    ),
    (
        "sample",
        f"softmax, sample 2 of top {TOP_K + SAMPLE_EXTRA}",
        {"map": "softmax", "gate": "map", "sample_extra": SAMPLE_EXTRA},
    ),
    (
        "noisy",
        f"softmax, noisy scores (sd {NOISE_STD:g}), top-2",
        {"map": "softmax", "gate": "map", "noise_std": NOISE_STD},
    ),
]
"""(arm name, label, router fields) of every arm; the softmax arms also get the Switch
balance loss (``aux_weight``)."""

SETTINGS: list[tuple[str, str, str]] = [
    ("top-k", f"K = {TOP_K} in every arm", "the essay's setting for its variants (top-k, K > 1)"),
    (
        "softmax arms' balance",
        f"Switch loss, weight {AUX_WEIGHT:g}",
        "moelab's choice: the essay relies on some load balancing for top-k",
    ),
    (
        "sigmoid arm",
        f"no renorm, loss-free bias, rate {BIAS_RATE:g}",
        "moelab's choice: the essay's unnormalised case; a rate 10x DeepSeek's 0.001 "
        "because the runs are short",
    ),
    (
        "DeepSeek-V3 arm",
        f"sigmoid affinities, top-2 by affinity + bias (rate {V3_BIAS_RATE:g}), gates "
        f"renormalised over the two and scaled by {V3_ROUTED_SCALING:g}, sequence-wise "
        f"balance loss {V3_AUX_WEIGHT:g}",
        "the DeepSeek-V3 report (the essay: 'DeepSeek changed the activation function to "
        "Sigmoid', 'later used in DeepSeek-V3'); its routed scaling 2.5 is for 8 of 256 "
        "experts, kept as stated",
    ),
    (
        "ReLU arm",
        f"keep every positive gate, adaptive L1 to k = {TOP_K}, lambda_0 = {L1_INIT:g}",
        "ReMoE's router and lambda_0",
    ),
    (
        "sampling",
        f"c = {SAMPLE_EXTRA}: 2 of the top 3, in proportion to p",
        "moelab's choice of c (the essay: 'slightly expand beyond the top-k')",
    ),
    (
        "noise",
        f"Gaussian, sd {NOISE_STD:g} on the scores",
        "moelab's choice of sd (the essay: 'slight noise')",
    ),
]
"""(setting, value, where it comes from) of the choices the report lists."""

PAPER_REFUSAL = (
    "gate-norm has no paper scale: the gate-normalisation essay reports no experiment "
    "of its own (no model, data or budget to reproduce); use --scale cpu or --scale quick"
)
"""The message the paper scale is refused with: the essay has no experiment to reproduce."""


def common(scale: str) -> dict[str, Any]:
    if scale == "quick":
        # NOTE: the preset's learning rates, not the quick base's
        return settings(
            "quick",
            {"top_k": TOP_K, "lr": DEFAULT, "min_lr": DEFAULT, "log_every": 4},
        )
    if scale == "cpu":
        # NOTE: 180 steps of 8 x 128 tokens (184k tokens) per arm, validation every 60
        # (the cpu budget: 3 seeds within ~45 minutes on two cores). Measured
        # on one quiet thread: 35-36 s a run (0.16 s a step with the evaluations, ~7 s
        # to start), ~4 minutes a seed of the seven arms; a seed of 250 steps took
        # 20.5 minutes on the shared machine, which scales to ~15 at 180
        return settings(
            "cpu",
            {
                "top_k": TOP_K,
                "steps": CPU_STEPS,
                "eval_every": CPU_EVAL_EVERY,
                "checkpoint_every": CPU_CHECKPOINT_EVERY,
                "device": "cpu",
            },
        )
    raise ValueError(PAPER_REFUSAL)


def arms(scale: str, options: Mapping[str, Any]) -> list[Arm]:
    out = []
    for name, label, router in ARMS:
        # NOTE: every arm states its balance-loss weight (the library default is
        # not the essay's choice for the sigmoid and ReLU arms, which balance otherwise)
        router = {"aux_weight": 0.0, **router}  # deepseek-v3 states its own
        if router["map"] == "softmax":
            router.update(_SOFTMAX_BALANCE)
        out.append(Arm(name, label, {"model": {"router": router}}))
    return out
