"""Fault trials: run the CLI of a moelab checkout through the faults of issue 20 and
count the outcomes (not collected by pytest; the tests in test_faults.py check each
promise once). Each trial is a child process on a tiny generated corpus.

    python tests/train/fault_trials.py [--repo PATH]   (PATH: the checkout to try;
                                                        default: this one)

Trials, each counted as "kept" when the promise holds:
- nan: lr = 1000 (dense and MoE, 3 seeds each): the run must not end with exit 0 or
  leave a checkpoint whose weights are not finite; a planted NaN checkpoint (the newest
  of two) must not be resumed from, and the finite one must survive.
- first-checkpoint kill: SIGKILL at each of the 6 writes of the first checkpoint, then
  ``--resume`` must run to the end.
- second SIGINT: two SIGINTs inside the first checkpoint's write: exit 130, no
  traceback, and ``--resume`` runs to the end.
- full disk: a 3 MB tmpfs (root only) filled during the first checkpoint; after space
  is freed, ``--resume`` runs to the end and no temporary file is left.
- cut-off metrics line: the last line of metrics.jsonl cut at 3 places, then
  ``--resume`` runs to the end.
- two trainers: a ``--resume`` started while the run trains must be refused, and the
  metrics must hold each step once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
from tests.train import make_corpus  # noqa: E402

TINY = [
    "--preset", "tiny", "--top-k", "2", "--threads", "1",
    "--set", "model.n_layers=2", "--set", "model.d_model=32", "--set", "model.n_heads=2",
    "--set", "model.n_kv_heads=1", "--set", "model.d_ff=64", "--set", "model.max_seq_len=32",
    "--set", "model.n_experts=4", "--set", "batch_size=4", "--set", "seq_len=32",
    "--set", "lr=0.01", "--set", "min_lr=0.001", "--set", "warmup_steps=2",
    "--set", "eval_every=0", "--set", "eval_batches=2", "--set", "log_every=1",
    "--set", "vocab_size=300", "--set", "val_fraction=0.1", "--set", "device=cpu",
]  # fmt: skip

# The child: the CLI, with a hook run at the k-th atomic write inside a checkpoint
CHILD = """
import os, signal, sys, time
from moelab.runs import checkpoints as C
hook, k = os.environ.get("TRIAL_HOOK", ""), int(os.environ.get("TRIAL_K", "0"))
slow = float(os.environ.get("TRIAL_SLOW", "0"))
write, calls = C.write_atomic, [0]
def patched(path, data):
    if "checkpoints" not in path.parts:  # only the writes of checkpoints are counted
        return write(path, data)
    calls[0] += 1
    if hook == "kill" and calls[0] == k:
        tmp = path.with_name("." + path.name + ".tmp" + str(os.getpid()))
        tmp.write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    if hook == "sigint2" and calls[0] == k:
        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)
    return write(path, data)
C.write_atomic = patched
if slow:
    from moelab.train import metrics
    append = metrics.write_row
    metrics.write_row = lambda run, row: (append(run, row), time.sleep(slow))
from moelab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def cli(repo: Path, args: list[str], env: dict | None = None, **kw):
    e = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=e, **kw
    )


def train_args(run: Path, corpus: Path, steps: int, *extra: str) -> list[str]:
    return ["train", *TINY, "--steps", str(steps), "--out", str(run), "--data", str(corpus), *extra]


def finite_checkpoints(run: Path) -> tuple[list[int], list[int]]:
    """(finite, not finite) steps of the run's checkpoints that have a manifest."""
    import torch
    from safetensors.torch import load_file

    good, bad = [], []
    for folder in sorted((run / "checkpoints").glob("step_*")):
        if not (folder / "manifest.json").is_file():
            continue
        tensors = load_file(folder / "model.safetensors")
        ok = all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
        (good if ok else bad).append(int(folder.name[5:]))
    return good, bad


def plant_nan(folder: Path) -> None:
    import torch

    from tests.train.test_faults import _rewrite_model

    _rewrite_model(
        folder,
        lambda t: t.update(
            {k: torch.full_like(v, float("nan")) for k, v in t.items() if v.is_floating_point()}
        ),
    )


def resumes(repo: Path, run: Path, corpus: Path, steps: int, *extra: str) -> bool:
    done = cli(repo, [*train_args(run, corpus, steps, *extra), "--resume"])
    return done.returncode == 0 and "Traceback" not in done.stderr


def trial_nan(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    out = []
    for moe in (False, True):
        for seed in range(3):
            run = tmp / f"nan-{moe}-{seed}"
            dense = [] if moe else ["--set", "model.moe_layers=none"]
            args = train_args(run, corpus, 40, "--set", "lr=1000", "--set", f"seed={seed}",
                              "--set", "checkpoint_every=5", *dense)  # fmt: skip
            done = cli(repo, args)
            _, bad = finite_checkpoints(run) if run.is_dir() else ([], [])
            out.append(done.returncode != 0 and not bad and "Traceback" not in done.stderr)
    for i in range(2):
        run = tmp / f"planted-{i}"
        cli(repo, train_args(run, corpus, 10, "--set", "checkpoint_every=5"))
        plant_nan(run / "checkpoints" / "step_00000010")
        done = cli(repo, [*train_args(run, corpus, 20 + 5 * i, "--set", "checkpoint_every=5"),
                          "--resume"])  # fmt: skip
        good, bad = finite_checkpoints(run)
        out.append(done.returncode == 0 and not bad and bool(good) and "from step 5" in done.stderr)
    return out


def trial_kill(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    out = []
    for k in range(1, 7):
        run = tmp / f"kill-{k}"
        cli(repo, train_args(run, corpus, 8, "--set", "checkpoint_every=5"),
            {"TRIAL_HOOK": "kill", "TRIAL_K": str(k)})  # fmt: skip
        out.append(resumes(repo, run, corpus, 8, "--set", "checkpoint_every=5"))
    return out


def trial_sigint2(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    out = []
    for k in (1, 3):
        run = tmp / f"sigint-{k}"
        done = cli(repo, train_args(run, corpus, 8, "--set", "checkpoint_every=5"),
                   {"TRIAL_HOOK": "sigint2", "TRIAL_K": str(k)})  # fmt: skip
        ok = done.returncode == 130 and "Traceback" not in done.stderr
        out.append(ok and resumes(repo, run, corpus, 8, "--set", "checkpoint_every=5"))
    return out


def trial_full_disk(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    mount = tmp / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                      capture_output=True).returncode:  # fmt: skip
        return []
    try:
        run = mount / "run"
        big = "--set", "model.d_model=128", "--set", "model.d_ff=256"
        done = cli(repo, train_args(run, corpus, 6, "--set", "checkpoint_every=3", *big))
        named = str(run) in done.stderr and "Traceback" not in done.stderr
        # free space: move the run to a roomy folder, as a user would
        roomy = tmp / "moved"
        shutil.copytree(run, roomy, symlinks=True)
        tmps = [p for p in roomy.rglob("*") if ".tmp" in p.name or p.name.endswith(".partial")]
        ok = resumes(repo, roomy, corpus, 6, "--set", "checkpoint_every=3", *big)
        return [named and not tmps and ok]
    finally:
        subprocess.run(["umount", str(mount)])


def trial_metrics(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    out = []
    for cut in (10, 50, 100):
        run = tmp / f"metrics-{cut}"
        cli(repo, train_args(run, corpus, 6, "--set", "checkpoint_every=3"))
        path = run / "metrics.jsonl"
        data = path.read_bytes()
        path.write_bytes(data + data.splitlines(keepends=True)[-1][:cut])
        out.append(resumes(repo, run, corpus, 9, "--set", "checkpoint_every=3"))
    return out


def trial_two_trainers(repo: Path, tmp: Path, corpus: Path) -> list[bool]:
    out = []
    for i in range(2):
        run = tmp / f"two-{i}"
        cli(repo, train_args(run, corpus, 2, "--set", "checkpoint_every=2"))
        e = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "TRIAL_SLOW": "0.3"}
        args = [*train_args(run, corpus, 14, "--set", "checkpoint_every=2"), "--resume"]
        first = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = (run / "metrics.jsonl").read_text().splitlines()
            if len(rows) > 3:
                break
            time.sleep(0.05)
        second = cli(repo, args, {"TRIAL_SLOW": "0.3"})
        first.communicate(timeout=120)
        steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        out.append(second.returncode != 0 and len(steps) == len(set(steps)))
    return out


TRIALS = {
    "nan (lr=1000, planted NaN checkpoint)": trial_nan,
    "SIGKILL in the first checkpoint": trial_kill,
    "second SIGINT in a checkpoint write": trial_sigint2,
    "full disk in the first checkpoint": trial_full_disk,
    "cut-off metrics line": trial_metrics,
    "two trainers on one folder": trial_two_trainers,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE.parents[2])
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        corpus = make_corpus(tmp / "corpus")
        for name, fn in TRIALS.items():
            if args.only and args.only not in name:
                continue
            t0 = time.monotonic()
            kept = fn(args.repo.resolve(), tmp, corpus)
            print(f"{name:40s} {sum(kept)} of {len(kept)} kept ({time.monotonic() - t0:.0f} s)",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
