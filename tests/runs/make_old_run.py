"""Makes ``old_run/``: a tiny finished run folder (4 steps, 1.5-entmax, checkpoints at 2
and 4) kept in the repository as it was written, so that the run-folder format's readers
and the trainer's resume are checked against a folder made before their code changed
(test_old_run.py). Also writes ``old_run.expected.json``: the budget sweep of its newest
checkpoint and the machine it was computed on.

Remake it only when a change of format is meant (and say so in the commit):

    .venv/bin/python -m tests.runs.make_old_run
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HERE = Path(__file__).parent
RUN = HERE / "old_run"
EXPECTED = HERE / "old_run.expected.json"
MODEL = dict(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32, n_experts=4)
"""The model of the saved run (the training tests' tiny one, narrower)."""
TOP_KS = (1, 2, 3)


def cpu_flags() -> str:
    """The vector instruction sets this CPU has that change float results of torch's
    kernels (``avx512`` or ``avx2``, or the machine's architecture otherwise)."""
    import platform

    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return platform.machine()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else platform.machine()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): two CPUs with the same instruction sets can
    still take different code paths in torch's kernels (an AVX-512 AMD EPYC and an
    AVX-512 Intel Xeon round a float32 evaluation differently in the 9th digit)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def config(corpus: Path, out: Path, **kw):
    """The saved run's settings with its corpus at ``corpus`` and its folder at ``out``."""
    from tests.train import tiny_config

    base = dict(steps=4, checkpoint_every=2, model=dict(MODEL), map="entmax", alpha=1.5)
    return tiny_config(corpus, out, **{**base, **kw})


def corpus(folder: Path) -> Path:
    """The saved run's corpus (generated: the same 16 documents every time)."""
    from tests.train import make_corpus

    return make_corpus(folder, n_docs=16)


def main() -> None:
    import tempfile

    from moelab.diagnostics import evaluate
    from moelab.train import train

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        train(config(corpus(Path(tmp) / "corpus"), run))
        (run / ".lock").unlink(missing_ok=True)
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.copytree(run, RUN)
    result = evaluate(RUN, list(TOP_KS))
    EXPECTED.write_text(
        json.dumps(
            {"cpu": cpu_flags(), "cpu_model": cpu_model(), "evaluate": result},
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
