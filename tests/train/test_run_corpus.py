"""A run folder is read back only with the data it trained on (issue 39, item 5): with
another run's ``data/`` or ``tokenizer.json`` in its place, ``eval``, ``--resume``,
``export`` and ``report`` refuse in one line that names the file, what config.json
recorded and what was found (the digests computed here with hashlib from the files
themselves), and a way out that keeps the checkpoints; the way out works; a report of
runs of two corpora says so. Runs from before the record are checked as far as they
can be."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.diagnostics import evaluate, load_run
from moelab.runs import CorpusMismatch, check_corpus
from moelab.train import latest_checkpoint, train
from tests.train import make_corpus, tiny_config


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny runs of two corpora (``a``, ``b``), and ``a2``: a second run of ``a``'s
    corpus with another seed but the same split (data_seed)."""
    root = tmp_path_factory.mktemp("corpora")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        corpus = make_corpus(root / f"corpus_{name}", n_docs=24, seed=seed)
        out[f"corpus_{name}"] = corpus
        out[name] = root / name
        train(tiny_config(corpus, out[name], steps=4, checkpoint_every=2, data_seed=0))
    out["a2"] = root / "a2"
    train(tiny_config(out["corpus_a"], out["a2"], steps=2, seed=5, data_seed=0))
    return out


def _copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(run, tmp_path / name))


def _swap_data(run: Path, other: Path) -> None:
    shutil.rmtree(run / "data")
    shutil.copytree(other / "data", run / "data")


def _one_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"moelab {command}: error: ")]
    assert len(errors) == 1 and "Traceback" not in "".join(lines), lines
    assert "--overwrite" not in errors[0]  # it would delete the run's checkpoints
    return errors[0]


# ------------------------------------------------------------------- another data/


def test_eval_refuses_another_runs_data(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs["a"], tmp_path)
    _swap_data(run, runs["b"])
    capsys.readouterr()
    assert main(["eval", str(run), "--top-k", "2", "--threads", "1"]) == 2
    err = _one_error(capsys, "eval")
    assert str(run / "data" / "val.bin") in err
    # what was found (b's validation split) and what the run recorded (a's), by hashlib
    assert _sha(runs["b"] / "data" / "val.bin")[:16] in err
    assert _sha(runs["a"] / "data" / "val.bin")[:16] in err
    assert "resume" in err and "checkpoints are kept" in err
    with pytest.raises(CorpusMismatch):
        evaluate(run, [2], max_batches=1)  # the library too, not only the command


def test_resume_refuses_another_runs_data_and_keeps_the_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run = _copy(runs["a"], tmp_path)
    _swap_data(run, runs["b"])
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CorpusMismatch) as err:
        train(tiny_config(runs["corpus_a"], run, steps=6, checkpoint_every=2, data_seed=0),
              resume=True)  # fmt: skip
    assert str(run / "data" / "train.bin") in str(err.value)
    assert _sha(runs["b"] / "data" / "train.bin")[:16] in str(err.value)
    assert latest_checkpoint(run) == run / "checkpoints" / "step_00000004"
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing lost


def test_the_advised_way_out_prepares_the_runs_own_data_again(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The message's way out: move tokenizer.json and data/ out of the folder and
    resume with the run's settings, which prepares them again; the run then reads as
    the untouched one."""
    run = _copy(runs["a"], tmp_path)
    _swap_data(run, runs["b"])
    shutil.move(run / "data", tmp_path / "data.other")
    shutil.move(run / "tokenizer.json", tmp_path / "tokenizer.other.json")
    train(tiny_config(runs["corpus_a"], run, steps=4, checkpoint_every=2, data_seed=0),
          resume=True)  # fmt: skip
    for name in ("tokenizer.json", "data/train.bin", "data/val.bin"):
        assert _sha(run / name) == _sha(runs["a"] / name), name
    assert (
        evaluate(run, [2], max_batches=2)["results"]
        == evaluate(runs["a"], [2], max_batches=2)["results"]
    )


# ------------------------------------------------------------- another tokenizer.json


def test_another_tokenizer_is_refused_where_it_is_used(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs["a"], tmp_path)
    shutil.copy(runs["b"] / "tokenizer.json", run / "tokenizer.json")
    found, want = _sha(runs["b"] / "tokenizer.json"), _sha(runs["a"] / "tokenizer.json")
    assert found != want
    # a second corpus is tokenised with it: refused
    capsys.readouterr()
    args = ["eval", str(run), "--top-k", "2", "--threads", "1", "--max-batches", "1"]
    assert main([*args, "--data", str(runs["corpus_a"])]) == 2
    err = _one_error(capsys, "eval")
    assert str(run / "tokenizer.json") in err and found[:16] in err and want[:16] in err
    # the run's own validation split needs no tokenizer: the untouched run's NLL, and a
    # warning that names the file
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr()
    nll = json.loads(out.out)["results"][0]["nll"]
    assert nll == evaluate(runs["a"], [2], max_batches=1)["results"][0]["nll"]
    assert "warning" in out.err and str(run / "tokenizer.json") in out.err


def test_resume_refuses_another_tokenizer(runs: dict[str, Path], tmp_path: Path) -> None:
    run = _copy(runs["a"], tmp_path)
    shutil.copy(runs["b"] / "tokenizer.json", run / "tokenizer.json")
    with pytest.raises(CorpusMismatch, match=r"tokenizer\.json is not the tokenizer"):
        train(tiny_config(runs["corpus_a"], run, steps=6, checkpoint_every=2, data_seed=0),
              resume=True)  # fmt: skip
    assert latest_checkpoint(run) == run / "checkpoints" / "step_00000004"


def test_export_refuses_another_tokenizer(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    run = _copy(runs["a"], tmp_path)
    shutil.copy(runs["b"] / "tokenizer.json", run / "tokenizer.json")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = _one_error(capsys, "export")
    assert str(run / "tokenizer.json") in err
    assert _sha(runs["b"] / "tokenizer.json")[:16] in err
    assert not (tmp_path / "hf").exists()  # nothing shipped


# ------------------------------------------------------------------------- report


def test_report_refuses_a_run_with_another_runs_data_before_computing(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs["a"], tmp_path)
    _swap_data(run, runs["b"])
    capsys.readouterr()
    args = ["report", str(runs["b"]), str(run), "--out", str(tmp_path / "rep")]
    assert main([*args, "--threads", "1", "--max-batches", "1"]) == 2
    err = _one_error(capsys, "report")
    assert str(run / "data" / "val.bin") in err and "nothing was computed" in err


def test_report_of_two_corpora_names_the_runs_of_each(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    from moelab.report import build_report

    ids = {}
    for name in ("a", "a2", "b"):
        saved = json.loads((runs[name] / "config.json").read_text())
        ids[name] = saved["run_info"]["corpus"]["id"]
    assert ids["a"] == ids["a2"] != ids["b"]
    doc = build_report(
        [runs["a"], runs["a2"], runs["b"]], tmp_path / "mixed", top_ks=(2,), max_batches=1
    )
    md = Path(doc["report"]).read_text(encoding="utf-8")
    note = next(line for line in md.splitlines() if "different corpora" in line)
    assert f"corpus `{ids['a']}`: `a`, `a2`" in note and f"corpus `{ids['b']}`: `b`" in note
    assert doc["corpora"] == ids
    # one corpus: no note
    doc = build_report([runs["a"], runs["a2"]], tmp_path / "one", top_ks=(2,), max_batches=1)
    assert "different corpora" not in Path(doc["report"]).read_text(encoding="utf-8")


# -------------------------------------------------------- runs from before the record


def test_a_run_recorded_with_one_digest_is_checked_as_a_whole(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """config.json of a moelab that kept only the id over the three files: another
    data/ is still refused (the token counts name the split), and a resume that finds
    the run's own data records each file's digest."""
    run = _copy(runs["a"], tmp_path)
    path = run / "config.json"
    saved = json.loads(path.read_text())
    del saved["run_info"]["corpus"]["sha256"]
    path.write_text(json.dumps(saved))
    assert check_corpus(run) is True
    _swap_data(run, runs["b"])
    with pytest.raises(CorpusMismatch, match=r"data/train\.bin is not the training split"):
        load_run(run)
    shutil.rmtree(run / "data")
    shutil.copytree(runs["a"] / "data", run / "data")
    train(tiny_config(runs["corpus_a"], run, steps=4, checkpoint_every=2, data_seed=0),
          resume=True)  # fmt: skip
    digests = json.loads(path.read_text())["run_info"]["corpus"]["sha256"]
    assert digests == {
        "tokenizer.json": _sha(runs["a"] / "tokenizer.json"),
        "train.bin": _sha(runs["a"] / "data" / "train.bin"),
        "val.bin": _sha(runs["a"] / "data" / "val.bin"),
    }


def test_a_run_without_a_record_says_what_it_cannot_check(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs["a"], tmp_path)
    path = run / "config.json"
    saved = json.loads(path.read_text())
    del saved["run_info"]["corpus"]
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert check_corpus(run) is False
    assert "no record of the data the run trained on" in capsys.readouterr().err
    # the shards are still checked against the tokenizer and the model
    assert (
        evaluate(run, [2], max_batches=1)["results"]
        == evaluate(runs["a"], [2], max_batches=1)["results"]
    )
