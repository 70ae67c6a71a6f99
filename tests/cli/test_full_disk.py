"""A full disk (or a file-size limit) while a command writes: one line ``moelab
<command>: error: FILE: ...`` naming the file, exit code 2, no traceback, and no partial
output left as if it were complete. Files get the usual mode under the umask (0644),
not the 0600 of a private temporary.

The full disk is simulated three ways: stdout sent to /dev/full (every write fails with
ENOSPC), ``moelab._io.write_file`` replaced (the documented hook), and a file-size limit
(RLIMIT_FSIZE: a write past it fails with EFBIG, whatever library writes the file)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab import _io, cli
from moelab.train import train
from tests.train import make_corpus, tiny_config

FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "run"
    train(tiny_config(corpus, out, steps=2, eval_batches=1))
    return out


def one_line_error(err: str, command: str) -> str:
    """The message of the single stderr line ``moelab COMMAND: error: MESSAGE``."""
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    prefix = f"moelab {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) :].strip()


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Within ``with``: no file of this process grows past ``nbytes`` (a write past it
    fails with EFBIG, as a full disk fails with ENOSPC)."""
    resource = pytest.importorskip("resource")
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def usual_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` (hidden ones too) and its bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# --- stdout -------------------------------------------------------------------------------


def _to_dev_full(argv: list[str]) -> subprocess.CompletedProcess[str]:
    with FULL.open("w") as out:
        return subprocess.run(
            [sys.executable, "-m", "moelab", *argv],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )


@needs_dev_full
@pytest.mark.parametrize("as_json", [True, False])
def test_stdout_on_a_full_disk(as_json: bool) -> None:
    done = _to_dev_full(["params", "--preset", "tiny", *(["--json"] if as_json else [])])
    message = one_line_error(done.stderr, "params")
    assert message == "standard output: No space left on device"
    assert done.returncode == 2


@needs_dev_full
def test_eval_json_on_a_full_disk(run: Path) -> None:
    done = _to_dev_full(["eval", str(run), "--top-k", "1", "--max-batches", "1", "--json"])
    assert one_line_error(done.stderr, "eval") == "standard output: No space left on device"
    assert done.returncode == 2


# --- export -------------------------------------------------------------------------------


def test_export_on_a_full_disk(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "exported"
    # model.safetensors (about 230 kB; safetensors raises its own SafetensorError) does
    # not fit, the JSON files do
    with file_size_limit(64_000):
        code = cli.main(["export", str(run), "--out", str(out), "--format", "remote"])
    message = one_line_error(capsys.readouterr().err, "export")
    assert message == f"{out / 'model.safetensors'}: {os.strerror(errno.EFBIG)}"
    assert code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no staging folder


def test_exported_files_have_the_usual_mode(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "exported"
    assert cli.main(["export", str(run), "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes
    assert modes == dict.fromkeys(modes, usual_mode()), modes


# --- analyze ------------------------------------------------------------------------------


def _analyze(run: Path, out: Path, batches: int = 1) -> int:
    argv = ["analyze", "coactivation", str(run), "--out", str(out), "--min-count", "1"]
    return cli.main([*argv, "--max-batches", str(batches)])


def _failing_write(suffix: str):
    """A write_file that fails like a full disk for the file whose name holds
    ``suffix`` (its temporary: ``.NAME.tmpPID``)."""
    write = _io.write_file

    def full(f, data):
        if suffix in Path(f.name).name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(f, data)

    return full


@pytest.mark.parametrize("fails", ["coactivation.md", "coactivation.json"])
def test_analyze_on_a_full_disk_leaves_the_earlier_set(
    fails: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "an"
    # a whole set, then another one (of other batches: other figures) fails half way
    assert _analyze(run, out, batches=2) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert {"coactivation.json", "coactivation.md", "coactivation.png"} <= set(before)
    monkeypatch.setattr(_io, "write_file", _failing_write(fails))
    assert _analyze(run, out, batches=1) == 2
    message = one_line_error(capsys.readouterr().err, "analyze")
    assert message == f"{out / fails}: No space left on device"
    assert snapshot(out) == before  # the earlier set, whole; no staging folder


def test_analyze_on_a_full_disk_leaves_no_partial_set(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "an"
    monkeypatch.setattr(_io, "write_file", _failing_write("coactivation.json"))
    assert _analyze(run, out) == 2
    one_line_error(capsys.readouterr().err, "analyze")
    # nothing of the set: neither the figure nor the Markdown without their JSON
    assert [n for n in snapshot(out) if not n.startswith(".moelab-analyze")] == []


def test_analyze_figure_on_a_full_disk(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "an"
    out.mkdir()
    with file_size_limit(2_000):  # the marker fits, the figure does not
        code = _analyze(run, out)
    message = one_line_error(capsys.readouterr().err, "analyze")
    assert message == f"{out / 'coactivation.png'}: {os.strerror(errno.EFBIG)}"
    assert code == 2
    assert [n for n in snapshot(out) if not n.startswith(".moelab-analyze")] == []


def test_analysis_files_have_the_usual_mode(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "an"
    assert _analyze(run, out) == 0
    capsys.readouterr()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "coactivation.png" in modes
    assert modes == dict.fromkeys(modes, usual_mode()), modes


# --- report and prepare name the file -----------------------------------------------------


def test_report_on_a_full_disk_names_the_file(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "rep"
    with file_size_limit(4_000):  # the marker fits, a figure does not
        code = cli.main(["report", str(run), "--out", str(out), "--max-batches", "1"])
    message = one_line_error(capsys.readouterr().err, "report")
    assert code == 2
    where, _, why = message.partition(": ")
    assert why == os.strerror(errno.EFBIG)
    # a file of the report's folder (not of its staging folder, which is gone)
    assert Path(where).parent == out and Path(where).suffix == ".png", message
    assert [p.name for p in out.iterdir()] == [".moelab-report.json"]


def test_prepare_on_a_full_disk_names_the_file(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "prep"
    argv = ["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300"]
    with file_size_limit(4_000):  # the training shard does not fit
        code = cli.main([*argv, "--json"])  # --json: no progress bar on stderr
    captured = capsys.readouterr()
    message = one_line_error(captured.err, "data")
    assert message == f"{out / 'train.bin'}: {os.strerror(errno.EFBIG)}"
    assert json.loads(captured.out) == {"error": message}
    assert code == 2
    assert not (out / "prepare.json").exists()  # no folder that reads as prepared
