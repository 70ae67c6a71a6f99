"""Estimated training memory per GPU of a model config under each parallel mode.

``moelab params --preset NAME --memory [--gpus N] [--ep E] [--batch-tokens T]`` prints
these estimates; the formulas are the module's documentation:

State, per parameter (AdamW as moelab trains: fp32 moments):
    params fp32 (the default, what ``moelab train`` keeps; CUDA computes under bf16
    autocast or FSDP's bf16 mixed precision):  4 (param) + 4 (grad) + 8 (AdamW m, v)
    = 16 bytes;
    params bf16 (``param_dtype="bf16"``):  2 (param) + 2 (grad) + 8 (m, v) + 4 (fp32
    master copy, counted with the optimizer) = 16 bytes.

Sharding of that state per GPU (N GPUs, EP group size e):
    one GPU, DDP over N:  everything (DDP replicates);
    FSDP over N:          everything / N;
    EP = e x FSDP:        the mesh ("dp", "ep") = (N / e, e): the experts are split over
                          "ep" (E / e per GPU) and sharded over "dp", so expert state is
                          expert / e / (N / e); the rest is sharded over all N GPUs.

Buffers (transient, present at the peak):
    DDP:   gradient buckets, one copy of every gradient (4 bytes per parameter);
    FSDP:  unsharded parameters in the compute dtype (2 bytes, bf16): the root unit
           (embeddings, output head, final norm; kept gathered from the forward through
           the backward) plus two blocks (the one computing and the one prefetched),
           and one unit's unsharded fp32 gradient before its reduce-scatter:
           2 (P_root + 2 P_block) + 4 max(P_root, P_block); under EP a block holds
           E / e experts.

Activations per token (the tensors autograd saves for the backward), in bytes, with
b = 2 (bf16 under autocast) and the residual stream in fp32 (moelab's parameters are
fp32), per block:
    two RMSNorms, each 8 D (its fp32 input and fp32 normalised values; the norm
        computes in fp32);
    attention b 7 D + 4 H (the bf16 copy of the normed input, the q projection,
        q, k, v after the rotary embedding and the GQA repeat, the attention output,
        its reshaped copy for the output projection; the fp32 log-sum-exp per head;
        flash / memory-efficient SDPA keeps no S x S scores);
    a dense SwiGLU b (D + 4 F) (the input copy; gate, silu, up, product);
    an MoE layer b (D + K (2 D + 4 F_e) + 4 F_e N_shared) + 8 E' (the input copy; the
        K permuted rows, their 4 F_e hidden values and output rows; shared experts;
        two fp32 rows of the router's E' scored experts);
the head: 8 D (final norm) + b D (its bf16 copy) + 6 V (the fp32 log-probabilities of
the loss, 4 V, and the bf16 logits the model returns, 2 V):

    A = sum over blocks of (16 D + attention + FF) + (8 + b) D + 6 V

With activation checkpointing (``--checkpoint-activations``: every block recomputed in
the backward) only each block's fp32 input (4 D) stays, plus one block's activations
while it is recomputed: 4 L D + max A_block + head. Activation memory per GPU = A x
the micro-batch tokens per GPU T (sequences x sequence length); it does not depend on
the parallel mode (EP moves the same K T rows on average). A test compares A with the
bytes autograd saves for `tiny` on the CPU. The figures are estimates (transient
buffers of the backward, allocator fragmentation, the CUDA context ~0.5 GiB and NCCL
buffers are not counted): compare modes with them, check with
``torch.cuda.max_memory_allocated`` (``moelab bench gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig, null_expert_params, param_counts

GIB = 1024**3
PARAM_DTYPES = ("fp32", "bf16")
ACT_BYTES = 2
"""Bytes per saved activation value (bf16)."""


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts by where they live (computed from the config, not built)."""

    total: int
    expert: int
    """The routed experts of every MoE layer (what EP splits)."""
    root: int
    """Embeddings, output head and final norm (FSDP's root unit)."""
    dense_block: int
    """Parameters of a block with a dense feed-forward (0: every block is MoE)."""
    moe_block: int
    """Parameters of an MoE block without its routed experts (0: no MoE layers)."""
    block_experts: int
    """Routed-expert parameters of one MoE block (0: no MoE layers)."""

    @property
    def dense(self) -> int:
        """Everything but the routed experts."""
        return self.total - self.expert

    def largest_block(self, ep: int = 1) -> int:
        """Parameters of the largest block on one GPU, with E / ep experts per MoE block."""
        moe = self.moe_block + self.block_experts // ep if self.block_experts else 0
        return max(self.dense_block, moe)


def param_split(config: ModelConfig) -> ParamSplit:
    """Split of `param_counts`' total into experts, the root unit and a block."""
    c = config
    d = c.d_model
    assert c.expert_d_ff is not None
    expert_one = 3 * d * c.expert_d_ff
    n_moe = len(c.moe_indices)
    total = param_counts(c)["total"]
    root = 2 * c.vocab_size * d + d
    attn = 2 * d * c.n_heads * c.head_dim + 2 * d * c.n_kv_heads * c.head_dim + 2 * d
    dense_block = attn + 3 * d * c.d_ff
    moe_block = 0
    if n_moe:
        rc = c.router_config()
        moe_block = attn + rc.n_scored * d + c.n_shared_experts * expert_one
        moe_block += (d if c.shared_gate else 0) + null_expert_params(rc)
    n_dense = c.n_layers - n_moe
    return ParamSplit(
        total=total,
        expert=n_moe * c.n_experts * expert_one,
        root=root,
        dense_block=dense_block if n_dense else 0,
        moe_block=moe_block,
        block_experts=c.n_experts * expert_one if n_moe else 0,
    )


def activation_bytes_per_token(
    config: ModelConfig, checkpoint_activations: bool = False, act_bytes: int = ACT_BYTES
) -> dict[str, int]:
    """Saved-activation bytes per token (the module docstring's formula): "blocks",
    "head" and "total"."""
    c = config
    d, b = c.d_model, act_bytes
    assert c.expert_d_ff is not None
    moe = set(c.moe_indices)
    k = c.router_config().expected_experts if moe else 0.0
    norms = 2 * 8 * d
    attention = b * 7 * d + 4 * c.n_heads
    per_block = []
    for i in range(c.n_layers):
        if i in moe:
            slots = k * (2 * d + 4 * c.expert_d_ff) + 4 * c.expert_d_ff * c.n_shared_experts
            ff = b * (d + slots) + 8 * c.router_config().n_scored
        else:
            ff = b * (d + 4 * c.d_ff)
        per_block.append(round(norms + attention + ff))
    head = 8 * d + b * d + 6 * c.vocab_size
    blocks = c.n_layers * 4 * d + max(per_block) if checkpoint_activations else sum(per_block)
    return {"blocks": blocks, "head": head, "total": blocks + head}


def default_ep(config: ModelConfig, gpus: int) -> int:
    """The largest EP group size > 1 that divides both the GPUs and the experts (1: none)."""
    if not config.moe_indices:
        return 1
    return max(
        (e for e in range(2, gpus + 1) if gpus % e == 0 and config.n_experts % e == 0), default=1
    )


def _row(
    name: str,
    label: str,
    split: ParamSplit,
    gpus: int,
    ep: int,
    param_dtype: str,
    act_total: int,
    batch_tokens: int,
) -> dict:
    p_bytes = 4 if param_dtype == "fp32" else 2
    g_bytes = p_bytes
    o_bytes = 8 if param_dtype == "fp32" else 12  # + the fp32 master copy
    if name in ("single", "ddp"):
        dense_div = expert_div = 1
    elif name == "fsdp":
        dense_div = expert_div = gpus
    else:  # ep_fsdp: experts / e over "ep", then / (N / e) over "dp"
        dense_div, expert_div = gpus, ep * (gpus // ep)
    dense, expert = split.dense / dense_div, split.expert / expert_div
    shard = dense + expert
    if name == "ddp":
        buffers = 4 * split.total
    elif name in ("fsdp", "ep_fsdp"):
        block = split.largest_block(ep if name == "ep_fsdp" else 1)
        buffers = 2 * (split.root + 2 * block) + 4 * max(split.root, block)
    else:
        buffers = 0
    row = {
        "parallel": name,
        "label": label,
        "gpus": gpus,
        "ep": ep,
        "params_per_gpu": round(shard),
        "expert_params_per_gpu": round(expert),
        "param_bytes": round(p_bytes * shard),
        "grad_bytes": round(g_bytes * shard),
        "optimizer_bytes": round(o_bytes * shard),
        "buffer_bytes": round(buffers),
        "activation_bytes": act_total * batch_tokens,
    }
    row["state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    row["total_bytes"] = row["state_bytes"] + row["buffer_bytes"] + row["activation_bytes"]
    return row


def estimate(
    config: ModelConfig,
    gpus: int = 8,
    ep: int | None = None,
    batch_tokens: int = 8192,
    checkpoint_activations: bool = False,
    param_dtype: str = "fp32",
) -> dict:
    """Memory per GPU for one GPU, DDP over ``gpus``, FSDP over ``gpus`` and (when ``ep``
    > 1, by default `default_ep`) EP = ep x FSDP over gpus / ep: bytes of parameters,
    gradients, optimizer state, buffers and activations for ``batch_tokens`` tokens per
    GPU per micro-batch.

    Raises:
        ValueError: a non-positive count, an ``ep`` that does not divide ``gpus`` or the
            experts, EP on a model without MoE layers, an unknown ``param_dtype``.
    """
    if gpus < 1 or batch_tokens < 1:
        raise ValueError(f"gpus and batch_tokens must be >= 1, got {gpus} and {batch_tokens}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")
    if ep is None:
        ep = default_ep(config, gpus)
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if ep > 1:
        if not config.moe_indices:
            raise ValueError("ep > 1 needs MoE layers; this model has none (use --ep 1)")
        if gpus % ep or config.n_experts % ep:
            raise ValueError(
                f"ep = {ep} must divide the GPUs ({gpus}) and the experts "
                f"({config.n_experts}); choose a common divisor"
            )
    split = param_split(config)
    act = activation_bytes_per_token(config, checkpoint_activations)
    modes = [("single", "1 GPU", 1, 1)]
    if gpus > 1:
        modes += [("ddp", f"DDP x {gpus}", gpus, 1), ("fsdp", f"FSDP x {gpus}", gpus, 1)]
    if ep > 1:
        modes.append(("ep_fsdp", f"EP {ep} x FSDP {gpus // ep}", gpus, ep))
    rows = [
        _row(n, label, split, g, e, param_dtype, act["total"], batch_tokens)
        for n, label, g, e in modes
    ]
    return {
        "params": split.total,
        "expert_params": split.expert,
        "gpus": gpus,
        "ep": ep,
        "batch_tokens": batch_tokens,
        "checkpoint_activations": checkpoint_activations,
        "param_dtype": param_dtype,
        "activation_bytes_per_token": act,
        "rows": rows,
        "assumptions": [
            f"AdamW with fp32 moments; parameters {param_dtype}"
            + (" with an fp32 master copy" if param_dtype == "bf16" else ""),
            f"bf16 activations; {batch_tokens} tokens per GPU per micro-batch; activation "
            f"checkpointing {'on' if checkpoint_activations else 'off'}",
            "FSDP buffers: bf16 root unit + two blocks gathered, one fp32 unsharded "
            "gradient; DDP buffers: one gradient copy (buckets)",
            "not counted: CUDA context, NCCL buffers, allocator fragmentation",
        ],
    }


def format_table(result: dict, preset: str = "") -> str:
    """The estimate as a Markdown table in GiB per GPU."""
    head = (
        f"memory per GPU (GiB){' of ' + preset if preset else ''}: "
        f"{result['params'] / 1e6:,.1f}M params ({result['expert_params'] / 1e6:,.1f}M in "
        f"experts), {result['batch_tokens']} tokens per GPU, activation checkpointing "
        f"{'on' if result['checkpoint_activations'] else 'off'}"
    )
    lines = [
        head,
        "",
        "| parallel | params | grads | optimizer | buffers | activations | total |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]
    keys = (
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "buffer_bytes",
        "activation_bytes",
        "total_bytes",
    )
    for r in result["rows"]:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r[k] / GIB:.2f}" for k in keys) + " |")
    per_tok = result["activation_bytes_per_token"]["total"]
    lines += ["", f"activations per token: {per_tok / 1024:,.1f} KiB"]
    lines += [f"assumes: {a}" for a in result["assumptions"]]
    return "\n".join(lines)
