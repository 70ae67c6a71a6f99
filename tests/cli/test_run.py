"""The command line on a trained run: strict JSON from every command, what eval and stats
cover (checkpoint step, batches), the report's up-front check of its runs, corrupted
checkpoints as user errors, and what training's val loss covers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from moelab import cli
from moelab.data import TokenShard, batches
from moelab.diagnostics import evaluate
from moelab.train import train
from tests.cli.test_errors import strict_json
from tests.train import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sparsemax run of 6 steps with checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("runs") / "run"
    train(tiny_config(corpus, out, map="sparsemax", steps=6, checkpoint_every=3, log_every=3))
    return out


def _latest_step(run: Path) -> int:
    """The step of the newest checkpoint, read from the folder name checkpoints/latest
    points to (step_NNNNNNNN)."""
    name = (run / "checkpoints" / "latest").read_text().strip()
    return int(name.removeprefix("step_"))


def _val_batches(run: Path) -> int:
    """Batches of one ordered pass over the validation split, counted by iterating."""
    cfg = json.loads((run / "config.json").read_text())
    val = TokenShard.open(run / "data" / "val.bin")
    return sum(1 for _ in batches(val, cfg["batch_size"], cfg["seq_len"], shuffle=False, epochs=1))


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    assert cli.main([*argv, "--json"]) == 0
    return strict_json(capsys.readouterr().out)


def test_to_json_has_no_nan_or_infinity() -> None:
    np = pytest.importorskip("numpy")
    doc = {
        "nan": float("nan"),
        "inf": [float("-inf"), float("inf"), 1.5],
        "numpy": np.array([1.0, np.inf], dtype=np.float32),
        "scalar": np.float32(0.25),
        "int": np.int64(3),
        "tuple": (1, float("nan")),
        "path": Path("a/b"),
    }
    assert strict_json(cli.to_json(doc)) == {
        "nan": None,
        "inf": [None, None, 1.5],
        "numpy": [1.0, None],
        "scalar": 0.25,
        "int": 3,
        "tuple": [1, None],
        "path": "a/b",
    }


def test_every_command_prints_strict_json(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the maps tour holds -inf scores: they must come out as null, not -Infinity
    tour = _json(capsys, ["demo", "--maps", "--rows", "500"])
    assert any(None in v["scores"] for v in tour["vectors"])
    assert _json(capsys, ["params", "--preset", "tiny"])["preset"] == "tiny"
    bench = ["bench", "maps", "--rows", "64", "--experts", "8", "--repeats", "1", "--warmup", "0"]
    assert _json(capsys, bench)["rows"]
    assert _json(capsys, ["eval", str(run), "--top-k", "1", "2", "--max-batches", "1"])
    assert _json(capsys, ["stats", str(run), "--max-batches", "1"])["layers"]
    report = ["report", str(run), "--out", str(tmp_path / "rep"), "--top-k", "1", "2"]
    assert _json(capsys, [*report, "--max-batches", "1"])["report"]

    # the training demo (the sparse-maps study): a stand-in result with a NaN (as a
    # diverged run would give)
    import moelab.studies

    def fake_study(name: str, out: str, **kw: Any) -> dict[str, Any]:
        assert name == "sparse-maps" and kw["scale"] == "cpu"
        main = {
            "key": "main",
            "title": "t",
            "columns": [{"header": "val loss", "key": "loss", "spec": ".4f"}],
            "rows": [{"arm": "a", "loss": {"mean": float("nan"), "sd": None, "n": 0}}],
        }
        return {
            "report": "r.md",
            "figures": [],
            "arms": [{"name": "a", "label": "a", "runs": ["runs/a/seed0"]}],
            "tables": [main],
            "seconds": 1.0,
        }

    monkeypatch.setattr(moelab.studies, "run_study", fake_study)
    doc = _json(capsys, ["demo", "--out", str(tmp_path / "demo")])
    assert doc["rows"] == [{"label": "a", "loss": None}]
    assert doc["runs"] == ["runs/a/seed0"] and doc["report"] == "r.md"


def test_eval_and_stats_say_what_they_cover(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step, total = _latest_step(run), _val_batches(run)
    assert step == 6 and total >= 2
    doc = _json(capsys, ["eval", str(run), "--top-k", "2", "--max-batches", "1"])
    assert doc["checkpoint_step"] == step and doc["batches_total"] == total
    assert doc["results"][0]["batches"] == 1
    assert cli.main(["eval", str(run), "--top-k", "2", "--max-batches", "1"]) == 0
    text = capsys.readouterr().out
    assert f"checkpoint step {step}" in text
    assert f"(1 of {total} batches; --max-batches all for every batch)" in text
    assert cli.main(["eval", str(run), "--top-k", "2", "--max-batches", "all"]) == 0
    assert f"(all {total} batches)" in capsys.readouterr().out

    doc = _json(capsys, ["stats", str(run), "--max-batches", "all"])
    assert doc["checkpoint_step"] == step
    assert (doc["batches"], doc["batches_total"]) == (total, total)
    assert cli.main(["stats", str(run), "--max-batches", "1"]) == 0
    text = capsys.readouterr().out
    assert f"checkpoint step {step}" in text and f"1 of {total} batches" in text


def test_max_batches_defaults_to_a_bound(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = cli.build_parser()
    for argv in (["eval", "R", "--top-k", "1"], ["stats", "R"], ["report", "R", "--out", "D"]):
        assert parser.parse_args(argv).max_batches == cli.DEFAULT_MAX_BATCHES == 64
        assert parser.parse_args([*argv, "--max-batches", "all"]).max_batches is None
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--max-batches", "0"])
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "'all': every batch" in help_text and "(default: 64)" in help_text
    # the default reaches the evaluation: with a bound of 1, one batch is evaluated
    monkeypatch.setattr(cli.common, "DEFAULT_MAX_BATCHES", 1)  # read by --max-batches
    doc = _json(capsys, ["eval", str(run), "--top-k", "2"])
    assert doc["results"][0]["batches"] == 1 < doc["batches_total"]


def test_report_checks_every_run_first(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import moelab.report

    def must_not_run(*args: Any, **kw: Any) -> None:
        raise AssertionError("build_report ran before the runs were checked")

    monkeypatch.setattr(moelab.report, "build_report", must_not_run)
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(run / "config.json", no_ckpt / "config.json")
    shutil.copy(run / "tokenizer.json", no_ckpt / "tokenizer.json")
    missing = tmp_path / "nonexist"
    out = tmp_path / "rep"
    argv = ["report", str(run), str(missing), str(no_ckpt), "--out", str(out), "--json"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("moelab report: error: 2 of the 3 runs cannot be reported")
    assert f"{missing} is not a moelab run folder: it does not exist" in err
    assert f"{no_ckpt} holds no checkpoint" in err
    assert "2 of the 3 runs" in strict_json(captured.out)["error"]
    assert not out.exists()


def test_corrupted_checkpoint_is_a_user_error(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    # every checkpoint (steps 3 and 6), so that no fallback to an older one can load
    all_weights = sorted((copy / "checkpoints").glob("step_*/model.safetensors"))
    assert len(all_weights) == 2
    for weights in all_weights:
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF  # the last tensor byte flipped: same size, other sha256
        weights.write_bytes(bytes(data))
    for argv in (["eval", str(copy), "--top-k", "2"], ["stats", str(copy)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"moelab {argv[0]}: error: the newest checkpoint ")
        assert "is damaged (checkpoint file " in err and "no older checkpoint is intact" in err
        assert "model.safetensors" in err and "corrupted" in err and "Traceback" not in err
        assert err.count("\n") == 1


def _train_argv(corpus: Path, out: Path) -> list[str]:
    sets = [
        "n_layers=2", "d_model=32", "n_heads=2", "n_kv_heads=1", "d_ff=64", "n_experts=4",
        "max_seq_len=32", "seq_len=32", "batch_size=4", "vocab_size=300", "val_fraction=0.1",
        "eval_batches=2", "device=cpu", "router.renorm=off",
    ]  # fmt: skip
    argv = ["train", "--map", "sparsemax", "--top-k", "2", "--steps", "4"]
    argv += ["--out", str(out), "--data", str(corpus)]
    for item in sets:
        argv += ["--set", item]
    return argv


def test_train_val_loss_says_what_it_covers(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    doc = _json(capsys, _train_argv(corpus, out))
    # --set router.renorm=off means off (it used to be the truthy string "off")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["router"]["renorm"] is False
    # 2 batches of 4 sequences of 32 targets
    assert (doc["val_batches"], doc["val_tokens"]) == (2, 2 * 4 * 32)
    # the claim holds: the printed val loss is eval's NLL over the first 2 batches
    (row,) = evaluate(out, [2], max_batches=2)["results"]
    assert row["tokens"] == doc["val_tokens"]
    assert doc["val_loss"] == pytest.approx(row["nll"], rel=1e-5)
    assert cli.main([*_train_argv(corpus, out), "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "(first 2 batches of the validation split, 256 tokens; --set eval_batches=N)" in text


def test_report_bounds_its_batches_by_default(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import moelab.report

    seen: list[int | None] = []

    def fake_report(
        runs: Any, out: Any, top_ks: Any, max_batches: int | None, step: int | None, **kw: Any
    ) -> dict:
        seen.append(max_batches)
        return {"report": "r.md", "files": [], "latex": [], "tables": {}}

    monkeypatch.setattr(moelab.report, "build_report", fake_report)
    assert cli.main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "at most 64 validation batches per run" in capsys.readouterr().out
    assert (
        cli.main(["report", str(run), "--out", str(tmp_path / "rep"), "--max-batches", "all"]) == 0
    )
    assert "every validation batch of each run" in capsys.readouterr().out
    assert seen == [64, None]
