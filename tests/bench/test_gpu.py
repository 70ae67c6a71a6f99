"""`moelab bench gpu`: the one-GPU check runs on the CPU in test mode (--device cpu
--quick), prints one JSON document with every documented key (docs/scale.md), and
reports a failing section in the JSON instead of dying."""

from __future__ import annotations

import json

import pytest
import torch

from moelab import cli
from moelab.bench import gpu

# the keys docs/scale.md documents, section by section
TOP = {"version", "quick", "device", "seconds", "env", "train", "maps", "moe", "compile"}
ENV = {
    "torch",
    "python",
    "platform",
    "cuda",
    "device_name",
    "capability",
    "bf16",
    "grouped_mm",
    "compile",
}
TRAIN = {
    "status",
    "seconds",
    "preset",
    "steps",
    "batch",
    "seq_len",
    "tokens_per_step",
    "dtype",
    "expert_impl",
    "step_ms",
    "tokens_per_s",
    "n_active",
    "flops_per_token",
    "flops_formula",
    "peak_tflops",
    "mfu",
    "peak_memory_bytes",
    "loss_first",
    "loss_last",
}
MAPS = {"status", "seconds", "rows", "max_abs_err", "max_abs_grad_err", "tolerance", "ok"}
MOE = {"status", "seconds", "dtype", "rows", "summary", "notes"}
COMPILE = {"status", "seconds", "backend", "rows"}


def test_quick_cpu_run_has_every_documented_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "gpu", "--device", "cpu", "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "[bench gpu] train" in captured.err  # progress on stderr, JSON alone on stdout
    assert TOP <= set(out) and out["device"] == "cpu" and out["quick"] is True
    assert ENV <= set(out["env"]) and out["env"]["torch"] == torch.__version__
    for name, keys in (("train", TRAIN), ("maps", MAPS), ("moe", MOE), ("compile", COMPILE)):
        assert out[name]["status"] == "ok", (name, out[name])
        assert keys <= set(out[name]), (name, keys - set(out[name]))
    train = out["train"]
    # CUDA-only measurements are skipped with a reason
    assert train["peak_memory_bytes"] is None and "CUDA" in train["peak_memory_note"]
    assert train["mfu"] is None and "--peak-tflops" in train["mfu_note"]
    assert train["tokens_per_s"] > 0 and train["steps"] == 3
    # the FLOPs formula, by hand for tiny: N = active - V D, 6 N + 12 L S D
    assert train["n_active"] == 1_313_920 - 2048 * 128
    assert train["flops_per_token"] == 6 * train["n_active"] + 12 * 4 * 32 * 128
    # every registered map is checked, in float32 to the tolerance
    assert {r["map"] for r in out["maps"]["rows"]} >= {
        "softmax",
        "sigmoid",
        "relu",
        "sparsemax",
        "entmax",
        "normmax",
        "lapsum",
    }
    assert out["maps"]["ok"] is True and out["maps"]["max_abs_err"] < 1e-5
    impls = {r["impl"] for r in out["moe"]["rows"]}
    assert {"moelab.MoE", "dense-bound"} <= impls
    if hasattr(torch, "_grouped_mm"):
        assert "moelab.MoE (grouped)" in impls
        assert out["moe"]["summary"][0]["grouped_speedup"] > 0
    assert {r["target"] for r in out["compile"]["rows"]} == {"block (dense)", "router"}
    assert all(r["max_abs_diff"] < 1e-5 for r in out["compile"]["rows"])


def test_failing_section_is_reported_not_fatal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(device: torch.device, quick: bool) -> dict:
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(gpu, "bench_maps", broken)
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--sections", "maps", "moe", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["maps"]["status"] == "error" and "no kernel image" in out["maps"]["error"]
    assert out["moe"]["status"] == "ok"
    for name in ("train", "compile"):
        assert out[name]["status"] == "skipped" and out[name]["reason"]
    assert "maps: error" in gpu.format_report(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_gpu_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "gpu", "--device", "cuda", "--json"]) == 2
    assert "--device cpu --quick" in json.loads(capsys.readouterr().out)["error"]
