"""``moelab bench downstream --run RUN``: the throughput of the harness model's batched
``loglikelihood`` against a bare forward pass over the same tokens.

Requests: the items of the run's cloze task (:func:`moelab.integrations.lm_eval.
write_cloze_task`, written to a temporary folder, the run folder untouched), each a
``(context, " word")`` pair. Timed, each the median of ``repeats`` calls after
``warmup``:

``bare``
    the model alone (``collect=False``) on exactly the padded batches that
    ``loglikelihood`` builds (sorted by length, ``batch_size`` requests each);
``loglikelihood``
    :meth:`MoelabLM.loglikelihood` on the requests: tokenisation, sorting, padding, the
    forward passes, the log-probabilities of the continuations and the routing
    statistics per task;
``no_routing``
    the same scoring without the routing statistics (token ids in, scores out).

``ratio`` = bare / loglikelihood: the share of the bare model's throughput that
``moelab downstream`` keeps (1: no overhead). Timings on a shared machine are noisy;
the ratio is measured in one process.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from moelab.bench.timing import median_ms, num_threads

__all__ = ["format_table", "run"]


def run(
    run_dir: str | Path | None,
    batch_size: int = 16,
    threads: int | None = 1,
    repeats: int = 3,
    warmup: int = 1,
    n_requests: int = 300,
    progress: bool = True,
) -> dict[str, Any]:
    """Time ``bare``, ``loglikelihood`` and ``no_routing`` (module docstring) on the
    cloze requests of ``run_dir``."""
    if run_dir is None:
        raise ValueError("bench downstream needs a trained run: --run RUN")
    if batch_size < 1 or repeats < 1 or warmup < 0:
        raise ValueError("bench downstream needs batch_size >= 1, repeats >= 1, warmup >= 0")
    from moelab.diagnostics import load_run
    from moelab.integrations.lm_eval import import_lm_eval, write_cloze_task

    import_lm_eval()
    import json

    from lm_eval.api.instance import Instance

    from moelab.integrations.lm_eval.model import MoelabLM

    loaded = load_run(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        cz = write_cloze_task(run_dir, Path(tmp), n=n_requests)
        items = [json.loads(line) for line in Path(cz["data"]).read_text().splitlines()]
    reqs = [
        Instance("loglikelihood", {}, (it["context"], it["target"]), i, metadata=("cloze", i, 1))
        for i, it in enumerate(items)
    ]
    lm = MoelabLM(loaded=loaded, batch_size=batch_size)
    with num_threads(threads):
        used = torch.get_num_threads()
        pairs = [lm._encode_request(*r.args) for r in reqs]
        seqs = [[*c, *d][-lm.max_length :] for c, d in pairs]
        order = list(lm._batches([len(s) for s in seqs]))
        batches = [lm._pad([seqs[i] for i in idx]) for idx in order]
        tokens = sum(len(s) for s in seqs)
        padded = sum(x.numel() for x in batches)

        @torch.no_grad()
        def bare() -> None:
            for x in batches:
                loaded.model(x, collect=False)

        def loglikelihood() -> None:
            lm.reset()
            lm.loglikelihood(reqs, disable_tqdm=True)

        def no_routing() -> None:
            lm.score_tokens(pairs, None, disable_tqdm=True)

        ms = {}
        for name, fn in (
            ("bare", bare),
            ("loglikelihood", loglikelihood),
            ("no_routing", no_routing),
        ):
            if progress:
                print(f"timing {name}", file=sys.stderr, flush=True)
            ms[name] = median_ms(fn, repeats, warmup)
    return {
        "run": str(run_dir),
        "requests": len(reqs),
        "tokens": tokens,
        "padded_tokens": padded,
        "batch_size": lm.batch_size,
        "threads": used,
        "ms": ms,
        "tokens_per_s": {k: tokens / (v / 1e3) for k, v in ms.items()},
        "ratio": ms["bare"] / ms["loglikelihood"],
        "ratio_no_routing": ms["bare"] / ms["no_routing"],
    }


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"run {r['run']}: {r['requests']} cloze requests, {r['tokens']:,} tokens "
        f"({r['padded_tokens']:,} with padding), batch size {r['batch_size']}, "
        f"{r['threads']} thread(s)",
        f"{'pass':<14} {'ms':>9} {'tokens/s':>10} {'bare / pass':>11}",
    ]
    for name, v in r["ms"].items():
        ratio = r["ms"]["bare"] / v
        lines.append(f"{name:<14} {v:>9.1f} {r['tokens_per_s'][name]:>10,.0f} {ratio:>11.3f}")
    return "\n".join(lines)
