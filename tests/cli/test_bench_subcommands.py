"""``moelab bench TARGET``: each target is a sub-command whose parser holds the flags
of that target only (before, one parser took every flag and refused those of another
target), and ``bench gpu --json`` still parses as DESIGN.md and docs/scale.md give it."""

from __future__ import annotations

import argparse

from moelab import cli

TIMED = {"--threads", "--repeats", "--warmup"}
FLAGS = {
    "maps": {"--rows", "--experts", "--march", "--compile", *TIMED},
    "moe": {"--shapes", *TIMED},
    "selection": {"--rows", "--experts", "--top-k", *TIMED},
    "gpu": {"--device", "--quick", "--steps", "--train-seconds", "--peak-tflops", "--sections"},
    "downstream": {"--run", "--batch-size", *TIMED},
    "hf": {"--hf", "--block", "--batch-size", "--seq-len", *TIMED},
    "torchtitan": {"--shapes", *TIMED},
    "train": {
        "--batch-size", "--preset", "--seq-len", "--run-steps", "--no-compile", "--backend",
        "--profile-steps", *TIMED,
    },
}  # fmt: skip
"""The flags of each target besides -h, --json and --debug (every sub-command has those)."""


def _targets() -> dict[str, argparse.ArgumentParser]:
    bench = cli.build_parser()._subparsers._group_actions[0].choices["bench"]
    (targets,) = [a for a in bench._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(targets.choices)


def test_each_bench_flag_is_only_under_the_targets_that_take_it() -> None:
    targets = _targets()
    assert list(targets) == [
        "maps", "moe", "selection", "train", "gpu", "downstream", "hf", "torchtitan",
    ]  # fmt: skip
    for target, parser in targets.items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert flags == FLAGS[target] | {"-h", "--help", "--json", "--debug"}, target
    every = set().union(*FLAGS.values())
    for flag in every:  # and nowhere else
        takers = {t for t, p in targets.items() if flag in p._option_string_actions}
        assert takers == {t for t, f in FLAGS.items() if flag in f}, flag


def test_the_defaults_are_those_each_target_had() -> None:
    parse = cli.build_parser().parse_args
    maps, sel = parse(["bench", "maps"]), parse(["bench", "selection"])
    assert (maps.rows, maps.experts, maps.threads, maps.repeats, maps.warmup) == (
        65536, [8, 16, 32, 64, 128], 1, 7, 2,
    )  # fmt: skip
    assert (sel.experts, sel.top_k) == ([64], 8)
    gpu = parse(["bench", "gpu", "--json"])
    assert (gpu.target, gpu.json, gpu.device, gpu.quick, gpu.steps) == (
        "gpu",
        True,
        None,
        False,
        300,
    )
    assert (gpu.train_seconds, gpu.peak_tflops) == (90.0, None)
    assert gpu.sections == ["train", "maps", "moe", "compile"]
    down = parse(["bench", "downstream"])
    assert (down.run, down.batch_size) == (None, 16)
    train = parse(["bench", "train"])
    assert (train.preset, train.batch_size, train.seq_len, train.repeats, train.threads) == (
        "tiny", 8, 128, 20, 1,
    )  # fmt: skip
    assert (train.run_steps, train.no_compile, train.backend) == (300, False, "inductor")
    a = parse(["bench", "maps"])
    a.experts.append(3)  # main builds a parser per call: no default list shared
    assert cli.build_parser().parse_args(["bench", "maps"]).experts == [8, 16, 32, 64, 128]


def test_maps_compile_times_the_torch_path_and_refuses_march(capsys, monkeypatch) -> None:
    """``bench maps --compile`` times moelab.bench.maps_compile (compiled against eager,
    with the CPU named; two of its maps here, to keep the compiling short); ``--march``
    with it is one line: it builds kernels that --compile does not time."""
    import json

    from moelab.bench import maps_compile

    kept = {n: maps_compile.IMPLEMENTATIONS[n] for n in ("torch.softmax", "moelab.sparsemax")}
    monkeypatch.setattr(maps_compile, "IMPLEMENTATIONS", kept)

    code = cli.main(["bench", "maps", "--compile", "--rows", "32", "--experts", "4",
                     "--repeats", "1", "--warmup", "0", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["backend"] == "inductor" and out["cpu"]
    assert {r["impl"] for r in out["rows"]} == {"torch.softmax", "moelab.sparsemax"}
    assert cli.main(["bench", "maps", "--compile", "--march", "x86-64-v3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moelab bench: error: --march builds the fused kernels, which --compile does "
                   "not time"]  # fmt: skip
