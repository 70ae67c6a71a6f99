"""Per-token measures: hand values, and training's log numbers agree with the
diagnostics statistics on the same router outputs (one definition for both)."""

from __future__ import annotations

import pytest
import torch

from moelab.diagnostics import routing_stats
from moelab.routing import Router, RouterConfig, RouterOutput
from moelab.routing.measures import expert_counts, token_measures
from moelab.train import routing_numbers


def _out(probs, ids, weights, selected=None, dropped=None) -> RouterOutput:
    probs = torch.tensor(probs, dtype=torch.float32)
    ids = torch.tensor(ids)
    weights = torch.tensor(weights, dtype=torch.float32)
    selected = (
        torch.ones_like(ids, dtype=torch.bool) if selected is None else torch.tensor(selected)
    )
    dropped = torch.zeros_like(selected) if dropped is None else torch.tensor(dropped)
    return RouterOutput(
        scores_TE=probs.log(),
        logits_TE=probs.log(),
        probs_TE=probs,
        ids_TK=ids,
        weights_TK=weights,
        selected_TK=selected,
        dropped_TK=dropped,
        aux_loss=torch.zeros(()),
    )


def test_hand_values() -> None:
    out = _out(
        probs=[[0.6, 0.3, 0.1, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        ids=[[0, 1], [0, 1], [2, 3]],
        weights=[[0.6, 0.3], [1.0, 0.0], [0.0, 0.0]],
        dropped=[[False, True], [False, False], [False, False]],
    )
    m = token_measures(out)
    assert m.discarded_T.tolist() == pytest.approx([0.1, 0.0, 0.0])  # no mass: none lost
    assert m.support_T.tolist() == [3, 1, 0]
    assert m.contrib_TK.tolist() == [[True, True], [True, False], [False, False]]
    assert m.computed_TK.tolist() == [[True, False], [True, False], [False, False]]
    assert expert_counts(out.ids_TK, m.computed_TK, 4).tolist() == [2, 0, 0, 0]
    # LapSum-like rows (sum to k = 2) are read as shares
    lap = _out(probs=[[0.9, 0.7, 0.3, 0.1]], ids=[[0, 1]], weights=[[0.9, 0.7]])
    assert token_measures(lap).discarded_T.item() == pytest.approx(1 - 1.6 / 2)


@pytest.mark.parametrize(
    "kw",
    [
        {"map": "softmax"},
        {"map": "sparsemax"},
        {"map": "entmax", "alpha": 1.5},
        {"map": "lapsum", "lapsum_k": 2.0, "selection": "threshold", "threshold": 0.2},
        {"map": "softmax", "capacity_factor": 0.5},
    ],
)
def test_training_numbers_equal_diagnostics(kw: dict) -> None:
    torch.manual_seed(0)
    outs = []
    for _ in range(3):  # three MoE layers
        router = Router(RouterConfig(d_model=16, n_experts=8, init_std=1.0, **kw))
        outs.append(router(torch.randn(256, 16)))
    numbers = routing_numbers(outs)
    mean = routing_stats(outs, kw["map"], kw.get("alpha"))["mean"]
    for name in ("discarded_mass", "contributors", "singleton_rate", "load_cv", "active_experts"):
        assert numbers[name] == pytest.approx(mean[name], rel=1e-5, abs=1e-6), name
