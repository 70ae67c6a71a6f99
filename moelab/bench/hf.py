"""``moelab bench hf``: what reading a Hugging Face model's routing costs.

The model is a local ``save_pretrained`` folder (``--hf DIR``) or, by default, a tiny
random Mixtral built in memory (2 layers, E = 8 experts, top-2, width 64: the shape the
docs quote; nothing is fetched). On one batch of random token ids, ``batch`` sequences
of ``seq_len`` tokens, two passes take turns, ``repeats`` rounds of ``block`` forwards
each after ``warmup`` rounds:

``plain``
    ``model(input_ids, use_cache=False)`` under ``torch.no_grad``, as transformers runs
    it;
``hooked``
    the same forwards inside one :func:`moelab.integrations.hf.stats.collect` block,
    whose forward hooks read every router's output and add it to the routing
    statistics, the additions still held at the block's end included (what ``moelab
    stats --hf`` does over its batches).

Both are given per forward, each the median over its rounds; alternating the rounds
puts both under the same load. ``overhead`` = hooked / plain (1: free). After the timing
the statistics are checked to have counted every token of every hooked forward in every
MoE layer, so the hooks timed are the ones that ran.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moelab.bench.timing import num_threads

__all__ = ["format_report", "run", "tiny_mixtral"]


def tiny_mixtral(seed: int = 0) -> torch.nn.Module:
    """A random Mixtral causal LM: 2 layers, 8 experts, top-2, width 64, vocabulary 512,
    float32, in eval mode."""
    from moelab.integrations.hf.families import import_transformers

    tf = import_transformers()
    cfg = tf.MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return tf.MixtralForCausalLM(cfg).float().eval()


def run(
    hf: str | Path | None = None,
    batch: int = 4,
    seq_len: int = 512,
    threads: int | None = 1,
    repeats: int = 10,
    warmup: int = 1,
    block: int = 16,
    progress: bool = True,
    *,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Time ``plain`` against ``hooked`` (module docstring) on the model of ``hf`` (a
    tiny random Mixtral when None)."""
    if batch < 1 or seq_len < 2 or block < 1:
        raise ValueError(f"bench hf needs --batch-size >= 1, --seq-len >= 2 and --block >= 1, "
                         f"got {batch}, {seq_len}, {block}")  # fmt: skip
    if repeats < 1 or warmup < 0:  # the CLI checks these too; a library caller may not
        raise ValueError(f"bench hf needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    from moelab.integrations.hf.families import moe_routers
    from moelab.integrations.hf.stats import collect, load_hf

    if hf is None:
        model, what = tiny_mixtral(), "tiny random Mixtral (2 layers, E=8, top-2, width 64)"
    else:
        model, _ = load_hf(hf, trust_remote_code=trust_remote_code)
        what = str(hf)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                         f"{limit}")  # fmt: skip
    sites = moe_routers(model)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.no_grad()
    def forward() -> None:
        model(input_ids=x, use_cache=False)
        sync()

    times: dict[str, list[float]] = {"plain": [], "hooked": []}
    acc = None
    hooked_calls = 0
    with num_threads(threads):
        used = torch.get_num_threads()
        for i in range(warmup + repeats):
            if progress:
                print(f"bench hf: round {i + 1}/{warmup + repeats}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            for _ in range(block):
                forward()
            plain = time.perf_counter() - start
            start = time.perf_counter()
            with collect(model, acc) as acc:  # one accumulator over every round
                for _ in range(block):
                    forward()
            hooked = time.perf_counter() - start  # the block's last additions included
            hooked_calls += block
            if i >= warmup:
                times["plain"].append(plain / block)
                times["hooked"].append(hooked / block)
    assert acc is not None
    counted = [layer.n_states for layer in acc.layers]
    expected = hooked_calls * batch * seq_len
    if any(n != expected for n in counted):
        raise RuntimeError(f"bench hf: the statistics counted {counted} tokens per MoE layer "
                           f"where {expected} went through the hooked forwards")  # fmt: skip
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    tokens = batch * seq_len
    return {
        "model": what,
        "model_type": model.config.model_type,
        "moe_layers": len(sites),
        "batch": batch,
        "seq_len": seq_len,
        "threads": used,
        "repeats": repeats,
        "block": block,
        "ms": ms,
        "tokens_per_s": {k: tokens / (v / 1e3) for k, v in ms.items()},
        "overhead": ms["hooked"] / ms["plain"],
        "us_per_token_layer": 1e3 * (ms["hooked"] - ms["plain"]) / (tokens * len(sites)),
        "torch": torch.__version__,
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['model']} ({r['model_type']}, {r['moe_layers']} MoE layers): batch "
        f"{r['batch']} x {r['seq_len']} tokens, {r['threads']} thread(s); per forward, the "
        f"median of {r['repeats']} alternating rounds of {r['block']} forwards each",
        f"{'pass':<8} {'ms':>9} {'tokens/s':>10}",
    ]
    for name, v in r["ms"].items():
        lines.append(f"{name:<8} {v:>9.2f} {r['tokens_per_s'][name]:>10,.0f}")
    lines.append(
        f"overhead (hooked / plain): {r['overhead']:.3f}  "
        f"({r['us_per_token_layer']:.2f} us per token and MoE layer)"
    )
    return "\n".join(lines)
