"""A run folder written before the code that reads it changed (``old_run/``, made by
make_old_run.py) loads, evaluates as it did then, and resumes to the weights it had.

On the CPU it was made on (``old_run.expected.json``'s ``cpu``, the instruction sets, and
``cpu_model``) the numbers must be bit for bit the same; on another CPU torch's kernels
may round differently (even with the same instruction sets: an AVX-512 Intel Xeon differs
from the AVX-512 AMD EPYC it was made on in the 9th digit), so they are compared within
float32 rounding of a few steps. A file without ``cpu_model`` is compared that way
everywhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.runs.make_old_run import EXPECTED, RUN, TOP_KS, config, cpu_flags, cpu_model

SAVED = json.loads(EXPECTED.read_text())
SAME_CPU = SAVED["cpu"] == cpu_flags() and SAVED.get("cpu_model") == cpu_model()


def _close(a, b) -> bool:
    if SAME_CPU:
        return a == b
    return a == pytest.approx(b, rel=1e-5, abs=1e-6)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A copy of the saved run (reading must not change the saved folder)."""
    return Path(shutil.copytree(RUN, tmp_path / "run"))


def test_the_saved_run_loads(run):
    from moelab.diagnostics import load_run

    loaded = load_run(run)
    assert loaded.step == 4
    assert loaded.config.map == "entmax" and loaded.config.alpha == 1.5
    assert loaded.model.config.n_experts == 4


def test_the_saved_run_evaluates_as_it_did(run):
    from moelab.diagnostics import evaluate

    got = evaluate(run, list(TOP_KS))
    want = SAVED["evaluate"]
    assert got["checkpoint_step"] == want["checkpoint_step"] == 4
    assert [r["top_k"] for r in got["results"]] == list(TOP_KS)
    for g, w in zip(got["results"], want["results"], strict=True):
        assert set(g) == set(w)
        for key in ("nll", "retained_mass", "contributors", "active_experts", "tokens"):
            assert _close(g[key], w[key]), (g["top_k"], key, g[key], w[key])


def test_the_saved_run_resumes_to_the_weights_it_had(run):
    from moelab.train import train

    final = load_file(RUN / "checkpoints" / "step_00000004" / "model.safetensors")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(
        "".join(r for r in rows if json.loads(r).get("step", 0) <= 2)
    )
    saved = json.loads((run / "config.json").read_text())
    # the same settings as when it was made (its corpus path too: a resume reads data/)
    train(config(Path(saved["data"]), run), resume=True)
    again = load_file(run / "checkpoints" / "step_00000004" / "model.safetensors")
    assert sorted(again) == sorted(final)
    for name, want in final.items():
        if SAME_CPU:
            assert torch.equal(again[name], want), name
        else:
            torch.testing.assert_close(again[name], want, rtol=1e-4, atol=1e-6, msg=name)
