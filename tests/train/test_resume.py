"""Resuming: finished runs, extended runs, runs without a checkpoint, damaged
checkpoints, evaluation without the optimiser's file, the saved config and provenance."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import moelab
from moelab._io import json_bytes
from moelab.diagnostics import evaluate, load_run, stats
from moelab.model import ModelConfig
from moelab.routing.config import RouterConfig
from moelab.train import TrainConfig, latest_checkpoint, lr_at, train

from . import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    return load_file(ckpt / "model.safetensors")


def _strict(text: str) -> object:
    """json.loads that refuses NaN and infinities (as strict JSON parsers do)."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


# ----------------------------------------------------------------- finished runs


def test_resuming_a_finished_run_changes_nothing(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(corpus, tmp_path / "run", steps=4)
    first = train(cfg)
    before = _files(tmp_path / "run")
    again = train(cfg, resume=True)
    assert "run already finished at step 4; pass a larger --steps to extend it" in (
        capsys.readouterr().err
    )
    assert again == first
    assert _files(tmp_path / "run") == before  # not one byte changed
    assert _strict((tmp_path / "run" / "summary.json").read_text()) == first


def test_summary_is_strict_json_and_a_nan_one_is_repaired(corpus: Path, tmp_path: Path) -> None:
    assert json_bytes({"a": float("nan"), "b": [float("inf"), 1.0]}) == (
        b'{\n  "a": null,\n  "b": [\n    null,\n    1.0\n  ]\n}\n'
    )
    run = tmp_path / "run"
    first = train(tiny_config(corpus, run, steps=3))
    # what an older moelab wrote when a finished run was resumed: NaN losses
    broken = {**first, "train_loss": float("nan"), "val_loss": float("nan")}
    (run / "summary.json").write_text(json.dumps(broken))
    repaired = train(tiny_config(corpus, run, steps=3), resume=True)
    saved = _strict((run / "summary.json").read_text())
    assert saved == repaired
    assert repaired["train_loss"] == first["train_loss"]
    assert repaired["val_loss"] == first["val_loss"]
    assert repaired["active_experts"] == first["active_experts"]


def test_a_smaller_steps_is_refused(corpus: Path, tmp_path: Path) -> None:
    train(tiny_config(corpus, tmp_path / "run", steps=4))
    with pytest.raises(ValueError, match=r"steps: 4 in the run, 3 given \(a resumed run can only"):
        train(tiny_config(corpus, tmp_path / "run", steps=3), resume=True)
    # an unfinished run cannot be shortened either (its schedule would change)
    train(tiny_config(corpus, tmp_path / "b", steps=6), stop_after=2)
    with pytest.raises(ValueError, match=r"steps: 6 in the run, 4 given"):
        train(tiny_config(corpus, tmp_path / "b", steps=4), resume=True)


# ------------------------------------------------------------------ extending


def test_extending_follows_the_documented_schedule_rule(corpus: Path, tmp_path: Path) -> None:
    """lr_at: an extended run equals a run of the new length started afresh exactly
    when its checkpoint's step is at most warmup_steps + 1 (here 2 + 1 = 3)."""
    new = 7
    straight = train(tiny_config(corpus, tmp_path / "straight", steps=new))
    for old, same in ((3, True), (5, False)):
        run = tmp_path / f"from{old}"
        train(tiny_config(corpus, run, steps=old))
        summary = train(tiny_config(corpus, run, steps=new), resume=True)
        assert summary["steps"] == new
        assert [s for s, _ in _losses(run)] == list(range(1, new + 1))
        config = json.loads((run / "config.json").read_text())
        assert config["steps"] == new and config["run_info"]["resumes"][0]["step"] == old
        a, b = _weights(tmp_path / "straight"), _weights(run)
        identical = all(torch.equal(a[k], b[k]) for k in a)
        assert identical is same, old
        assert (summary["train_loss"] == straight["train_loss"]) is same
        # the lr of each step after the resume is the new schedule's
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        cfg = tiny_config(corpus, run, steps=new)
        for r in rows:
            if r["step"] > old:
                assert r["lr"] == lr_at(r["step"] - 1, cfg)


# --------------------------------------------------- runs without a checkpoint


def test_a_run_without_checkpoint_restarts_from_step_0(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight = train(tiny_config(corpus, tmp_path / "straight", steps=3))
    run = tmp_path / "run"
    cfg = tiny_config(corpus, run, steps=3)
    train(cfg)
    # as if it failed at step 2, before its first checkpoint (checkpoint_every = 0)
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    with pytest.raises(FileExistsError, match=r"no checkpoint yet: pass resume=True \(--resume\)"):
        train(cfg)
    summary = train(cfg, resume=True)
    assert "no checkpoint yet: from step 0" in capsys.readouterr().err
    assert summary["train_loss"] == straight["train_loss"]
    assert [s for s, _ in _losses(run)] == [1, 2, 3]  # the old lines are gone, no doubles
    # a run that failed while preparing its data (only a partial data folder)
    partial = tmp_path / "partial"
    (partial / "data").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="resume=True"):
        train(tiny_config(corpus, partial, steps=3))
    assert train(tiny_config(corpus, partial, steps=3), resume=True)["steps"] == 3


# --------------------------------------------------------- damaged checkpoints


def _damage(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))


def test_a_damaged_latest_checkpoint_falls_back(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kw = dict(steps=8, checkpoint_every=2)
    straight = train(tiny_config(corpus, tmp_path / "straight", **kw))
    for how in ("automatic", "resume_from"):
        run = tmp_path / how
        train(tiny_config(corpus, run, **kw), stop_after=6)
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
            "step_00000004",
            "step_00000006",
        ]
        _damage(run / "checkpoints" / "step_00000006")
        if how == "automatic":
            summary = train(tiny_config(corpus, run, **kw), resume=True)
        else:
            with pytest.raises(ValueError, match=r"no checkpoint of step 5 \(steps it has: 4, 6\)"):
                train(tiny_config(corpus, run, **kw), resume_from=5)
            summary = train(tiny_config(corpus, run, **kw), resume_from=4)
        err = capsys.readouterr().err
        assert "resuming from step 4" in err
        fallback = "warning: skipped a damaged checkpoint (checkpoint file"
        assert (fallback in err and "resuming from step_00000004, the newest intact" in err) is (
            how == "automatic"
        )
        assert summary["train_loss"] == straight["train_loss"]
        a, b = _weights(tmp_path / "straight"), _weights(run)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_intact_checkpoint_says_so(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=4, checkpoint_every=2))
    for folder in (run / "checkpoints").glob("step_*"):
        _damage(folder)
    with pytest.raises(Exception, match=r"no intact checkpoint in .*from a copy") as err:
        train(tiny_config(corpus, run, steps=6, checkpoint_every=2), resume=True)
    assert "--overwrite" not in str(err.value)  # it would delete them


# --------------------------------------------- evaluation needs the model only


def test_eval_and_stats_without_the_optimizer_file(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=3))
    full = evaluate(run, [1, 2], max_batches=1)
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    (ckpt / "optimizer.safetensors").unlink()
    (ckpt / "rng.safetensors").unlink()
    assert evaluate(run, [1, 2], max_batches=1)["results"] == full["results"]
    assert stats(run, max_batches=1)["nll"] == full["results"][1]["nll"]


# ------------------------------------------------ the saved config, provenance


def test_config_json_holds_the_resolved_model(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(corpus, run, steps=2, map="entmax")
    train(cfg)
    saved = json.loads((run / "config.json").read_text())
    model_fields = {f for f in ModelConfig.__dataclass_fields__}
    router_fields = set(RouterConfig.__dataclass_fields__) - {"d_model", "n_experts", "vocab_size"}
    assert set(saved["model"]) == model_fields and set(saved["model"]["router"]) == router_fields
    assert saved["model"]["router"]["map"] == "entmax" and saved["model"]["router"]["alpha"] == 1.5
    assert saved["model"]["n_layers"] == 2 and saved["model"]["d_model"] == 32
    vocab = saved["model"]["vocab_size"]
    # without the preset file, the saved model is the trained one
    rebuilt = TrainConfig.from_dict({**saved, "preset": "paper-300m"}).model_config(vocab)
    assert rebuilt.router_config() == cfg.model_config(vocab).router_config()
    loaded = load_run(run).config.model_config(vocab)
    assert loaded.router_config() == rebuilt.router_config() and loaded.n_layers == 2


def test_an_old_run_with_an_empty_model_still_loads_and_resumes(
    corpus: Path, tmp_path: Path
) -> None:
    """A run folder written before config.json held the resolved model: "model": {}
    (the tiny fixture's model overrides dropped with it) and no threads or run_info.
    Such a run trained without a balance loss (the default then): it resumes without
    one, though the resume command leaves aux_weight at today's default."""
    model = {"router": {"map": "sparsemax"}}
    then = {"router": {"map": "sparsemax", "aux_weight": 0.0}}
    straight = train(tiny_config(corpus, tmp_path / "straight", steps=4, model=then))
    run = tmp_path / "old"
    train(tiny_config(corpus, run, steps=4, model=then), stop_after=2)
    cfg = tiny_config(corpus, run, steps=4, model=model)
    saved = json.loads((run / "config.json").read_text())
    old = {k: v for k, v in saved.items() if k not in ("threads", "run_info")}
    (run / "config.json").write_text(json.dumps({**old, "model": model}))
    assert load_run(run).step == 2
    assert evaluate(run, [1], max_batches=1)["results"][0]["nll"] > 0
    assert train(cfg, resume=True)["train_loss"] == straight["train_loss"]


def test_resume_refuses_another_model_but_not_another_spelling(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=4, map="entmax"), stop_after=2)
    with pytest.raises(ValueError, match=r"model\.router\.map: 'entmax' in the run, 'softmax'"):
        train(tiny_config(corpus, run, steps=4), resume=True)
    # the same model spelled as a router override instead of the map shortcut
    model = {**tiny_config(corpus, run).model, "router": {"map": "entmax"}}
    assert train(tiny_config(corpus, run, steps=4, model=model), resume=True)["steps"] == 4


def _git_head(folder: Path) -> str | None:
    """HEAD of the checkout that tracks ``folder``/__init__.py, None when none does."""
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "__init__.py"], cwd=folder, capture_output=True
        )
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True)
    except OSError:
        return None
    return head.stdout.decode().strip() if tracked.returncode == 0 else None


def test_run_info_records_provenance_and_resume_accepts_another(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=4), stop_after=2)
    saved = json.loads((run / "config.json").read_text())
    info = saved["run_info"]
    assert saved["threads"] == 1 and info["threads"] == 1
    assert info["moelab"] == moelab.__version__ and info["torch"] == torch.__version__
    assert info["device"] == "cpu" and info["world_size"] == 1
    head = _git_head(Path(moelab.__file__).parent)
    assert (info["git"] or {}).get("commit") == head
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        lines = [line.split(":", 1) for line in text.splitlines() if ":" in line]
        flags = next((v.split() for k, v in lines if k.strip() == "flags"), [])
        assert set(info["cpu"]["flags"]) <= set(flags)
        assert ("avx2" in info["cpu"]["flags"]) == ("avx2" in flags)
        names = [v.strip() for k, v in lines if k.strip() == "model name"]
        if names:
            assert info["cpu"]["model"] == names[0]
    # another machine's provenance does not stop a resume; the resume adds its own
    saved["run_info"] = {**info, "torch": "0.0", "cpu": {"model": "elsewhere", "flags": []}}
    (run / "config.json").write_text(json.dumps(saved))
    assert train(tiny_config(corpus, run, steps=4), resume=True)["steps"] == 4
    after = json.loads((run / "config.json").read_text())
    assert after["run_info"]["torch"] == "0.0"  # the start's record is kept
    assert after["run_info"]["resumes"][0]["step"] == 2
    assert after["run_info"]["resumes"][0]["torch"] == torch.__version__
