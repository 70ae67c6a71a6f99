"""The arms of the ``softmoe`` study (:mod:`moelab.studies.softmoe`), their settings at
each scale and the SoftMoE paper's constants that the arms, tables and findings share; at
the paper scale, where each value comes from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import MOELAB_CHOICE, Arm
from moelab.studies.settings import settings

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

_SOFT_ROUTER: dict[str, Any] = {
    "map": "lapsum",
    "selection": "threshold",
    "lapsum_k": SOFT_K,
    "token_cap_factor": ALPHA,
    "truncation_relative": True,
    "schedule": "cosine",
    "temperature": 5.0,
    "tau_final": 1.0,
    "aux_probs": "normalized",
    "noise_std": 0.0,
}

# the paper's setup (Appendix B, OpenWebText): 8 GPUs, global batch 240, 18k steps
_PAPER_STEPS = 18_000


_COMMON_ROUTER: dict[str, Any] = {"aux_weight": 0.01, "capacity_factor": None, "renorm": False}
"""Router settings every arm shares: the Switch balancing loss, dropless experts, the
gate weights of the map without renormalisation."""


def common(scale: str) -> dict[str, Any]:
    router = dict(_COMMON_ROUTER)
    if scale == "quick":
        return settings(
            "quick",
            {
                "model": dict(n_experts=8, moe_layers="all", router=router),
                "steps": 12,
                "min_lr": 1e-4,
                "eval_every": 0,
                "calibrate_batches": 2,
                "val_fraction": 0.1,
            },
        )
    if scale == "cpu":
        # NOTE: 160 steps of 8 x 128 tokens per arm, 9 arms; the learned arm's eta at
        # 37 x lr (:func:`k_lr_scale`). Measured for one seed at one
        # thread on the shared machine: 26-66 s a run (sparse-k4 the slowest, the
        # fixed-tau arms the fastest), 7.6 minutes a seed with the analysis, so ~23
        # minutes for 3 seeds run one after another. k_l of seed 0 at the end: 4.96,
        # 1.01, 1.02, 1.01 (spread 3.95; 0.16 with eta at 1 x lr)
        return settings(
            "cpu",
            {
                # the paper replaces the MLP of every block (Section 5)
                "model": dict(moe_layers="all", router=router),
                "steps": 160,
                "lr": 3e-3,
                "min_lr": 3e-5,
                "warmup_steps": 8,
                "eval_every": 0,
                "calibrate_batches": 4,
            },
        )
    if scale == "paper":
        return dict(
            preset="softmoe-1.6b",
            model=dict(router=router),
            steps=_PAPER_STEPS,
            batch_size=240,
            seq_len=2048,
            lr=1e-3,
            min_lr=1e-5,
            warmup_steps=_PAPER_STEPS // 100,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            grad_clip=1.0,
            vocab_size=32_000,
            val_fraction=0.02,
            eval_every=1000,
            eval_batches=20,
            checkpoint_every=1000,
            log_every=50,
            calibrate_batches=4,
        )
    raise ValueError(f"unknown scale {scale!r}; choose one of quick, cpu, paper")


def arms(scale: str, options: Mapping[str, Any]) -> list[Arm]:
    base = common(scale)
    steps = int(base["steps"])
    n_moe = _n_moe_layers(base)
    soft = {**_SOFT_ROUTER, "anneal_steps": steps}
    sparse = {"map": "softmax", "selection": "topk", "lapsum_k": None, "noise_std": 0.0}
    arms = [
        Arm(
            f"sparse-k{k}",
            f"Sparse MoE k={k}",
            {"model": {"router": {**sparse, "top_k": k}}},
            tags={"kind": "sparse", "k": k, "jitter": 0.0},
        )
        for k in SPARSE_KS
    ]
    arms.append(
        Arm(
            "softmoe-star",
            f"SoftMoE* k={SOFT_K:g}, α={ALPHA:g}",
            {"model": {"router": soft}},
            tags={"kind": "star", "k": SOFT_K, "alpha": ALPHA, "tau": None},
        )
    )
    k_lr = {"k_lr_scale": k_lr_scale(scale)} if scale != "paper" else {}
    arms.append(
        Arm(
            "softmoe",
            f"SoftMoE k={SOFT_K:g}, α={ALPHA:g} (learned k_l)",
            {"model": {"k_total": SOFT_K * n_moe, **k_lr, "router": soft}},
            tags={"kind": "learned", "k": SOFT_K, "alpha": ALPHA, "tau": None},
        )
    )
    for tau in FIXED_TAUS:
        arms.append(
            Arm(
                f"softmoe-star-tau{tau:g}",
                f"SoftMoE* k={SOFT_K:g}, α={ALPHA:g}, τ={tau:g}",
                {"calibrate_batches": 0, "model": {"router": {**soft, "truncation": tau}}},
                tags={"kind": "star", "k": SOFT_K, "alpha": ALPHA, "tau": tau},
            )
        )
    for k in JITTER_KS:
        arms.append(
            Arm(
                f"sparse-k{k}-jitter",
                f"Sparse MoE k={k}, jitter {JITTER:g}",
                {"model": {"router": {**sparse, "top_k": k, "noise_std": JITTER}}},
                tags={"kind": "sparse", "k": k, "jitter": JITTER},
            )
        )
    return arms


def k_lr_scale(scale: str) -> float:
    """The learned arm's ``model.k_lr_scale``: the allocator's eta gets the cumulative
    learning rate (sum over steps of lr_t, about how far Adam can move eta) of the
    paper's OWT run (18k steps, 1e-3 cosine to 1e-5), rounded to a whole multiple of
    the scale's own lr schedule; 1 at the paper scale.

    NOTE: at cpu the sum is 0.244 against the paper's 9.09, so 37 x: with 1 x the
    four k_l ended 0.16 apart after 160 steps (seed 0: 2.11, 1.97, 1.96, 1.96), with
    10 x 1.89 apart, with 30 x 3.75 apart (4.81, 1.07, 1.07, 1.06; the validation loss
    5.225 against 5.350 at 1 x), each run ~65-78 s at one thread. At quick (12 steps,
    0.066) it is 139 x; 1 x left the two k_l 0.08 apart, 30 x 1.60."""
    if scale == "paper":
        return 1.0
    return float(round(_lr_sum(common("paper")) / _lr_sum(common(scale))))


def paper_sources() -> dict[str, str]:
    stated = "stated: "
    choice = MOELAB_CHOICE + ": "
    sources = {
        "preset": stated + "Table 2 and Section 5 (10 blocks, 32 experts, 1.63B)",
        "model.n_layers": stated + "Table 2 (10 blocks)",
        "model.n_heads": stated + "Table 2 (10 attention heads)",
        "model.d_model": stated + "Table 2 (d_attn 640)",
        "model.d_ff": stated + "Table 2 (d_ffn 2560); SiLU, Appendix B",
        "model.n_experts": stated + "Section 5 and Appendix B (32 experts)",
        "model.moe_layers": stated + "Section 5 (every dense MLP replaced by MoE)",
        "model.vocab_size": stated + "Section 5 (BPE tokenizer, 32k vocabulary)",
        "model.n_kv_heads": choice + "not stated; GPT-2 attention has one K/V per head",
        "vocab_size": stated + "Section 5 (32k BPE)",
        "val_fraction": stated + "Section 5 (98% train, 2% validation)",
        "data": choice + "the paper trains on OpenWebText (OWT) or C4; pass the corpus with --data",
        "batch_size": stated + "Appendix B (global batch 240 on OWT; 600 on C4)",
        "seq_len": stated + "Appendix B (sequence length 2048)",
        "steps": stated + "Section 5 and Appendix B (18k steps on OWT; 164k on C4)",
        "lr": stated + "Appendix B (10^-3, cosine)",
        "min_lr": stated + "Appendix B (annealed to 10^-5 with cosine decay)",
        "warmup_steps": stated + "Appendix B (warm-up over the first 1% of training)",
        "betas": stated + "Appendix B (Adam, beta1 0.9, beta2 0.95)",
        "weight_decay": choice + "not stated; the paper names Adam, and 0 makes AdamW Adam",
        "grad_clip": choice + "not stated",
        "calibrate_batches": choice
        + "the paper calibrates tau on 'initial input batches' (Section 5, "
        "Implementation Details) without their number",
        "eval_every": choice + "not stated",
        "eval_batches": choice + "not stated",
        "checkpoint_every": choice + "not stated",
        "log_every": choice + "not stated",
        "router.aux_weight": choice
        + "an auxiliary balancing loss (Fedus et al.) is stated (Section 5), its weight "
        "is not; 0.01 is the Switch Transformer's",
        "router.capacity_factor": choice + "not stated; dropless",
        "router.renorm": stated + "Section 4 (G(x) = Top_k(softmax(x W_g)), no renormalisation)",
        "router.noise_std": stated + "Appendix B (jitter disabled in the sparse baselines)",
    }
    for k in SPARSE_KS:
        sources[f"sparse-k{k}:router.top_k"] = stated + "Section 5 and Table 1 (k in 1..4)"
    for k in JITTER_KS:
        sources[f"sparse-k{k}-jitter:router.noise_std"] = (
            stated + "Table 8 (jitter 0.05); moelab's jitter is Gaussian noise on the logits"
        )
    soft_arms = ["softmoe-star", "softmoe", *(f"softmoe-star-tau{t:g}" for t in FIXED_TAUS)]
    for arm in soft_arms:
        sources.update(
            {
                f"{arm}:router.map": stated + "Sections 3-4 (LapSum soft top-k)",
                f"{arm}:router.selection": stated + "Section 4 (truncation z 1[z > tau])",
                f"{arm}:router.lapsum_k": stated + "Table 1 (k = 2)",
                f"{arm}:router.token_cap_factor": stated
                + "Section 5, Implementation Details, and Table 1 (alpha = 2)",
                f"{arm}:router.truncation_relative": stated
                + "Tables 6 and 7 (effective threshold tau k / E)",
                f"{arm}:router.schedule": stated
                + "Appendix B (SoftTopK temperature annealed by cosine decay)",
                f"{arm}:router.temperature": stated + "Appendix B (from 5)",
                f"{arm}:router.tau_final": stated + "Appendix B (to 1)",
                f"{arm}:router.anneal_steps": stated + "Appendix B (during training)",
                f"{arm}:router.aux_probs": choice
                + "not stated; P of the balancing loss is the LapSum weights / k",
                f"{arm}:router.noise_std": choice
                + "Section 5 mentions small gating noise, Appendix B turns jitter off; 0",
            }
        )
    sources["softmoe-star:calibrate_batches"] = (
        stated + "Section 5 (tau set from initial batches so that about k experts pass)"
    )
    sources["softmoe:model.k_total"] = stated + "Section 4 (K = 2 L matches k = 2; Table 1)"
    sources["softmoe:model.k_lr_scale"] = (
        choice + "the paper trains eta with the model's lr (Section 4); at the quick and cpu "
        "scales eta gets the paper's cumulative lr (sum of lr_t over its 18k OWT steps, "
        "9.09) as a multiple of the scale's own (cpu: 37 x), else the k_l barely move "
        "in 160 steps (0.16 apart at 1 x); 1 at the paper scale"
    )
    for tau in FIXED_TAUS:
        arm = f"softmoe-star-tau{tau:g}"
        sources[f"{arm}:router.truncation"] = stated + f"Table 6 (train-time tau {tau:g})"
        sources[f"{arm}:calibrate_batches"] = stated + "Table 6 (a fixed tau, not calibrated)"
    return sources


def _lr_sum(common: Mapping[str, Any]) -> float:
    """The sum over the run's steps of its learning rate (moelab.train.loop.lr_at)."""
    from moelab.train import TrainConfig
    from moelab.train.loop import lr_at

    keys = ("steps", "lr", "min_lr", "warmup_steps")
    cfg = TrainConfig(**{k: common[k] for k in keys if k in common})
    return sum(lr_at(step, cfg) for step in range(cfg.steps))


def _n_moe_layers(common: Mapping[str, Any]) -> int:
    """L, the MoE layers of the model the common settings describe."""
    from moelab.train import TrainConfig

    return len(TrainConfig(**common).model_config().moe_indices)
