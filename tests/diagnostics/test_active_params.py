"""The measured parameters per token of ``moelab stats`` (the SoftMoE paper's
Active-Param at inference): non-expert parameters plus, per MoE layer, the mean number of
computed experts times the parameters of one expert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.diagnostics import stats
from moelab.diagnostics.accumulators import active_params
from moelab.model import ModelConfig, Transformer
from moelab.train import train
from tests.model.test_param_counts_truncating import SMALL  # 2 blocks of width 8, E = 4
from tests.train import TINY_MODEL, make_corpus, tiny_config


def test_active_params_hand_computed() -> None:
    model = Transformer(ModelConfig(**SMALL, router={"top_k": 2}))
    # non-expert: embeddings 2*10*8 + 8 = 168, attention 8*2*4*2 + 8*1*4*2 = 192 and
    # norms 16 per block, routers 4*8 per layer: 168 + 2*208 + 2*32 = 648;
    # one expert: 3 * 8 * 4 = 96
    got = active_params(model, [1.25, 2.5])
    assert got["non_expert_params"] == 648 and got["expert_params"] == [96, 96]
    assert got["layers"] == [1.25 * 96, 2.5 * 96]
    assert got["active_params"] == 648 + 120 + 240
    # every expert active: all parameters
    everything = active_params(model, [4.0, 4.0])["active_params"]
    assert everything == sum(p.numel() for p in model.parameters())
    assert active_params(model, [1.0, None])["active_params"] is None
    with pytest.raises(ValueError, match="one per MoE layer"):
        active_params(model, [1.0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Two tiny runs (one MoE layer, E = 4): top-2 softmax, and truncating LapSum."""
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)
    out = tmp_path_factory.mktemp("runs")
    lapsum_model = {**TINY_MODEL, "router": {"lapsum_k": 1.5, "selection": "threshold"}}
    configs = {
        "softmax": tiny_config(corpus, out / "softmax", map="softmax", steps=3),
        "lapsum": tiny_config(corpus, out / "lapsum", map="lapsum", steps=4, model=lapsum_model),
    }
    return {name: (Path(cfg.out), train(cfg)) for name, cfg in configs.items()}


PER_EXPERT = 3 * 32 * 64  # SwiGLU gate, up and down between width 32 and 64
N_EXPERTS = 4


def test_stats_active_params_of_a_truncating_run(
    runs: dict[str, tuple[Path, dict]], capsys: pytest.CaptureFixture[str]
) -> None:
    run, summary = runs["lapsum"]
    st = stats(run, max_batches=2)
    assert st["selection"] == "threshold"
    (active,) = [lay["active_experts"] for lay in st["layers"]]  # one MoE layer
    assert 0 < active < N_EXPERTS and active != round(active)  # a measured, fractional mean
    non_expert = summary["params"]["total"] - N_EXPERTS * PER_EXPERT
    assert st["layers"][0]["active_expert_params"] == pytest.approx(active * PER_EXPERT)
    assert st["active_params"] == pytest.approx(non_expert + active * PER_EXPERT, rel=1e-12)
    # between nothing and everything of the experts
    assert non_expert < st["active_params"] < summary["params"]["total"]

    assert main(["stats", str(run), "--max-batches", "2"]) == 0
    text = capsys.readouterr().out
    assert f"({non_expert + active * PER_EXPERT:,.0f})" in text
    assert main(["stats", str(run), "--max-batches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["active_params"] == pytest.approx(st["active_params"])


def test_stats_active_params_of_topk_softmax_equals_the_nominal_count(
    runs: dict[str, tuple[Path, dict]],
) -> None:
    """Softmax top-2 without capacity: every token computes exactly 2 experts, so the
    measured count is the analytic ``active`` of ``moelab params``."""
    run, summary = runs["softmax"]
    st = stats(run, max_batches=2)
    assert [lay["active_experts"] for lay in st["layers"]] == [2.0]
    assert st["active_params"] == summary["params"]["active"]
