"""moelab analyze invariance: a router made batch-dependent on purpose (capacity dropping)
gives the hand-counted changes and names its mechanism, plain top-K routers (softmax, a
sparse map) change nothing, ties are named as ties, and the CLI on a tiny run and a tiny
Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab import RouterConfig
from moelab.cli import main
from moelab.diagnostics.analysis import InvarianceCounts, batch_mechanisms, invariance
from moelab.diagnostics.analysis.invariance import _Routing
from moelab.routing import Router
from moelab.routing.output import RouterOutput
from tests.diagnostics.test_analysis import _Source, _Tiny


def _source(texts: torch.Tensor, emb: torch.Tensor, weight: torch.Tensor, **router) -> _Source:
    top_k = router.pop("top_k", 1)
    model = _Tiny(emb, weight, top_k)
    model.router = Router(RouterConfig(d_model=emb.shape[1], n_experts=weight.shape[0],
                                       top_k=top_k, **router))  # fmt: skip
    model.router.weight.data.copy_(weight)
    model.eval()
    return _Source(model, {None: [texts]})


def _planted(**router) -> _Source:
    """Two texts of four tokens of id 0, which goes to expert 0 (top-1, E = 2) with a
    top-2 logit margin of 10: no arithmetic can move it."""
    weight = torch.zeros(2, 4)
    weight[0, 0] = 10.0
    return _source(torch.zeros(2, 4, dtype=torch.long), torch.eye(4), weight, **router)


def test_capacity_dropping_gives_the_hand_counted_changes_and_names_the_mechanism() -> None:
    # C = ceil(cf T K / E) = ceil(T / 4) slots of expert 0, first tokens first: alone
    # (T = 4) each text computes its token 0 only
    doc = invariance(_planted(capacity_factor=0.5), n_texts=2, length=4, pad=4, chunk=2)
    got = {r["setting"]: r for r in doc["settings"]}
    expected = {
        "batch": 2,  # T = 8, C = 2: text 0 gains its token 1, text 1 (row 1) loses token 0
        "batch_position": 2,  # rolled: the same with the rows swapped
        "pad_right": 2,  # T = 8, C = 2: each text gains its token 1
        "pad_left": 2,  # the 4 pads come first and take both slots: token 0 is dropped
        "router_decode": 6,  # T = 1, C = 1: every token computed, tokens 1-3 gained
        "router_chunked": 2,  # T = 2, C = 1: token 2 gained
        "recompute": 0,  # the same batch twice
    }
    assert {k: got[k]["changed_tokens"] for k in expected} == expected
    for name, n in expected.items():
        r = got[name]
        assert r["tokens"] == 8 and r["selected_changed_tokens"] == 0
        assert r["dropped_changed_tokens"] == n and r["ties"] == r["near_ties"] == 0
        assert r["verdict"] == ("batch-dependent" if n else "invariant")
        assert r["mechanisms"] == (["capacity dropping"] if n else [])
    assert got["router_decode"]["level"] == got["pad_left"]["level"] == "router"
    assert not got["decode"]["applies"] and not got["chunked"]["applies"]
    assert got["decode"]["reason"].startswith("moelab's Transformer has no KV cache")
    assert [m["key"] for m in doc["batch_mechanisms"]] == ["capacity_factor"]
    assert doc["batch_invariant"] is False


def _random(map: str, **router) -> _Source:
    g = torch.Generator().manual_seed(0)
    V, D, E = 32, 8, 6
    texts = torch.randint(0, V, (3, 12), generator=g)
    return _source(texts, torch.randn(V, D, generator=g), torch.randn(E, D, generator=g),
                   map=map, top_k=2, **router)  # fmt: skip


@pytest.mark.parametrize("map", ["softmax", "sparsemax"])
def test_a_plain_top_k_router_changes_nothing(map: str) -> None:
    doc = invariance(_random(map), n_texts=3, length=12, pad=3, chunk=5)
    assert doc["batch_mechanisms"] == [] and doc["batch_invariant"]
    for r in doc["settings"]:
        if r["setting"] in ("decode", "chunked"):  # no KV cache
            assert not r["applies"]
            continue
        assert r["applies"] and r["changed_tokens"] == 0 and r["verdict"] == "invariant"
        assert r["margin_kk1"]["rest"]["tokens"] == r["tokens"]
        assert r["tokens"] == (72 if r["setting"] == "batch_position" else 36)


def test_expert_choice_and_sinkhorn_are_named_where_they_act() -> None:
    doc = invariance(_random("softmax", selection="expert_choice"), n_texts=3, length=12)
    got = {r["setting"]: r for r in doc["settings"]}
    assert got["router_decode"]["verdict"] == "batch-dependent"  # T = 1: every expert takes it
    assert got["router_decode"]["mechanisms"] == ["expert choice"]
    sink = _random("softmax", selection="sinkhorn")
    mech = batch_mechanisms(sink)
    assert [(m["mechanism"], m["when"]) for m in mech] == [("sinkhorn", "training")]
    doc = invariance(sink, n_texts=3, length=12)
    assert {r.get("verdict") for r in doc["settings"]} == {"invariant", None}  # top-K at inference
    assert doc["batch_invariant"] is True


class _Drifting(Router):
    """A router whose bias moves after each call in training: its recomputed forward
    sends every token to expert 0."""

    def forward(self, x_TD: torch.Tensor, **kw) -> RouterOutput:
        out = super().forward(x_TD, **kw)
        if self.training:
            self.bias[0] += 100.0
        return out


def test_recompute_sees_a_router_that_changes_between_the_two_forwards() -> None:
    src = _random("softmax")
    weight = src.model.router.weight.data.clone()
    src.model.router = _Drifting(src.model.router.config)
    src.model.router.top_k = 1
    src.model.router.weight.data.copy_(weight)
    src.routers = [src.model.router]
    src.model.eval()
    first = src.model(src.texts[None][0]).ids_TK[:, 0]  # eval: the bias does not move
    doc = invariance(src, n_texts=3, length=12, settings=["recompute"])
    (r,) = doc["settings"]
    assert r["changed_tokens"] == int((first != 0).sum()) > 0
    assert r["verdict"] == "batch-dependent" and r["mechanisms"] == []
    assert src.model.router.bias[0] == 200.0 and not src.model.training  # restored mode


def _one(rank: list[float], experts: list[int]) -> _Routing:
    E = len(rank)
    mask = torch.zeros(1, E, dtype=torch.bool)
    mask[0, experts] = True
    return _Routing(mask, mask, torch.zeros_like(mask), torch.tensor([rank], dtype=torch.float64),
                    torch.tensor([len(experts)]))  # fmt: skip


def test_ties_near_ties_and_mechanism_changes_are_told_apart() -> None:
    c = InvarianceCounts()
    c.update(_one([1.0, 0.5, 0.5, 0.0], [0, 1]), _one([1.0, 0.5, 0.5, 0.0], [0, 2]))  # tie
    assert (c.changed, c.ties, c.near_ties) == (1, 1, 1)
    # margin 1e-7, the scores moved by 1e-7: within the arithmetic's reach
    c.update(_one([1.0, 0.5, 0.5 - 1e-7, 0.0], [0, 1]), _one([1.0, 0.5, 0.5 + 1e-7, 0.0], [0, 2]))
    assert (c.changed, c.ties, c.near_ties) == (2, 1, 2)
    # margin 0.5, the same scores: not arithmetic
    c.update(_one([1.0, 0.5, 0.0, 0.0], [0, 1]), _one([1.0, 0.5, 0.0, 0.0], [0]))
    c.update(_one([1.0, 0.5, 0.0, 0.0], [0, 1]), _one([1.0, 0.5, 0.0, 0.0], [0, 1]))
    res = c.result()
    assert (res["changed_tokens"], res["ties"], res["near_ties"], res["tokens"]) == (3, 1, 2, 4)
    assert res["margin_kk1"]["changed"]["min"] == 0.0
    assert res["margin_kk1"]["rest"]["median"] == 0.5
    assert res["margin_top2"]["changed"]["median"] == 0.5


def test_cli_on_a_run_with_capacity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moelab.train import train
    from tests.train import TINY_MODEL, make_corpus, tiny_config

    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    model = dict(TINY_MODEL, router={"capacity_factor": 0.5})
    train(tiny_config(corpus, run, steps=2, model=model))
    args = ["analyze", "invariance", str(run), "--length", "16", "--texts", "2"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["batch_mechanisms"][0]["mechanism"] == "capacity dropping"
    got = {r["setting"]: r for r in doc["settings"]}
    assert got["pad_left"]["level"] == got["router_decode"]["level"] == "router"
    assert got["recompute"]["changed_tokens"] == 0 and got["router_decode"]["changed_tokens"] > 0
    assert {p.name for p in (run / "analyze").iterdir()} >= {
        "invariance.json", "invariance.md", "invariance.png"}  # fmt: skip
    md = (run / "analyze" / "invariance.md").read_text()
    assert "capacity dropping (`capacity_factor=0.5`" in md
    assert main([*args[:3], "--length", "30", "--pad", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moelab analyze: error: --length 30 + --pad 8 exceeds the model's 32 positions; "
        "give a shorter --length or --pad"
    ]


def test_cli_on_a_hugging_face_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    from tests.integrations import save_tiny, tiny_text

    text = tmp_path / "text.txt"
    text.write_text(tiny_text(), encoding="utf-8")
    model = save_tiny("qwen2_moe", tmp_path / "model", seed=0)
    args = ["--data", str(text), "--out", str(tmp_path / "out"), "--length", "12", "--texts", "2"]
    assert main(["analyze", "invariance", "--hf", str(model), *args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "hf" and doc["batch_mechanisms"] == []
    for r in doc["settings"]:  # mask, positions, KV cache and recomputation all run
        if r["setting"].startswith("router_"):
            assert not r["applies"] and "KV cache" in r["reason"]
            continue
        assert r["applies"] and r["level"] == "model", r
        assert r["tokens"] == 2 * 12 * doc["n_layers"]
        assert r["verdict"] in ("invariant", "ties", "near-ties"), r
