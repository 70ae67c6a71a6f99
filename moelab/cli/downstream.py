"""``moelab downstream``: lm-evaluation-harness tasks per K."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moelab.cli.common import (
    HelpFormatter,
    add_json,
    add_step,
    add_trust_remote_code,
    emit,
    interruption,
    to_json,
)


def _check_device(device: str) -> None:
    """``--device``: a torch device string, and a CUDA device that torch sees (else a
    ValueError saying what to give instead)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device} is not a torch device; give cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}, but torch.cuda.is_available() is False (no CUDA GPU, or a "
            "torch built without CUDA); use --device cpu"
        )
    count = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and dev.index is not None and dev.index >= count:
        raise ValueError(
            f"--device {device}, but torch sees {count} CUDA GPU(s); give cuda:0 .. "
            f"cuda:{count - 1}"
        )


def _downstream(args: argparse.Namespace) -> int:
    _check_device(args.device)  # before any run is loaded
    from moelab.integrations.lm_eval import run_downstream
    from moelab.integrations.lm_eval.run import format_downstream

    try:
        result = run_downstream(
            args.runs, args.tasks, include_path=args.include_path, top_ks=args.top_k,
            limit=args.limit, batch_size=args.batch_size, device=args.device, hf=args.hf,
            network=args.network, progress=not args.json, num_fewshot=args.num_fewshot,
            step=args.step, trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    except ImportError as err:  # the eval extra is missing: the user's to install
        raise ValueError(str(err)) from err
    except KeyboardInterrupt as err:  # every finished (run, K) is already in RUN/downstream.json
        name, code = interruption(err)
        print(
            f"moelab downstream: interrupted by {name}; finished results are saved",
            file=sys.stderr,
        )
        if args.json:
            print(to_json({"interrupted": name}))
        return code
    return emit(args, result, format_downstream)


def register(sub: Any) -> None:
    ds = sub.add_parser(
        "downstream",
        help="downstream tasks (lm-evaluation-harness) per K, with routing per task",
        description="Evaluate runs on lm-evaluation-harness tasks for each K and print one "
        "table (rows: run x K, columns: acc / acc_norm per task) and the routing "
        "statistics of each task's tokens. Offline unless --network: tasks come from "
        "YAML files under --include-path (dataset_path: json with local data_files), or "
        "are the ready cloze task moelab_cloze, generated from each run's held-out text. "
        "Results are also saved to RUN/downstream.json with the checkpoint step and "
        "--limit (an earlier file of another step or limit is moved to RUN/downstream/), "
        "which moelab report reads. Needs "
        "the eval extra (pip install 'moelab[eval]'); see docs/downstream.md.",
        formatter_class=HelpFormatter,
    )
    ds.add_argument("runs", nargs="*", metavar="RUN", help="run folders (or --hf DIR)")
    ds.add_argument("--tasks", nargs="+", required=True, metavar="NAME", help="task names")
    ds.add_argument(
        "--include-path", action="append", default=None, metavar="DIR",
        help="a folder of task YAMLs (repeatable)",
    )  # fmt: skip
    ds.add_argument(
        "--top-k", type=int, nargs="+", default=None, help="values of K (None: the trained K)"
    )
    ds.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="N",
        help="at most N documents per task (below 1: that fraction of them)",
    )
    ds.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    ds.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples (None: the task's own number, usually 0)",
    )
    ds.add_argument("--device", default="cpu", help="torch device")
    add_step(ds, "every RUN")
    ds.add_argument(
        "--hf", action="append", default=None, metavar="DIR",
        help="a local Hugging Face MoE model folder to evaluate the same way (repeatable)",
    )  # fmt: skip
    add_trust_remote_code(
        ds, what=", and let the harness run the Python of the task YAMLs under "
        "--include-path (!function, metric scripts, includes from outside the folder) and "
        "render their templates outside Jinja's sandbox",
    )  # fmt: skip
    ds.add_argument(
        "--network", action="store_true",
        help="let lm-evaluation-harness and datasets download the tasks' data from the "
        "Hugging Face Hub into the local cache (needed once for the harness's own tasks, "
        "e.g. hellaswag; offline otherwise)",
    )  # fmt: skip
    add_json(ds)
    ds.set_defaults(func=_downstream)
