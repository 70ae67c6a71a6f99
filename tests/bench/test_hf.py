"""`moelab bench hf`: the forward of a Hugging Face MoE model with and without the
hooks of `moelab stats --hf`; the figures follow from the timings and the hooks counted
every token they were timed on."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from moelab import cli
from moelab.bench import hf as bench
from moelab.integrations.hf.families import moe_routers
from tests.integrations import save_tiny


def test_the_default_model_is_a_tiny_mixtral() -> None:
    model = bench.tiny_mixtral()
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_local_experts) == ("mixtral", 2, 8)
    assert (cfg.num_experts_per_tok, cfg.hidden_size) == (2, 64)
    assert len(moe_routers(model)) == 2 and not model.training
    # seeded: the same weights each time
    other = bench.tiny_mixtral()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(),
                                                 strict=True))  # fmt: skip


def test_figures_follow_from_the_timings() -> None:
    r = bench.run(batch=2, seq_len=16, repeats=3, warmup=1, block=2, progress=False)
    assert (r["model_type"], r["moe_layers"], r["repeats"], r["threads"]) == ("mixtral", 2, 3, 1)
    ms = r["ms"]
    assert r["overhead"] == pytest.approx(ms["hooked"] / ms["plain"])
    for k in ("plain", "hooked"):
        assert r["tokens_per_s"][k] == pytest.approx(32 / (ms[k] / 1e3))
    assert r["us_per_token_layer"] == pytest.approx(1e3 * (ms["hooked"] - ms["plain"]) / (32 * 2))


def test_statistics_that_missed_tokens_are_refused(monkeypatch) -> None:
    from moelab.diagnostics.accumulators import RoutingStats

    real = RoutingStats.update
    calls = []

    def every_other(self, out):  # as if a hook missed some of its calls
        calls.append(1)
        return real(self, out) if len(calls) % 2 else self

    monkeypatch.setattr(RoutingStats, "update", every_other)
    with pytest.raises(RuntimeError, match="the statistics counted"):
        bench.run(batch=1, seq_len=8, repeats=2, warmup=0, block=1, progress=False)


def test_a_saved_folder_through_the_cli(tmp_path, capsys) -> None:
    path = save_tiny("qwen3_moe", tmp_path / "m")
    argv = ["bench", "hf", "--hf", str(path), "--json", "--batch-size", "1", "--seq-len",
            "8", "--repeats", "1", "--warmup", "0", "--block", "2"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == str(path) and doc["model_type"] == "qwen3_moe"
    assert doc["moe_layers"] == 2 and doc["batch"] == 1 and doc["seq_len"] == 8
    assert doc["block"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "5000"], "exceeds the model's max_position_embeddings 1024"),
        (["--batch-size", "0"], "--batch-size >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--block", "0"], "--block >= 1"),
        (["--hf", "/nonexistent/folder"], "/nonexistent/folder"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys) -> None:
    assert cli.main(["bench", "hf", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error:") and message in err and err.count("\n") == 1


def test_library_call_refuses_no_rounds() -> None:
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.run(batch=1, seq_len=8, repeats=0, block=1, progress=False)
