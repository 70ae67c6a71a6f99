"""The MoE health set of the metrics rows against hand computations on fixed routing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moelab.routing.output import RouterOutput
from moelab.train import health as H
from moelab.train.distributed import DistInfo

ONE = DistInfo()


def test_max_violation_cv_and_dead_experts_by_hand() -> None:
    load = torch.tensor([2.0, 1.0, 1.0, 0.0])  # mean 1
    assert H.max_violation(load) == pytest.approx(1.0)  # 2 / 1 - 1
    assert H.load_cv_of(load) == pytest.approx(math.sqrt(0.5))  # std sqrt(2/4)
    assert H.max_violation(torch.ones(4)) == 0.0
    assert H.max_violation(torch.zeros(4)) == 0.0 and H.load_cv_of(torch.zeros(4)) == 0.0
    counts = torch.tensor([10.0, 0.0, 5.0, 1.0])  # mean 4
    assert H.dead_experts(counts) == 1  # no token
    assert H.dead_experts(counts, 0.25) == 2  # at most 1 token: experts 1 and 3
    assert H.dead_experts(counts, 0.24) == 1
    assert H.dead_experts(torch.zeros(4)) == 4


def test_router_entropy_by_hand() -> None:
    probs = torch.tensor(
        [
            [0.5, 0.5, 0.0, 0.0],  # ln 2
            [0.25, 0.25, 0.25, 0.25],  # ln 4
            [2.0, 2.0, 0.0, 0.0],  # sigmoid-like values, normalised: ln 2
            [0.0, 0.0, 0.0, 0.0],  # no mass: 0
            [1.0, 0.0, 0.0, 0.0],  # one expert: 0
        ]
    )
    expected = [math.log(2), math.log(4), math.log(2), 0.0, 0.0]
    assert H.router_entropy(probs).tolist() == pytest.approx(expected, abs=1e-12)


def test_quantiles_are_numpys_and_leave_out_infinite_gaps() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1001, generator=g, dtype=torch.float64)
    assert H.quantiles(x) == pytest.approx(np.quantile(x.numpy(), [0.1, 0.5, 0.9]).tolist())
    y = torch.cat([x, torch.tensor([math.inf, math.nan])])
    assert H.quantiles(y) == H.quantiles(x)
    assert H.quantiles(torch.tensor([math.inf])) == [0.0, 0.0, 0.0]
    assert H.quantiles(torch.tensor([0.0, 1.0, 2.0, 3.0]), (0.5,)) == [1.5]


def test_sequence_imbalance_by_hand() -> None:
    # two sequences of two tokens, two slots each
    ids = torch.tensor([[0, 1], [0, 2], [1, 2], [1, 2]])
    computed = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    got = H.sequence_imbalance(ids, computed, n_experts=4, seq_len=2)
    # sequence 0: expert 0 holds 2 of 4 slots; sequence 1: expert 1 holds 2 of 3
    assert got.tolist() == pytest.approx([0.5, 2 / 3])
    none = H.sequence_imbalance(ids, torch.zeros_like(computed), 4, 2)
    assert none.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="whole sequences"):
        H.sequence_imbalance(ids, computed, 4, 3)


def test_ep_imbalance_by_hand() -> None:
    # 4 ranks in 2 expert-parallel groups of 2; position 0 holds experts 0-1, 1 holds 2-3
    counts = torch.tensor(
        [[1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    )
    # group 0 sends 4 slots to rank 0 and none to rank 1; group 1 none to 2, 4 to 3
    assert H.ep_imbalance(counts, 2) == pytest.approx(4 / 2)
    assert H.ep_imbalance(torch.ones(2, 4), 2) == pytest.approx(1.0)
    assert H.ep_imbalance(torch.zeros(2, 4), 2) == 1.0
    with pytest.raises(ValueError, match="must divide"):
        H.ep_imbalance(counts, 3)


def test_summary_and_summaries() -> None:
    assert H.summary("x", [3.0, 1.0, 2.0, 10.0]) == {
        "x/min": 1.0,
        "x/median": 2.5,  # the middle two of an even count
        "x/max": 10.0,
    }
    row = {"maxvio_layers": [0.5, 1.5, 1.0], "load_share_layers": [[0.5, 0.5]], "loss": 1.0}
    assert H.summaries(row) == {"maxvio/min": 0.5, "maxvio/median": 1.0, "maxvio/max": 1.5}


def _output(logits: torch.Tensor, ids: torch.Tensor, dropped: torch.Tensor) -> RouterOutput:
    probs = torch.softmax(logits, -1)
    weights = probs.gather(-1, ids)
    selected = torch.ones_like(ids, dtype=torch.bool)
    return RouterOutput(
        scores_TE=logits,
        logits_TE=logits,
        probs_TE=probs,
        ids_TK=ids,
        weights_TK=weights,
        selected_TK=selected,
        dropped_TK=dropped,
        aux_loss=torch.zeros(()),
    )


def test_step_health_on_fixed_routing() -> None:
    # 4 tokens (2 sequences of 2), 4 experts, top-1
    logits = torch.tensor(
        [[3.0, 1.0, 0.0, 0.0], [2.0, 1.5, 0.0, 0.0], [0.0, 4.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    )
    ids = logits.argmax(-1, keepdim=True)  # experts 0, 0, 1, 0
    dropped = torch.tensor([[False], [False], [False], [True]])  # capacity refused token 3
    out = _output(logits, ids, dropped)
    h = H.step_health([out, out], seq_len=2, info=ONE, capacity=True)
    assert set(h) >= {"maxvio_layers", "load_cv_layers", "drop_rate_layers", "entropy_layers"}
    # computed load: expert 0 twice, expert 1 once: mean 0.75, max 2
    assert h["maxvio_layers"] == pytest.approx([2 / 0.75 - 1] * 2)
    load = np.array([2.0, 1.0, 0.0, 0.0])
    assert h["load_cv_layers"] == pytest.approx([load.std() / load.mean()] * 2)
    assert h["drop_rate_layers"] == pytest.approx([0.25] * 2)
    p = torch.softmax(logits.double(), -1)
    ent = float((-(p * p.log()).sum(-1)).mean())
    assert h["entropy_layers"] == pytest.approx([ent] * 2)
    gaps = np.array([2.0, 0.5, 3.0, 1.0])
    for q in (10, 50, 90):
        assert h[f"top2_gap_q{q}_layers"] == pytest.approx([np.quantile(gaps, q / 100)] * 2)
    # sequence 0: both tokens on expert 0 (share 1); sequence 1: one computed slot (1)
    assert h["seq_imbalance_layers"] == pytest.approx([1.0, 1.0])
    assert h["active_layers"] == pytest.approx([0.75, 0.75])
    assert h["singleton_layers"] == [0.0, 0.0]  # softmax: every expert in the support
    kept = float(p.gather(-1, ids).mean())
    assert h["discarded_layers"] == pytest.approx([1 - kept] * 2)
    assert "drop_rate_layers" not in H.step_health([out], 2, ONE, capacity=False)
    assert "discarded_layers" not in H.step_health([out], 2, ONE, discarded=False)


def _dead(*layers: str) -> torch.Tensor:
    """A window's dead experts per layer, one string each: "x" dead, "." alive."""
    return torch.tensor([[c == "x" for c in layer] for layer in layers])


def test_watch_warns_once_an_expert_stays_dead() -> None:
    """Windows of 10 steps, dead_steps 20: a warning once an expert has been dead over
    every window of the last 20 steps; not again while it stays dead, never for one that
    comes and goes, again after it came back and stayed dead once more."""
    w = H.Watch(n_experts=8, dead_fraction=0.0, dead_steps=20)
    seq = {  # step -> (layer 0, layer 1) over the window of the 10 steps before it
        10: ("..x..x..", "........"),  # layer 0: experts 2 and 5 dead since step 0
        20: ("..x.....", "........"),  # 2: dead over steps 1-20, said; 5 came back
        30: ("..x..x..", "x......."),  # 5 dead again, since step 20: 10 steps
        40: ("........", "x......."),  # 2 came back: layer 0 at 0; layer 1's 0: 20 steps
        50: ("..x..x..", "xx......"),
        60: ("..x.....", "xx......"),  # 2 dead over 41-60, a rise again; layer 1: 2
    }
    lines = {step: w.check({"step": step}, step - 10, _dead(*ls)) for step, ls in seq.items()}
    assert {step: len(x) for step, x in lines.items()} == {10: 0, 20: 1, 30: 0, 40: 1, 50: 0, 60: 2}
    assert lines[20] == [
        "warning: step 20: MoE layer 0 has 1 dead expert(s) of 8 (no token over each of the "
        "last 20 steps or more); see docs/training.md, 'Watching a run'"
    ]
    assert "step 40: MoE layer 1 has 1 dead expert(s)" in lines[40][0]
    assert "step 60: MoE layer 0 has 1 dead expert(s)" in lines[60][0]
    layer1 = "MoE layer 1 has 2 dead expert(s) of 8 (no token over each of the last 20 "
    assert layer1 in lines[60][1]


def test_watch_flicker_says_nothing() -> None:
    """An expert missing from single steps, here and there (windows of 1 step, as
    log_every=1 gives): never dead for 20 steps in a row, so no warning, where each
    rise of the window's count was one before."""
    w = H.Watch(n_experts=4, dead_fraction=0.0, dead_steps=20)
    gen = torch.Generator().manual_seed(0)
    said = []
    for step in range(1, 61):
        dead = torch.rand(2, 4, generator=gen) < 0.3
        dead[:, (step // 5) % 4] = False  # every expert lives at least every 20 steps
        said += w.check({"step": step}, step - 1, dead)
    assert said == []


def test_watch_balance_warning_and_dead_fraction() -> None:
    w = H.Watch(n_experts=8, dead_fraction=0.0)
    skewed = {"step": 50, "balance_loss_layers": [0.004, 1.0], "maxvio_layers": [3.0, 3.0]}
    (line,) = w.check(skewed, 40)
    assert "MoE layer 0's balance loss is 0.004" in line and "4.00x the mean" in line
    assert w.check({**skewed, "step": 60}, 50) == []
    balanced = {"step": 70, "balance_loss_layers": [1.0, 0.001], "maxvio_layers": [0.1, 0.5]}
    assert H.Watch(8, 0.0).check(balanced, 60) == []  # not skewed: no warning
    frac = H.Watch(8, 0.05, dead_steps=5).check({"step": 5}, 0, _dead("x......."))
    assert "a load at most 0.05 of the mean over each of the last 5 steps" in frac[0]


def test_watch_state_survives_json() -> None:
    """What a checkpoint keeps: a watch restored from its JSON says what the first one
    says from there on."""
    import json

    first, rows = H.Watch(8, 0.0, dead_steps=20), []
    for step in range(10, 110, 10):
        layers = ("..x.....", "x......." if step > 30 else "........")
        rows.append((step, _dead(*layers)))
    for step, dead in rows[:3]:
        first.check({"step": step}, step - 10, dead)
    second = H.Watch(8, 0.0, dead_steps=20)
    second.restore(json.loads(json.dumps(first.state())))
    for step, dead in rows[3:]:
        assert second.check({"step": step}, step - 10, dead) == first.check(
            {"step": step}, step - 10, dead
        )
