"""One rule for the discarded mass: reported only for maps whose rows have a fixed total
(the simplex maps and LapSum), never for sigmoid or ReLU gates, in the statistics, the
training log and the gate-norm study alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab import maps
from moelab.diagnostics import routing_stats
from moelab.routing import Router, RouterConfig
from moelab.train import train
from moelab.train.loop import routing_numbers
from tests.train import TINY_MODEL, make_corpus, tiny_config


def _out(map_name: str, **kw):
    torch.manual_seed(0)
    router = Router(RouterConfig(d_model=8, n_experts=6, top_k=2, map=map_name, **kw))
    with torch.no_grad():
        return router(torch.randn(50, 8))


def test_which_maps_have_a_fixed_total() -> None:
    fixed = {name for name in maps.available() if maps.info(name).fixed_total}
    assert fixed == {"softmax", "sparsemax", "entmax", "normmax", "lapsum"}


@pytest.mark.parametrize("map_name", ["sigmoid", "relu", "sqrtsoftplus"])
def test_no_discarded_mass_for_gates_without_a_fixed_total(map_name: str) -> None:
    extra = {"selection": "threshold", "truncation": 0.0} if map_name == "relu" else {}
    res = routing_stats([_out(map_name, **extra)], map_name)
    assert res["mean"]["discarded_mass"] is None
    assert res["layers"][0]["discarded_mass"] is None
    assert res["layers"][0]["discarded_mass_support_ge3"] is None
    assert res["mean"]["contributors"] is not None  # the other fields stay


def test_the_simplex_and_lapsum_keep_theirs() -> None:
    out = _out("softmax")
    kept = (out.probs_TE.gather(-1, out.ids_TK) * out.selected_TK).sum(-1)
    res = routing_stats([out], "softmax")
    assert res["mean"]["discarded_mass"] == pytest.approx(float((1 - kept).mean()), rel=1e-6)
    lap = _out("lapsum", lapsum_k=2.0)
    kept = (lap.probs_TE.gather(-1, lap.ids_TK) * lap.selected_TK).sum(-1)
    res = routing_stats([lap], "lapsum")
    assert res["mean"]["discarded_mass"] == pytest.approx(float((1 - kept / 2).mean()), rel=1e-5)


def test_the_training_log_follows_the_rule(tmp_path: Path) -> None:
    assert "discarded_mass" not in routing_numbers([_out("sigmoid")], discarded=False)
    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    train(tiny_config(corpus, run, steps=2, model=dict(TINY_MODEL, router={"map": "sigmoid"})))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("discarded_mass" not in r for r in rows if "loss" in r)
    assert all("contributors" in r for r in rows if "loss" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert "discarded_mass" not in summary
