"""The arms of the ``sparse-maps`` study (:mod:`moelab.studies.sparse_maps`) and their
settings at each scale: four top-2 routers that differ only in their map, the dense
references, and at the paper scale where each value comes from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import MOELAB_CHOICE, Arm
from moelab.studies.settings import settings

MAPS: list[tuple[str, str, float | None, str]] = [
    ("softmax", "softmax", None, "softmax"),
    ("entmax15", "entmax", 1.5, "1.5-entmax"),
    ("sparsemax", "sparsemax", None, "sparsemax"),
    ("normmax2", "normmax", 2.0, "2-normmax"),
]
"""(arm name, map, alpha, label) of the four routers, every one top-2."""

SOFTMAX_BALANCED = "-sb"
"""The suffix of a softmax-balanced arm's name: the sparse map's router with the balance
loss computed on the softmax of its scores (``router.aux_probs=softmax``) instead of on
the map's own probabilities: the paper's softmax-balanced variant (Table 2's lower rows,
Figure 6). Softmax has none (the two losses are the same for it)."""

SOFTMAX_BALANCED_SIZES = ("300m",)
"""Paper scale: the sizes with softmax-balanced arms (the paper's Figure 6 shows its
300M routers trained so)."""

SIZES: dict[str, tuple[str, str, str, str]] = {
    "300m": ("paper-300m", "dense-283m", "300M", "283M"),
    "1b": ("paper-1b", "dense-1b", "1B", "1B"),
}
"""Paper scale: size -> (MoE preset, dense preset, MoE label, dense label)."""

DENSE_D_FF = {"quick": 288, "cpu": 1152}
"""Feed-forward width of the dense reference at the small scales: the MoE model's shape
without MoE layers, widened until its total parameters match the MoE model's (as the
paper's dense references match their MoE models' totals, Table 4), so its active budget
is larger."""

QUICK_MODEL: dict[str, Any] = dict(
    n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32, n_experts=8
)
"""The quick scale's model: the tiny preset shrunk (two MoE layers of 8 experts, so the
K sweep 1, 2, 4, 8 applies)."""


def router(map_name: str, alpha: float | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"map": map_name, "top_k": 2}
    if alpha is not None:
        fields["alpha"] = alpha
    return fields


CPU_STEPS = 400
"""Training steps of a run at the cpu scale (the demo's)."""

BALANCE: dict[str, Any] = {"aux_weight": 0.01, "aux_probs": "map"}
"""The balance loss of every arm at every scale: the paper's Switch loss on the map's own
probabilities (Table 2), weight 0.01 (not stated; the Switch Transformer's)."""


def balanced_arm(
    name: str, map_name: str, alpha: float | None, label: str, size: str | None = None
) -> Arm:
    """The softmax-balanced arm of a sparse map (:data:`SOFTMAX_BALANCED`); at the paper
    scale of the MoE ``size`` (a key of :data:`SIZES`)."""
    router_fields = {**router(map_name, alpha), "aux_probs": "softmax"}
    config: dict[str, Any] = {"model": {"router": router_fields}}
    if size is not None:
        config = {"preset": SIZES[size][0], **config}
    return Arm(
        f"{name}{SOFTMAX_BALANCED}" + (f"-{size}" if size else ""),
        f"{label} (softmax-balanced)",
        config,
        note="balance loss on softmax probabilities",
        tags={"kind": "moe", "map": map_name, "balance": "softmax", "base": name},
    )


def common(scale: str) -> dict[str, Any]:
    if scale == "quick":
        return settings(
            "quick",
            {
                "model": dict(QUICK_MODEL, router=dict(BALANCE)),
                "steps": 20,
                "eval_every": 10,
                "eval_batches": 2,
            },
        )
    if scale == "cpu":
        # NOTE: the demo's budget: 400 steps of 8 x 128 tokens (410k
        # tokens) per run, so that the demo (one seed: four runs and the analysis)
        # stays within 10 minutes and --seeds 3 within ~45 on two cores. At 0.16 s a
        # step and ~7 s to start on one quiet thread, a run takes ~70 s; the K sweep
        # and statistics of the analysis ~20 s a run
        return settings(
            "cpu",
            {
                "model": {"router": dict(BALANCE)},
                "steps": CPU_STEPS,
                "warmup_steps": 40,
                "eval_every": 100,
                "log_every": 10,
                # a checkpoint every 100 steps, all kept, for moelab analyze saturation
                "checkpoint_every": 100,
                "keep_every": 100,
            },
        )
    if scale == "paper":
        return dict(
            preset="paper-300m",
            vocab_size=128256,
            seq_len=2048,
            batch_size=256,
            steps=20000,
            lr=6e-4,
            min_lr=6e-5,
            warmup_steps=2000,
            weight_decay=0.1,
            betas=(0.9, 0.95),
            grad_clip=1.0,
            eval_every=1000,
            eval_batches=64,
            checkpoint_every=1000,
            log_every=50,
            model={"router": dict(BALANCE)},
        )
    raise ValueError(f"unknown scale {scale!r}")


def arms(scale: str, options: Mapping[str, Any]) -> list[Arm]:
    """The arms at ``scale``: the four maps (balanced on their own probabilities), the
    three sparse maps softmax-balanced (unless ``options["softmax_balanced"]`` is False,
    as ``moelab demo`` sets it) and, with ``options["dense"]`` or at the paper scale, the
    dense references."""
    if scale == "paper":
        arms = []
        for size, (moe, dense, moe_tag, dense_tag) in SIZES.items():
            arms.append(
                Arm(
                    f"dense-{dense_tag.lower()}",
                    f"dense {dense_tag}",
                    {"preset": dense},
                    note="dense reference, larger active budget",
                    tags={"kind": "dense"},
                )
            )
            for name, map_name, alpha, label in MAPS:
                arms.append(
                    Arm(
                        f"{name}-{size}",
                        f"{label} {moe_tag}",
                        {"preset": moe, "model": {"router": router(map_name, alpha)}},
                        tags={"kind": "moe", "map": map_name, "balance": "map", "base": name},
                    )
                )
            if options.get("softmax_balanced", True) and size in SOFTMAX_BALANCED_SIZES:
                for name, map_name, alpha, label in MAPS[1:]:
                    arms.append(balanced_arm(name, map_name, alpha, f"{label} {moe_tag}", size))
        return arms
    arms = [
        Arm(
            name,
            label,
            {"model": {"router": router(map_name, alpha)}},
            tags={"kind": "moe", "map": map_name, "balance": "map", "base": name},
        )
        for name, map_name, alpha, label in MAPS
    ]
    if options.get("softmax_balanced", True):
        arms += [balanced_arm(*m) for m in MAPS[1:]]
    if options.get("dense"):
        arms.insert(
            0,
            Arm(
                "dense",
                "dense (larger active budget)",
                {"model": {"moe_layers": "none", "d_ff": DENSE_D_FF[scale]}},
                note="dense reference, larger active budget",
                tags={"kind": "dense"},
            ),
        )
    return arms


def paper_sources() -> dict[str, str]:
    arch = (
        "stated: Table 4 (layers, width, Q/KV heads, FF width, 4 MoE layers replacing "
        "every second feed-forward block, experts; total, active and router parameters)"
    )
    choice = MOELAB_CHOICE
    sources = {
        "preset": arch + "; the 300M MoE (paper-300m)",
        "vocab_size": f"{choice}: 128,256 entries (a Llama-3-sized vocabulary); the paper "
        "names no tokenizer, but Table 4's parameter counts need this embedding size",
        "router.top_k": "stated: abstract and Table 3 (every MoE model is trained with K = 2)",
        "router.aux_probs": "stated: Table 2 caption (the main models balance the load "
        "with the map's own probabilities; softmax-based balancing is a separate variant)",
        "router.aux_weight": f"{choice}: the paper uses an auxiliary balancing loss "
        "without stating its weight; 0.01 as in the Switch Transformer",
        "seq_len": f"{choice}: 2048 tokens, the presets' max_seq_len (not stated)",
        "batch_size": f"{choice}: 256 sequences, about 0.5M tokens per step (not stated)",
        "steps": f"{choice}: 20,000 steps, about 10.5B tokens (not stated)",
        "lr": f"{choice}: peak 6e-4 (not stated)",
        "min_lr": f"{choice}: cosine decay to 6e-5 (the schedule is not stated)",
        "warmup_steps": f"{choice}: 2000 steps of linear warm-up (not stated)",
        "weight_decay": f"{choice}: AdamW, 0.1 (not stated)",
        "betas": f"{choice}: (0.9, 0.95) (not stated)",
        "grad_clip": f"{choice}: 1.0 (not stated)",
        "eval_batches": f"{choice}: 64 x 256 x 2048 tokens per evaluation; the paper "
        "evaluates on a retained DCLM sample (Table 9 caption: 1,000,983 targets)",
        "data": f"{choice}: give the DCLM corpus with --data (the paper trains and "
        "validates on DCLM, Table 1 caption) and Paloma WikiText-103 with --eval-data "
        "(Tables 6-8)",
        "seed": f"{choice}: seeds 0 .. N-1 (the paper's 300M runs used seed 42, Figure 5 caption)",
    }
    for size, (moe, _, moe_tag, dense_tag) in SIZES.items():
        sources[f"dense-{dense_tag.lower()}:preset"] = (
            f"stated: Table 4 (dense {dense_tag}) and Table 1 caption (the dense "
            "references have a larger active budget)"
        )
        for name, _, alpha, label in MAPS:
            arm = f"{name}-{size}"
            sources[f"{arm}:preset"] = f"{arch}; the {moe_tag} MoE ({moe})"
            sources[f"{arm}:router.map"] = f"stated: abstract and Table 1 ({label})"
            if alpha is not None:
                sources[f"{arm}:router.alpha"] = f"stated: abstract ({label}: alpha {alpha:g})"
        if size in SOFTMAX_BALANCED_SIZES:
            for name, _, _, label in MAPS[1:]:
                arm = f"{name}{SOFTMAX_BALANCED}-{size}"
                sources[f"{arm}:router.aux_probs"] = (
                    f"stated: Table 2 caption and Figure 6 (the {moe_tag} {label} router "
                    "trained with the balancing loss on softmax probabilities)"
                )
    return sources
