"""Command-line mistakes that are one line ``moelab <command>: error: ...`` and exit 2:
bad --threads and devices of bench, train and downstream, --top-k values outside a run's
experts (report, bench selection), bench flags of another target; and --help that names
each default once."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from moelab import cli
from moelab.train import train
from tests.train import TINY_MODEL, make_corpus, tiny_config

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)


@pytest.fixture(scope="module")
def run8(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained run with 8 experts per MoE layer."""
    out = tmp_path_factory.mktemp("runs") / "e8"
    train(tiny_config(corpus, out, model=dict(TINY_MODEL, n_experts=8), steps=2, eval_batches=1))
    return out


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The message of the single stderr line ``moelab COMMAND: error: MESSAGE``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    prefix = f"moelab {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) :].strip()


# --- --threads and devices --------------------------------------------------------------


@pytest.mark.parametrize("threads", ["0", "-1"])
@pytest.mark.parametrize("target", ["maps", "moe", "selection"])
def test_bench_threads_below_one(
    target: str, threads: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", target, "--threads", threads]) == 2
    message = one_line_error(capsys, "bench")
    assert f"--threads must be >= 1, got {threads}" in message


@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x"])
def test_bench_gpu_unknown_device(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "gpu", "--device", device, "--quick"]) == 2
    message = one_line_error(capsys, "bench")
    assert f"--device {device}" in message and "cuda" in message and "cpu" in message


@NO_CUDA
def test_train_device_cuda_without_cuda(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--steps", "1", "--out", str(out), "--data", str(corpus)]
    assert cli.main([*argv, "--set", "device=cuda"]) == 2
    message = one_line_error(capsys, "train")
    assert "device=cuda" in message and "use device=cpu" in message
    assert not out.exists()


@NO_CUDA
def test_downstream_device_cuda_without_cuda(
    run8: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["downstream", str(run8), "--tasks", "moelab_cloze", "--limit", "2"]
    assert cli.main([*argv, "--device", "cuda"]) == 2
    message = one_line_error(capsys, "downstream")
    assert "--device cuda" in message and "--device cpu" in message
    assert not (run8 / "downstream.json").exists()


def test_downstream_unknown_device(run8: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["downstream", str(run8), "--tasks", "moelab_cloze", "--limit", "2"]
    assert cli.main([*argv, "--device", "tpu"]) == 2
    message = one_line_error(capsys, "downstream")
    assert "--device tpu is not a torch device" in message


# --- --top-k against the experts --------------------------------------------------------


@pytest.mark.parametrize(
    ("ks", "bad"), [(["0"], "[0]"), (["16"], "[16]"), (["-3", "2"], "[-3]"), (["9", "8"], "[9]")]
)
def test_report_top_k_outside_the_experts(
    run8: Path, tmp_path: Path, ks: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rep"
    argv = ["report", str(run8), "--out", str(out), "--max-batches", "1", "--top-k", *ks]
    assert cli.main(argv) == 2
    message = one_line_error(capsys, "report")
    assert f"--top-k values {bad} are outside [1, 8]" in message
    assert "8 experts per MoE layer" in message
    assert not out.exists()  # refused before anything is computed


def test_bench_selection_top_k_above_the_experts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "selection", "--top-k", "9", "--experts", "8", "16", "--rows", "8"]
    assert cli.main([*argv, "--repeats", "1", "--warmup", "0"]) == 2
    message = one_line_error(capsys, "bench")
    assert "top_k=9" in message and "E=8" in message


# --- bench flags of another target ------------------------------------------------------

SMALL = ["--repeats", "1", "--warmup", "0"]


def unrecognized(capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's one error line ``moelab: error: unrecognized arguments: ...`` (after
    the usage), its message also the {"error": ...} of --json."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    prefix = "moelab: error: unrecognized arguments: "
    assert lines[0].startswith(prefix), err
    return lines[0][len(prefix) :]


@pytest.mark.parametrize(
    ("argv", "flag", "targets"),
    [
        (["gpu", "--quick", "--sections", "maps", "--rows", "64"], "--rows", "maps, selection"),
        (["gpu", "--quick", "--sections", "maps", "--threads", "1"], "--threads", "maps, moe, "),
        (["maps", "--rows", "8", "--experts", "8", *SMALL, "--top-k", "2"], "--top-k", "selection"),
        (["maps", "--rows", "8", "--experts", "8", *SMALL, "--quick"], "--quick", "gpu"),
        (["maps", "--rows", "8", "--experts", "8", *SMALL, "--device", "cpu"], "--device", "gpu"),
        (["moe", "--shapes", "8,4,4,2,1", *SMALL, "--experts", "8"], "--experts", "maps, selec"),
        (["selection", "--rows", "8", "--experts", "8", *SMALL, "--shapes", "8,4,4,2,1"],
         "--shapes", "moe"),
        (["downstream", "--run", "x", "--rows", "8"], "--rows", "maps, selection"),
        (["maps", "--rows", "8", "--experts", "8", *SMALL, "--batch-size", "4"], "--batch-size",
         "downstream"),
    ],
)  # fmt: skip
def test_bench_refuses_flags_of_another_target(
    argv: list[str], flag: str, targets: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # each target is a sub-command holding only its own flags (bench TARGETS --help):
    # another target's flag is argparse's unrecognized argument, exit 2
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *argv])
    assert stop.value.code == 2
    assert unrecognized(capsys).startswith(flag)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *argv, "--json"])
    assert stop.value.code == 2
    assert flag in unrecognized(capsys).split()


def test_bench_names_every_foreign_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "moe", "--rows", "8", "--quick", "--top-k", "2"])
    assert stop.value.code == 2
    message = unrecognized(capsys)
    for flag in ("--rows", "--quick", "--top-k"):
        assert flag in message


# --- --help: each default once ----------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def _option_entries(help_text: str) -> list[str]:
    """Each argument's entry of a --help text: its first line (two spaces, then the
    name) and the more indented lines that continue it, joined."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):
            entries.append(line.strip())
        elif re.match(r"^   +\S", line) and entries:
            entries[-1] += " " + line.strip()
        else:
            entries.append("")
    return [e for e in entries if e]


def test_help_names_each_default_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per entry: no "(default:" split
    parsers = _parsers(cli.build_parser())
    assert {p.prog for p in parsers} >= {"moelab bench gpu", "moelab train", "moelab data prepare"}
    checked = 0
    for parser in parsers:
        for entry in _option_entries(parser.format_help()):
            assert entry.count("(default:") <= 1, (parser.prog, entry)
            assert "(default: None)" not in entry, (parser.prog, entry)
            checked += 1
    assert checked > 100


def test_help_still_shows_the_defaults_it_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")
    entries = {p.prog: _option_entries(p.format_help()) for p in _parsers(cli.build_parser())}

    def entry(prog: str, option: str) -> str:
        (found,) = [e for e in entries[prog] if e.startswith(option + " ")]
        return found

    assert entry("moelab bench maps", "--repeats").endswith("(default: 7)")
    assert entry("moelab bench gpu", "--steps").endswith("(default: 300)")
    assert entry("moelab study", "--data").endswith("(default: the Python docs)")
    assert entry("moelab report", "--top-k").count("(default:") == 1
