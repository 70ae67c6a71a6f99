"""Dead experts (real experts that computed no token) in the metrics rows, the progress
lines, the summary and the printed summary of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab.cli import main
from moelab.data import TokenShard, batches
from moelab.diagnostics import load_run
from moelab.model import Transformer
from moelab.routing import Router, RouterConfig
from moelab.train import TrainConfig, loop, train
from moelab.train.dead_experts import ExpertLoad
from moelab.train.distributed import DistInfo

from . import TINY_MODEL, make_corpus, tiny_config

PLANTED = [[3], [2, 3]]
"""Experts that the selection bias shuts out, per MoE layer (of 4, top-2)."""


class _WithDeadExperts(Transformer):
    """The model whose routers never select the PLANTED experts: a selection bias of
    -1e9 (a buffer that only bias balancing moves, off here)."""

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        with torch.no_grad():
            for layer, planted in zip(self.moe_layers, PLANTED, strict=True):
                layer.router.bias[planted] = -1e9


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _reference_dead(run: Path) -> list[int]:
    """Per MoE layer, the real experts with no computed slot over the validation batches
    training's final evaluation covers, counted here from the saved model."""
    loaded = load_run(run)
    cfg = loaded.config
    val = TokenShard.open(run / "data" / "val.bin")
    it = batches(val, cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1)
    n_experts = loaded.model.config.n_experts
    counts = [torch.zeros(n_experts, dtype=torch.int64) for _ in loaded.model.moe_layers]
    with torch.no_grad():
        for _, (x_BS, y_BS) in zip(range(cfg.eval_batches), it, strict=False):
            outs = loaded.model(x_BS, y_BS).router_outputs
            for c, o in zip(counts, outs, strict=True):
                ids = o.ids_TK[o.selected_TK & ~o.dropped_TK & (o.weights_TK != 0)]
                c += torch.bincount(ids, minlength=n_experts)[:n_experts]
    return [int((c == 0).sum()) for c in counts]


def test_dead_experts_in_rows_progress_and_summary(
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(loop, "Transformer", _WithDeadExperts)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "n_layers": 4}  # two MoE layers
    sets = [f"{k}={v}" for k, v in model.items()] + ["seq_len=32", "batch_size=4"]
    sets += ["vocab_size=300", "eval_batches=2", "log_every=2", "device=cpu"]
    args = ["train", "--top-k", "2", "--steps", "4", "--out", str(run), "--data", str(corpus)]
    assert main([*args, "--threads", "1", *(a for s in sets for a in ("--set", s))]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dead_layers"], r["dead_experts"]) for r in rows] == [
        (2, [1, 2], 3),
        (4, [1, 2], 3),
    ]
    lines = [x for x in captured.err.splitlines() if x.startswith("step ")]
    assert len(lines) == 2 and all("  dead 3  " in x for x in lines)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dead_layers"] == _reference_dead(run) == [1, 2]
    assert summary["dead_experts"] == 3
    assert (
        "dead experts     3 (per MoE layer: 1, 2; no token in the final evaluation)"
        in captured.out.splitlines()
    )
    # a finished run read back says the same
    monkeypatch.undo()
    (run / "summary.json").unlink()
    saved = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    again = train(saved, resume=True)
    assert again["dead_layers"] == [1, 2] and again["dead_experts"] == 3


def test_a_run_whose_experts_live_says_nothing(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    summary = train(tiny_config(corpus, run, steps=4, log_every=2, progress=True))
    assert summary["dead_experts"] == 0 and summary["dead_layers"] == _reference_dead(run) == [0]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["dead_experts"] for r in rows] == [0, 0]
    assert " dead " not in capsys.readouterr().err


def test_the_count_is_of_a_window_and_of_real_experts_only() -> None:
    torch.manual_seed(0)
    router = Router(RouterConfig(d_model=8, n_experts=4, top_k=2, n_null_experts=2))
    with torch.no_grad():
        router.bias[1] = -1e9  # real expert 1 never selected
    load = ExpertLoad()
    out = router(torch.randn(64, 8))
    # the reference: bincount of the computed slots, real experts only
    computed = out.ids_TK[out.selected_TK & ~out.dropped_TK & (out.weights_TK != 0)]
    counts = torch.bincount(computed, minlength=4)
    assert counts.numel() == 4 and counts[1] == 0
    assert out.null_TK is not None and bool(out.null_TK.any())  # null experts were taken
    load.add([out, out])
    assert load.dead(DistInfo()) == [int((counts == 0).sum())] * 2
    assert load.dead(DistInfo()) == []  # a new window: nothing counted yet
    with torch.no_grad():
        router.bias[1] = 0.0
        router.bias[2] = -1e9
    load.add([router(torch.randn(64, 8))])
    assert load.dead(DistInfo()) == [1]  # expert 2 now, expert 1 alive again
