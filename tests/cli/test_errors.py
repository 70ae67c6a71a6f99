"""The command line's errors: a user's mistake is one line ``moelab <command>: error: ...``
on stderr and exit code 2 (with --json also ``{"error": ...}`` on stdout); a bug keeps
its traceback; ``--debug`` shows the traceback of user errors too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moelab import cli
from tests.train import make_corpus


def strict_json(text: str) -> object:
    """json.loads that refuses NaN and +-Infinity, as RFC 8259 parsers do."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _train_argv(corpus: Path, out: Path, *sets: str) -> list[str]:
    argv = ["train", "--steps", "1", "--out", str(out), "--data", str(corpus)]
    for item in ("n_layers=2", "d_model=32", "n_heads=2", "n_kv_heads=1", "d_ff=64", *sets):
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("router.renorm=maybe", "router.renorm takes a bool"),
        ("steps=2.5", "steps takes an int; got '2.5'"),
        ("router.top_k=two", "router.top_k takes an int"),
        ("nosuch=1", "unknown config key 'nosuch'"),
    ],
)
def test_bad_set_fails_before_the_run_folder_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], item: str, match: str
) -> None:
    corpus = make_corpus(tmp_path / "corpus", n_docs=10)
    out = tmp_path / "run"
    assert cli.main(_train_argv(corpus, out, item)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("moelab train: error: ") and match in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert not out.exists()


@pytest.mark.parametrize(("data", "match"), [("", "empty string"), ("nope", "does not exist")])
def test_bad_data_fails_before_the_run_folder_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: str, match: str
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--steps", "1", "--out", str(out), "--data", data, "--json"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert match in captured.err and match in strict_json(captured.out)["error"]
    assert not out.exists()


def test_json_error_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["stats", str(missing), "--json"]) == 2
    captured = capsys.readouterr()
    message = f"{missing} is not a moelab run folder: it does not exist"
    assert strict_json(captured.out) == {"error": message}
    assert captured.err == f"moelab stats: error: {message}\n"


def test_usage_errors_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["params", "--preset", "no-such-model", "--json"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "invalid choice" in strict_json(captured.out)["error"]
    assert "moelab params: error: argument --preset" in captured.err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path: Path, where: str) -> None:
    argv = ["stats", str(tmp_path / "missing")]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cli.main(argv)


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise RuntimeError("an internal error")

    monkeypatch.setattr("moelab.cli.params._params", broken)  # the handler of moelab params
    with pytest.raises(RuntimeError, match="an internal error"):
        cli.main(["params", "--preset", "tiny"])


def test_python_dash_m_moelab(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    proc = subprocess.run(
        [sys.executable, "-m", "moelab", "eval", str(missing), "--top-k", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    message = f"{missing} is not a moelab run folder: it does not exist"
    assert proc.stderr == f"moelab eval: error: {message}\n"
    assert strict_json(proc.stdout) == {"error": message}


def test_a_closed_pipe_stops_quietly() -> None:
    """`moelab ... --json | head`: the reader goes away before the command prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moelab", "params", "--preset", "tiny", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even imported torch
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert stderr == ""


@pytest.mark.parametrize("shape", ["0,1,1,1,1", "8,4,4,2,3", "8,4,4,2"])
def test_bench_moe_refuses_bad_shapes(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "moe", "--shapes", shape])
    assert info.value.code == 2
    assert "moelab bench moe: error: argument --shapes" in capsys.readouterr().err
