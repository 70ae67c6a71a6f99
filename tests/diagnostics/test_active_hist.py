"""The distribution of active experts per token per layer (``active_hist``, the SoftMoE
paper's Figure 1): hand-counted on hand-built router outputs (capacity drops, sparse-map
zeros, unselected slots of a truncating rule, null experts), streamed and merged, read
back by ``active_histograms``, in ``moelab stats`` (JSON and text) and in the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moelab import cli
from moelab.diagnostics import ModelRoutingStats, RoutingStats, active_histograms, routing_stats
from moelab.report import plots
from moelab.report.builder import ReportBuilder, load_sections
from moelab.routing import RouterOutput
from moelab.train import train
from tests.diagnostics.test_accumulators import slice_output
from tests.train import make_corpus, tiny_config


def _out(ids, weights, selected=None, dropped=None, n_experts=4, n_null=0, null=None):
    """A router output of T tokens, K slots; probs and logits are placeholders (the
    histogram reads only the slots)."""
    ids_TK = torch.tensor(ids, dtype=torch.int64)
    T = ids_TK.shape[0]
    E = n_experts + n_null
    full = torch.ones_like(ids_TK, dtype=torch.bool)
    none = torch.zeros_like(ids_TK, dtype=torch.bool)
    logits = torch.arange(float(T * E)).reshape(T, E)
    return RouterOutput(
        scores_TE=logits,
        logits_TE=logits,
        probs_TE=torch.full((T, E), 1.0 / E),
        ids_TK=ids_TK,
        weights_TK=torch.tensor(weights, dtype=torch.float32),
        selected_TK=full if selected is None else torch.tensor(selected),
        dropped_TK=none if dropped is None else torch.tensor(dropped),
        aux_loss=torch.zeros(()),
        null_TK=None if null is None else torch.tensor(null),
        n_null=n_null,
    )


def layer_a() -> RouterOutput:
    """T=6, K=2. Computed slots per token, by hand:

    t  ids    weights    selected      dropped        computed
    0  [0,1]  [.6,.4]    [T,T]         [F,F]          2
    1  [1,2]  [1, 0]     [T,T]         [F,F]          1  (sparse-map zero: a filler)
    2  [2,3]  [.5,.5]    [T,T]         [F,T]          1  (second slot over capacity)
    3  [0,3]  [.7,.3]    [T,T]         [T,T]          0  (both dropped)
    4  [1,0]  [1, 0]     [T,F]         [F,F]          1  (a cut kept one slot)
    5  [3,2]  [.9,.1]    [T,T]         [F,F]          2

    histogram [1, 3, 2]; mean 7 / 6 = active_experts."""
    return _out(
        ids=[[0, 1], [1, 2], [2, 3], [0, 3], [1, 0], [3, 2]],
        weights=[[0.6, 0.4], [1.0, 0.0], [0.5, 0.5], [0.7, 0.3], [1.0, 0.0], [0.9, 0.1]],
        selected=[[True, True]] * 4 + [[True, False], [True, True]],
        dropped=[[False, False], [False, False], [False, True], [True, True]]
        + [[False, False]] * 2,
    )


def layer_b() -> RouterOutput:
    """T=4, K=3, E=4 real + 1 null expert (id 4). Computed per token:

    t  ids      weights       selected   null       computed
    0  [0,1,2]  [.5,.3,.2]    [T,T,T]    [F,F,F]    3
    1  [4,0,1]  [.4,.6,0]     [F,T,T]    [T,F,F]    1  (a null slot; a zero weight)
    2  [4,1,2]  [1,0,0]       [F,F,F]    [T,F,F]    0  (only a null expert)
    3  [3,0,1]  [1,0,0]       [T,T,T]    [F,F,F]    1  (sparse map: two zeros)

    histogram [1, 2, 0, 1]; mean 5 / 4."""
    return _out(
        ids=[[0, 1, 2], [4, 0, 1], [4, 1, 2], [3, 0, 1]],
        weights=[[0.5, 0.3, 0.2], [0.4, 0.6, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]],
        selected=[[True] * 3, [False, True, True], [False] * 3, [True] * 3],
        null=[[False] * 3, [True, False, False], [True, False, False], [False] * 3],
        n_null=1,
    )


def test_hand_counted_histograms() -> None:
    doc = routing_stats([layer_a(), layer_b()], "sparsemax")
    a, b = doc["layers"]
    assert a["active_hist"] == [1, 3, 2] and b["active_hist"] == [1, 2, 0, 1]
    assert a["active_experts"] == pytest.approx(7 / 6) and a["dropped_fraction"] == 3 / 11
    assert b["active_experts"] == pytest.approx(5 / 4)
    for lay in (a, b):  # the histogram sums to the states, its mean is active_experts
        hist = lay["active_hist"]
        assert sum(hist) == lay["states"]
        assert sum(n * c for n, c in enumerate(hist)) / sum(hist) == pytest.approx(
            lay["active_experts"], abs=1e-12
        )
    assert "active_hist" not in doc["mean"]  # per layer only, like load_shares
    json.dumps(doc, allow_nan=False)  # plain ints: strict JSON


def test_streaming_merging_and_a_changing_k() -> None:
    whole = RoutingStats("softmax").update(layer_a()).result()["active_hist"]
    first, second = RoutingStats("softmax"), RoutingStats("softmax")
    first.update(slice_output(layer_a(), slice(0, 2)))
    second.update(slice_output(layer_a(), slice(2, 6)))
    assert first.merge(second).result()["active_hist"] == whole == [1, 3, 2]
    # a call with K = 3 after one with K = 2 (another top_k at inference): the histogram
    # grows to 0..3 and keeps the counts it had; merging a shorter one into it adds up
    acc = RoutingStats("softmax").update(layer_a())
    acc.update(_out(ids=[[0, 1, 2]], weights=[[0.2, 0.3, 0.5]]))
    assert acc.result()["active_hist"] == [1, 3, 2, 1]
    longer = RoutingStats("softmax").update(_out(ids=[[0, 1, 2]], weights=[[0.2, 0.3, 0.5]]))
    longer.merge(RoutingStats("softmax").update(layer_a()))
    assert longer.result()["active_hist"] == [1, 3, 2, 1]
    assert RoutingStats("softmax").result()["active_hist"] is None  # no states yet


def test_active_histograms_pads_layers_and_gives_shares() -> None:
    acc = ModelRoutingStats(2, "sparsemax").update([layer_a(), layer_b()])
    doc = acc.result()
    assert active_histograms(doc) == [[1, 3, 2, 0], [1, 2, 0, 1]]
    shares = active_histograms(doc, shares=True)
    assert shares[0] == pytest.approx([1 / 6, 3 / 6, 2 / 6, 0.0])
    assert shares[1] == pytest.approx([0.25, 0.5, 0.0, 0.25])
    with pytest.raises(ValueError, match="layer 1 of the statistics has no 'active_hist'"):
        active_histograms({"layers": [doc["layers"][0], {"layer": 1}]})
    with pytest.raises(ValueError, match="no 'layers'"):
        active_histograms({"run": "x"})


# -- moelab stats and moelab report on a tiny trained run --------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sparsemax run with a capacity limit and input jitter, 3 steps."""
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=12)
    out = tmp_path_factory.mktemp("runs") / "run"
    cfg = tiny_config(corpus, out, map="sparsemax")
    router = {**cfg.model.get("router", {}), "capacity_factor": 1.0, "jitter": 0.05}
    train(tiny_config(corpus, out, map="sparsemax", steps=3, eval_batches=1, log_every=3,
                      model={**cfg.model, "router": router}))  # fmt: skip
    return out


def test_stats_json_and_text_hold_the_histogram(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["stats", str(run), "--max-batches", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for lay in doc["layers"]:
        hist = lay["active_hist"]
        assert len(hist) == 3 and sum(hist) == lay["states"]  # K = 2: counts of 0, 1, 2
        mean = sum(n * c for n, c in enumerate(hist)) / sum(hist)
        assert mean == pytest.approx(lay["active_experts"], abs=1e-12)
    assert cli.main(["stats", str(run), "--max-batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "active experts per token, per layer (share of tokens computing n experts):" in text
    shares = active_histograms(doc, shares=True)
    rows = text.split("computing n experts):\n")[1].splitlines()
    assert rows[0].split() == ["layer", "n=0", "n=1", "n=2"][: len(rows[0].split())]
    for lay, row, line in zip(doc["layers"], shares, rows[1:], strict=True):
        cells = line.split()
        assert int(cells[0]) == lay["layer"]
        assert [float(c) for c in cells[1:]] == pytest.approx(row[: len(cells) - 1], abs=5e-4)


def _bars(figures: dict[str, Any], name: str) -> list[float]:
    fig = figures[name]
    return [float(p.get_height()) for p in fig.axes[0].patches]


def test_report_section_writes_the_figure_and_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hand-built report entries: one with two layers, one saved result without a
    histogram (an older moelab's statistics)."""
    doc = routing_stats([layer_a(), layer_b()], "sparsemax")
    layers = [{**lay, "block": 2 * lay["layer"] + 1} for lay in doc["layers"]]
    entries = [
        {"label": "hand", "dense": False, "layers": layers, "row": {"map": "sparsemax"}},
        {"label": "old", "dense": False, "result": True, "stats": {"x": 1},
         "layers": [{"layer": 0, "active_experts": 1.0}], "row": {"map": "softmax"}},
    ]  # fmt: skip
    figures: dict[str, Any] = {}
    save = plots.save_figure

    def spy(fig: Any, path: Path, **kw: Any) -> Path:
        figures[Path(path).name] = fig
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", spy)
    rep = ReportBuilder(
        tmp_path, entries, 1, sections=load_sections(["moelab.report.sections:_active_section"])
    )
    rep.build()
    text = "\n".join(rep.md)
    assert rep.files == [tmp_path / "active_hand.png"] and rep.files[0].stat().st_size > 1000
    assert "](active_hand.png)" in text and "`old`" in text and "no such distribution" in text
    # bars grouped by n = 0..3, layer 0's four then layer 1's four: the shares by hand
    assert _bars(figures, "active_hand.png") == pytest.approx(
        [1 / 6, 3 / 6, 2 / 6, 0.0, 0.25, 0.5, 0.0, 0.25]
    )
    records = rep.tables["active_experts"].records()
    assert [r["n=1 %"] for r in records] == pytest.approx([50.0, 50.0])
    assert [r["n=3 %"] for r in records] == pytest.approx([0.0, 25.0])
    assert "| 1 | 3 | 1.250 | 25.0 | 50.0 | 0.0 | 25.0 |" in text
