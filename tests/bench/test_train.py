"""`moelab bench train`: the dense model of equal active parameters, the FLOP/s
figures and the profile's split of a step, checked against independent counts."""

from __future__ import annotations

import json

import pytest

from moelab import cli
from moelab.bench import train as bench
from moelab.model import Transformer, load_preset
from moelab.model.config import param_counts

DIGITS = 4
"""Significant digits of a bench figure (moelab.bench.timing.SIGNIFICANT): each figure is
within half a unit of its 4th digit of the exact value, a relative error of at most
HALF; a relation between k rounded figures and one more holds to (k + 1) * HALF."""
HALF = 0.5 * 10 ** (1 - DIGITS)


@pytest.fixture(scope="module")
def result() -> dict:
    # the eager backend: dynamo captures the blocks without generating code (seconds)
    return bench.run(
        batch=2, seq_len=16, repeats=2, warmup=1, run_steps=2, backend="eager",
        profile_steps=1, matmul_n=64, progress=False,
    )  # fmt: skip


def test_the_dense_equal_has_the_nearest_active_count() -> None:
    config = load_preset("tiny")
    dense = bench.dense_equivalent(config)
    assert dense.moe_layers == "none" and Transformer(dense).moe_layers == []
    target = param_counts(config)["active"]
    # no other d_ff comes nearer: count the parameters of the built dense models
    gap = {
        d: abs(sum(p.numel() for p in Transformer(_dense(config, d)).parameters()) - target)
        for d in range(dense.d_ff - 2, dense.d_ff + 3)
    }
    assert min(gap, key=gap.get) == dense.d_ff
    assert gap[dense.d_ff] < 3 * config.d_model * config.n_layers


def _dense(config, d_ff):
    import dataclasses

    return dataclasses.replace(config, moe_layers="none", d_ff=d_ff)


def test_figures_follow_from_the_timings(result: dict) -> None:
    # every figure is rounded to DIGITS significant digits (relative error <= HALF): a
    # relation between k rounded figures and one more holds to (k + 1) * HALF, on a fast
    # machine or a slow one alike
    m = result["matmul"]
    assert m["gflops"] == pytest.approx(2 * 64**3 / (m["ms"] / 1e3) / 1e9, rel=2.01 * HALF)
    for row in result["models"].values():
        tokens_per_s = 2 * 16 / (row["step_ms"] / 1e3)
        assert row["tokens_per_s"] == pytest.approx(tokens_per_s, rel=2.01 * HALF)
        assert row["gflops"] == pytest.approx(
            row["flops_per_token"] * tokens_per_s / 1e9, rel=2.01 * HALF
        )
        assert row["matmul_fraction"] == pytest.approx(row["gflops"] / m["gflops"], rel=3.01 * HALF)
    moe, dense = result["models"]["moe"], result["models"]["dense"]
    assert (moe["n_experts"], moe["top_k"], dense["n_experts"]) == (8, 2, None)
    assert result["moe_vs_dense"] == pytest.approx(
        moe["tokens_per_s"] / dense["tokens_per_s"], rel=3.01 * HALF
    )


def test_the_profile_splits_the_whole_step(result: dict) -> None:
    p = result["profile"]
    assert p["status"] == "ok", p
    assert list(p["shares"]) == list(bench.PARTS)
    assert sum(p["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    # every part the tiny MoE model has takes time, forward and backward included
    for part in ("attention", "experts", "router", "dispatch", "dense_ff", "output"):
        assert p["ms"][part] > 0, part
    assert p["ms"]["optimizer"] > 0 and p["ms"]["other"] > 0


class _Event:
    """A profiler event as _part_times reads it: name, time, sequence number, parent."""

    def __init__(self, name: str, us: float, seq: int = -1, parent: _Event | None = None):
        self.name, self.sequence_nr, self.cpu_parent = name, seq, parent
        self.time_range = type("Range", (), {"elapsed_us": lambda _self: us})()


def test_backward_nodes_are_timed_with_the_part_that_recorded_them() -> None:
    # a step of 100 us: the experts' forward range (10 us, holding an op that recorded
    # autograd node 7 and a labelled router range of 4 us), the router's op (node 8),
    # the backward of node 7 (20 us) and of node 8 (3 us), the optimizer's op (node 9)
    # and its backward (a node the optimizer never has: left in "other")
    L = bench._LABEL
    step = _Event("moelab.bench:step", 100)
    experts = _Event(L + "experts", 10, parent=step)
    router = _Event(L + "router", 4, parent=experts)
    opt = _Event(L + "optimizer", 5, parent=step)
    events = [
        step, experts, router, opt,
        _Event("aten::mm", 5, 7, experts), _Event("aten::softmax", 2, 8, router),
        _Event("aten::add_", 1, 9, opt),
        _Event(bench._BACKWARD + "MmBackward0", 20, 7, step),
        _Event(bench._BACKWARD + "SoftmaxBackward0", 3, 8, step),
        _Event(bench._BACKWARD + "AddBackward0", 6, 9, step),
    ]  # fmt: skip
    us, total = bench._part_times(events)
    assert total == 100
    assert us["experts"] == 10 - 4 + 20
    assert us["router"] == 4 + 3
    assert us["optimizer"] == 5
    assert us["other"] == 100 - (26 + 7 + 5)
    assert sum(us.values()) == total


def test_the_experts_backward_nodes_are_found_in_a_real_step(monkeypatch) -> None:
    # the same attribution on a profiled training step of the tiny preset: the backward
    # node evaluations of the experts' matrix products are there and are the experts'
    # (no timing is compared: which events exist, not how long they took)
    seen: list = []
    real = bench._part_times
    monkeypatch.setattr(bench, "_part_times", lambda ev: seen.append(list(ev)) or real(ev))
    config = load_preset("tiny")
    trainer = bench._Trainer(config, 0)
    bench._bench_profile(trainer, bench._batches(config, 2, 16), 1)
    (events,) = seen
    parts = bench._backward_parts(events)
    backward = [e for e in events if e.name.startswith(bench._BACKWARD)]
    by_part = {
        p: [e.name for e in backward if parts.get(e.sequence_nr) == p]
        for p in ("experts", "router")
    }
    assert any("Mm" in n or "Bmm" in n or "Addmm" in n for n in by_part["experts"]), by_part
    assert by_part["router"], by_part


def test_compile_section_reports_the_runs(result: dict) -> None:
    c = result["compile"]
    assert c["status"] == "ok", c
    assert c["backend"] == "eager" and c["run_steps"] == 2
    # one graph for the dense blocks and one for the MoE blocks, shared by the blocks
    # of each kind, and no graph break (the dispatch without host read under compile)
    assert (c["graphs"], c["graph_breaks"]) == (2, 0)
    assert c["steady_speedup"] == pytest.approx(
        c["eager_step_ms"] / c["compiled_step_ms"], rel=1e-2
    )


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(
        ["bench", "train", "--json", "--batch-size", "1", "--seq-len", "8", "--repeats", "1",
         "--warmup", "0", "--no-compile", "--profile-steps", "1"]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == bench.VERSION and doc["tokens_per_step"] == 8
    assert doc["compile"] == {"status": "skipped", "reason": "--no-compile"}
    # the command keeps freed memory (as every moelab command), and says so
    from moelab.train.allocator import in_force

    kept = any(n.startswith("freed memory kept") for n in doc["notes"])
    assert kept == in_force()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "999"], "exceeds the preset's max_seq_len 128"),
        (["--run-steps", "0"], "run-steps must be >= 1"),
        (["--preset", "dense-283m"], "has no MoE layer"),
        (["--batch-size", "0"], "batch-size must be >= 1"),
        (["--backend", "nope"], "'nope' is not a torch.compile backend"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys) -> None:
    assert cli.main(["bench", "train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error:") and message in err and err.count("\n") == 1


# --- rounding: significant digits, not decimals -------------------------------------------


def _digits(x: float) -> int:
    """The significant digits ``x`` prints with (its shortest repr)."""
    import decimal

    return len(decimal.Decimal(repr(x)).normalize().as_tuple().digits)


@pytest.mark.parametrize("seconds", [3.440678e-7, 3.440678e-4, 3.440678])
def test_slow_and_fast_figures_keep_their_digits(
    seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a clock that advances `seconds` per call: every timed matmul takes exactly that
    clock = iter(range(10**6))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock) * seconds)
    m = bench._matmul(64, 5)
    exact = 2 * 64**3 / seconds / 1e9  # e.g. 1.5239 GFLOP/s on a slow machine
    assert m["gflops"] == pytest.approx(exact, rel=HALF)
    assert m["ms"] == pytest.approx(1e3 * seconds, rel=HALF)
    assert _digits(m["gflops"]) <= DIGITS and _digits(m["ms"]) <= DIGITS
    # the figures follow from one another to what the rounding allows
    assert m["gflops"] == pytest.approx(2 * 64**3 / (m["ms"] / 1e3) / 1e9, rel=2.01 * HALF)

    config = load_preset("tiny")
    row = bench._model_row(config, 16, 32, [seconds], exact)
    flops = row["flops_per_token"]
    assert row["step_ms"] == pytest.approx(1e3 * seconds, rel=HALF)
    assert row["tokens_per_s"] == pytest.approx(32 / seconds, rel=HALF)
    assert row["gflops"] == pytest.approx(flops * 32 / seconds / 1e9, rel=HALF)
    assert row["matmul_fraction"] == pytest.approx(flops * 32 / seconds / 1e9 / exact, rel=HALF)
    for key in ("step_ms", "tokens_per_s", "gflops", "matmul_fraction"):
        assert _digits(row[key]) <= DIGITS, (key, row[key])
