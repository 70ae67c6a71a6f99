"""SIGTERM stops a command as Ctrl-C does, with one line that names it (it ended the
process without a word); --threads beyond the cores this process may use is one line of
warning."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moelab import cli
from moelab.cli import common
from moelab.train.threads import available_cores
from tests.train import make_corpus

# the command's work, replaced by a SIGTERM to itself and a wait the signal must cut short
_SELF_TERM = """
import os, signal, sys, time

def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
    raise SystemExit("SIGTERM did not stop the command")
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_SELF_TERM) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_sigterm_in_a_command_says_so() -> None:
    done = _run(
        """
        import moelab.cli.params as params
        from moelab import cli
        params._params = terminated
        sys.exit(cli.main(["params", "--preset", "tiny"]))
        """
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr  # 143, as the shell has it
    assert done.stderr == "moelab params: interrupted by SIGTERM\n"


def test_sigterm_while_train_prepares_its_data(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus", n_docs=4)
    out = tmp_path / "run"
    done = _run(
        f"""
        import moelab.train.loop as loop
        from moelab import cli
        loop.prepare_data = terminated
        sys.exit(cli.main(["train", "--data", {str(corpus)!r}, "--out", {str(out)!r},
                           "--steps", "2"]))
        """
    )
    assert done.returncode == 143, done.stderr
    assert done.stderr.splitlines()[-1] == "moelab train: interrupted by SIGTERM"
    assert "Traceback" not in done.stderr


def test_sigint_still_says_sigint() -> None:
    done = _run(
        """
        import moelab.cli.params as params
        from moelab import cli

        def interrupted(args):
            raise KeyboardInterrupt

        params._params = interrupted
        sys.exit(cli.main(["params", "--preset", "tiny"]))
        """
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "moelab params: interrupted by SIGINT\n"


def test_sigterm_handler_is_restored(capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["params", "--preset", "tiny"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    capsys.readouterr()


def _sigterm_is_default() -> bool:
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_worker_ends_on_sigterm_at_once() -> None:
    # a library's pool forked inside a command (lm-eval's bootstrap) must not inherit the
    # handler: a Pool.terminate() that came before the worker blocked on its queue only
    # set Python's flag there, and the worker, and the command with it, waited for ever
    with common.sigterm_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_sigterm_is_default)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # not the parent's


def test_more_threads_than_cores_warns(run_folder: Path, capsys: pytest.CaptureFixture) -> None:
    cores = available_cores()
    argv = ["eval", str(run_folder), "--top-k", "1", "--max-batches", "1"]
    assert cli.main([*argv, "--threads", str(cores + 1)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"moelab eval: warning: --threads {cores + 1} is more than the {cores} core(s) this "
        f"process may use; the threads take turns on them, which can make it many times "
        f"slower: give --threads {cores} or less (or leave it out: the free cores)"
    ]
    assert cli.main([*argv, "--threads", str(cores)]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moelab.train import train
    from tests.train import tiny_config

    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)
    out = tmp_path_factory.mktemp("runs") / "run"
    train(tiny_config(corpus, out, steps=2, eval_batches=1))
    return out
