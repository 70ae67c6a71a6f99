"""What a run folder records about itself: config.json read back on resume (a damaged
one is named), the vocabulary of prepared data, calibrated cuts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.data import Tokenizer
from moelab.data.prepare import prepare
from moelab.diagnostics import evaluate_truncation, load_run, stats
from moelab.train import TrainConfig, latest_checkpoint, load_checkpoint, train

from . import TINY_MODEL, make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def stopped(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 steps stopped after 2 (a checkpoint at step 2)."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    train(tiny_config(corpus, run, steps=4), stop_after=2)
    return run


# ------------------------------------------------------------- config.json on resume


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"preset": "tiny", "steps": ', "is not valid JSON"),  # cut short
        ("", "is not valid JSON"),  # emptied
        ("\xff\xfe", "is not valid JSON"),  # not text
        ("[1, 2]", "holds an array ([1, 2]), not an object of the run's settings"),
        ('{"steps": 4, "nonsense": 1}', "is not a valid run config"),
    ],
)
def test_a_damaged_config_json_on_resume_is_named(
    corpus: Path, stopped: Path, tmp_path: Path, text: str, says: str
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "run"))
    path = run / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as err:
        train(tiny_config(corpus, run, steps=4), resume=True)
    message = str(err.value)
    assert message.startswith(f"{path} {says}"), message
    # the settings are in every checkpoint; starting over (--overwrite) would delete them
    assert "--overwrite" not in message and "state.json" in message
    assert path.read_bytes() == text.encode("latin-1")  # left as it was found


def test_a_damaged_config_json_is_one_line_from_the_cli(
    corpus: Path, stopped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "run"))
    (run / "config.json").write_text('{"steps": 4,', encoding="utf-8")
    args = ["train", "--out", str(run), "--data", str(corpus), "--threads", "1"]
    code = main([*args, "--resume", "--json"])
    err = capsys.readouterr()
    assert code == 2
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moelab train: error: "), err.err
    assert f"{run / 'config.json'} is not valid JSON" in lines[0]
    assert json.loads(err.out)["error"].startswith(f"{run / 'config.json'} is not valid JSON")


# ------------------------------------------------------------------ prepared data


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared with a 280-token BPE and a validation share of 0.2."""
    out = tmp_path_factory.mktemp("prepared") / "prep"
    prepare(corpus, out, vocab_size=280, val_fraction=0.2, progress=False)
    return out


def _cli_train(tmp_path: Path, prepared: Path, *sets: str) -> list[str]:
    args = ["train", "--out", str(tmp_path / "run"), "--data", str(prepared), "--threads", "1"]
    return [*args, *(a for s in sets for a in ("--set", s))]


@pytest.mark.parametrize(
    ("given", "key", "theirs"),
    [("vocab_size=4096", "vocab_size", "280"), ("val_fraction=0.05", "val_fraction", "0.2")],
)
def test_a_set_that_prepared_data_contradict_is_refused(
    tmp_path: Path, prepared: Path, capsys: pytest.CaptureFixture[str], given: str, key: str,
    theirs: str,
) -> None:  # fmt: skip
    assert main(_cli_train(tmp_path, prepared, given)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moelab train: error: --set "), lines
    assert f"prepared with {key} = {theirs}" in lines[0] and f"drop --set {key}" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_a_set_that_prepared_data_agree_with_is_taken(
    tmp_path: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[TrainConfig] = []

    def fake_train(config: TrainConfig, **kw: object) -> dict:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("moelab.train.train", fake_train)
    with pytest.raises(SystemExit):
        main(_cli_train(tmp_path, prepared, "vocab_size=280", "val_fraction=0.2"))
    assert (seen[0].vocab_size, seen[0].val_fraction) == (280, 0.2)


@pytest.mark.parametrize("vocab_size", [2048, 4096])  # the default, and another value
def test_config_json_records_the_prepared_vocabulary(
    tmp_path: Path, prepared: Path, capsys: pytest.CaptureFixture[str], vocab_size: int
) -> None:
    run = tmp_path / "run"
    train(tiny_config(prepared, run, steps=2, vocab_size=vocab_size, val_fraction=0.05))
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    tokens = Tokenizer.load(prepared / "tokenizer.json").vocab_size
    assert tokens <= 280
    assert saved["vocab_size"] == saved["model"]["vocab_size"] == tokens
    assert saved["val_fraction"] == 0.2
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: vocab")]
    assert len(warned) == (vocab_size != 2048)  # only a value asked for is worth a word
    # the same settings resume it; so does the folder's own value
    cfg = tiny_config(prepared, run, steps=3, vocab_size=vocab_size, val_fraction=0.05)
    assert train(cfg, resume=True)["steps"] == 3
    cfg = tiny_config(prepared, run, steps=4, vocab_size=tokens, val_fraction=0.2)
    assert train(cfg, resume=True)["steps"] == 4


def test_a_run_that_recorded_another_vocabulary_still_resumes(
    tmp_path: Path, prepared: Path
) -> None:
    """Runs written before the fix hold the vocab_size they were given."""
    run = tmp_path / "run"
    train(tiny_config(prepared, run, steps=3), stop_after=2)
    path = run / "config.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**saved, "vocab_size": 4096}), encoding="utf-8")
    assert train(tiny_config(prepared, run, steps=3), resume=True)["steps"] == 3
    tokens = Tokenizer.load(prepared / "tokenizer.json").vocab_size
    assert json.loads(path.read_text(encoding="utf-8"))["vocab_size"] == tokens


# -------------------------------------------------------------------- calibrated cuts

THRESHOLD = {"selection": "threshold", "truncation": 0.9, "token_cap_factor": 2}


def _threshold_config(corpus: Path, run: Path, **kw: object) -> TrainConfig:
    model = {**TINY_MODEL, "n_layers": 4, "router": THRESHOLD}  # two MoE layers
    return tiny_config(corpus, run, model=model, **kw)


def test_config_json_records_the_calibrated_cuts_that_eval_and_stats_use(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    summary = train(_threshold_config(corpus, run, steps=3, calibrate_batches=2))
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    record = saved["calibrated"]
    cuts = record["truncation_layers"]
    # the reference: each layer's cut as the checkpoint's routers hold it
    state = load_checkpoint(latest_checkpoint(run), restore_rng=False)  # type: ignore[arg-type]
    extra = state["model_extra_state"]
    held = [extra[k]["truncation"] for k in sorted(extra) if k.endswith("router._extra_state")]
    assert len(cuts) == 2 and cuts == held
    assert all(0 < c < 0.9 for c in cuts)  # calibration moved the cut well below 0.9
    assert record["requested_truncation"] == 0.9 and record["batches"] == 2
    assert saved["model"]["router"]["truncation"] == 0.9  # the setting, as requested
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["calibrated_thresholds"]) == (0, cuts)
    assert summary["calibrated"] == record
    assert json.loads((run / "summary.json").read_text())["calibrated"] == record
    # eval and stats route with the same cuts
    loaded = load_run(run)
    assert [layer.router.truncation for layer in loaded.model.moe_layers] == cuts
    assert evaluate_truncation(loaded, [1.0], max_batches=1)["thresholds"] == cuts
    layers = stats(loaded, max_batches=1)["layers"]
    assert [lay["truncation"] for lay in layers] == pytest.approx(cuts, rel=1e-6)
    assert TrainConfig.from_dict(saved).model_config().router_config().truncation == 0.9


def test_a_resumed_run_keeps_and_routes_with_the_calibrated_cuts(
    corpus: Path, tmp_path: Path
) -> None:
    straight = train(_threshold_config(corpus, tmp_path / "straight", steps=4))
    run = tmp_path / "run"
    cfg = _threshold_config(corpus, run, steps=4)
    train(cfg, stop_after=2)
    before = json.loads((run / "config.json").read_text(encoding="utf-8"))["calibrated"]
    resumed = train(cfg, resume=True)
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert saved["calibrated"] == before == straight["calibrated"] == resumed["calibrated"]
    assert resumed["train_loss"] == straight["train_loss"]
    # a finished run read back says the same
    assert train(cfg, resume=True)["calibrated"] == before


def test_no_record_without_calibration(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(_threshold_config(corpus, run, steps=2, calibrate_batches=0))
    assert "calibrated" not in json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert "calibrated" not in summary
    assert [layer.router.truncation for layer in load_run(run).model.moe_layers] == [0.9, 0.9]


def test_the_printed_summary_gives_the_calibrated_cut(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    sets = [f"{k}={v}" for k, v in TINY_MODEL.items()] + [
        f"router.{k}={v}" for k, v in THRESHOLD.items()
    ]
    sets += ["seq_len=32", "batch_size=4", "vocab_size=300", "eval_batches=1", "device=cpu"]
    args = ["train", "--steps", "2", "--out", str(run), "--data", str(corpus), "--threads", "1"]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 0
    cuts = json.loads((run / "config.json").read_text())["calibrated"]["truncation_layers"]
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("calibrated cut")]
    assert lines == [
        f"calibrated cut   {cuts[0]:.4f} (per MoE layer; router.truncation = 0.9 replaced, "
        "on 4 batches)"
    ]
