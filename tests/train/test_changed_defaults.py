"""Runs written before a router default changed evaluate and resume as they were
trained (moelab.routing.config.CHANGED_DEFAULTS): top-p, capped at top_k before
``top_p_cap`` existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moelab.diagnostics import evaluate, load_run
from moelab.routing.config import RouterConfig, implied_by_saved
from moelab.train import TrainConfig, latest_checkpoint, train

from . import TINY_MODEL, make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=16)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    return load_file(ckpt / "model.safetensors")


def _as_written_before(run: Path, *keys: str) -> None:
    """Make ``run``'s config.json look as moelab wrote it before ``keys`` existed."""
    path = run / "config.json"
    saved = json.loads(path.read_text())
    for key in keys:
        del saved["model"]["router"][key]
    path.write_text(json.dumps(saved))


def test_implied_values_only_for_configs_that_lack_the_key() -> None:
    rc = RouterConfig(d_model=4, n_experts=8, top_k=3, selection="top_p")
    assert implied_by_saved({"selection": "top_p", "top_k": 3}, rc) == {
        "aux_weight": 0.0,
        "top_p_cap": 3,
    }
    assert implied_by_saved({"aux_weight": 0.01, "top_p_cap": None}, rc) == {}
    topk = RouterConfig(d_model=4, n_experts=8)
    assert implied_by_saved({"aux_weight": 0.0}, topk) == {}  # no cap for top-K


def test_an_old_top_p_run_evaluates_and_resumes_capped_at_its_top_k(
    corpus: Path, tmp_path: Path
) -> None:
    """A top-p run trained before the cap became optional kept at most top_k = 2 experts
    (the same routing as ``top_p_cap=2`` today). Its config.json has no top_p_cap: it
    must load with the cap, evaluate as before and resume to the weights of a run that
    never stopped, with the command it was started with."""
    router = {"selection": "top_p", "top_p": 0.9, "aux_weight": 0.01}
    model = dict(TINY_MODEL, router=router)
    capped = dict(TINY_MODEL, router={**router, "top_p_cap": 2})
    straight = tmp_path / "straight"
    train(tiny_config(corpus, straight, steps=6, model=capped))
    run = tmp_path / "old"
    train(tiny_config(corpus, run, steps=6, model=capped), stop_after=3)
    before = evaluate(run, [1, 2], max_batches=1)
    _as_written_before(run, "top_p_cap")

    loaded = load_run(run)
    assert loaded.config.model_config().router_config().top_p_cap == 2
    assert [r.top_k for r in (m.router for m in loaded.model.moe_layers)] == [2]
    after = evaluate(run, [1, 2], max_batches=1)
    assert after["results"] == before["results"]

    summary = train(tiny_config(corpus, run, steps=6, model=model), resume=True)
    assert summary["steps"] == 6
    ours, theirs = _weights(run), _weights(straight)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    saved = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    assert saved.model_config().router_config().top_p_cap == 2


def test_a_new_top_p_run_records_no_cap(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "new"
    router = {"selection": "top_p", "top_p": 0.9}
    train(tiny_config(corpus, run, steps=2, model=dict(TINY_MODEL, router=router)))
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["router"]["top_p_cap"] is None
    assert [m.router.top_k for m in load_run(run).model.moe_layers] == [TINY_MODEL["n_experts"]]


def test_a_value_given_on_resume_is_compared_not_replaced(corpus: Path, tmp_path: Path) -> None:
    """Only a key the resume command leaves to today's default takes the run's own
    value; one it gives (a study states its aux_weight) must match the run's, or the
    resume is refused: it would otherwise claim a setting the run never had."""
    run = tmp_path / "old"
    then = dict(TINY_MODEL, router={"aux_weight": 0.0})
    train(tiny_config(corpus, run, steps=4, model=then), stop_after=2)
    _as_written_before(run, "aux_weight")  # a run from before the default changed
    stated = dict(TINY_MODEL, router={"aux_weight": 0.01})
    refused = r"model\.router\.aux_weight: 0\.0 in the run, 0\.01 given"
    with pytest.raises(ValueError, match=refused):
        train(tiny_config(corpus, run, steps=4, model=stated), resume=True)
    assert train(tiny_config(corpus, run, steps=4), resume=True)["steps"] == 4
    saved = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    assert saved.model_config().router_config().aux_weight == 0.0
