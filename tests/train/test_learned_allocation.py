"""Truncating LapSum routers in training: thresholds calibrated on the first batches,
learned allocation across layers (the budget moves, sums to K, reaches the routers),
the per-layer log lines, and the checks on the configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelab.cli import main
from moelab.data import TokenShard, batches
from moelab.diagnostics import evaluate, evaluate_truncation, load_run, stats
from moelab.model import ModelConfig, Transformer, param_counts
from moelab.routing import Router, RouterConfig
from moelab.routing.allocation import ThresholdCalibrator
from moelab.train import calibrate_thresholds, train
from tests.train import TINY_MODEL, make_corpus, tiny_config

ALLOC = dict(
    TINY_MODEL,
    moe_layers="all",
    k_total=3.0,
    router={"map": "lapsum", "selection": "threshold"},
)


def _model_config(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=50, **{**ALLOC, **kw})


def test_config_fills_and_checks_allocation() -> None:
    mc = _model_config()
    assert mc.router["lapsum_k"] == 1.5 and mc.router["threshold_relative"] is True
    model = Transformer(mc)
    assert param_counts(mc)["router"] == sum(
        p.numel() for n, p in model.named_parameters() if "router" in n or "allocator" in n
    )
    k_L = model.layer_budgets()
    assert k_L is not None and torch.allclose(k_L, torch.tensor([1.5, 1.5]))
    with pytest.raises(ValueError, match=r"router\.map=lapsum"):
        _model_config(router={"map": "softmax"})
    with pytest.raises(ValueError, match="K / L"):
        _model_config(router={"map": "lapsum", "selection": "threshold", "lapsum_k": 2.0})
    with pytest.raises(ValueError, match="must exceed n_layers"):
        _model_config(k_total=2.0)
    with pytest.raises(ValueError, match="needs MoE layers"):
        _model_config(moe_layers="none")
    with pytest.raises(ValueError, match="needs map='lapsum'"):
        RouterConfig(d_model=4, n_experts=4, threshold_relative=True)


def test_relative_threshold_follows_k() -> None:
    cfg = RouterConfig(
        d_model=8,
        n_experts=4,
        map="lapsum",
        lapsum_k=2.0,
        selection="threshold",
        threshold=1.2,
        threshold_relative=True,
    )
    router = Router(cfg)
    assert router.effective_threshold() == pytest.approx(1.2 * 2.0 / 4)
    assert router.effective_threshold(torch.tensor(1.0)) == pytest.approx(1.2 * 1.0 / 4)
    x = torch.randn(64, 8)
    out = router(x, lapsum_k=torch.tensor(3.0))
    kept = out.probs_TE.gather(-1, out.ids_TK)[out.selected_TK]
    assert (kept > 1.2 * 3.0 / 4).all()
    # calibrate stores the cut found in units of k / E
    cal = ThresholdCalibrator()
    cal.observe(out.probs_TE)
    router.calibrate(cal, 2.0)
    assert router.effective_threshold(2.0) == pytest.approx(cal.threshold(2.0))


def test_allocation_gradient_reaches_eta() -> None:
    torch.manual_seed(0)
    model = Transformer(_model_config(router={"map": "lapsum", "selection": "threshold"}))
    x = torch.randint(0, 50, (2, 16))
    out = model(x, x)
    assert out.loss is not None
    out.loss.backward()
    assert model.allocator is not None and model.allocator.eta.grad is not None
    assert model.allocator.eta.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("learned", [False, True])
def test_calibration_hits_the_target_on_its_batches(
    corpus: Path, tmp_path: Path, learned: bool
) -> None:
    router = {"map": "lapsum", "selection": "threshold"}
    model_kw = dict(moe_layers="all", router=router)
    if learned:
        model_kw["k_total"] = 3.0
    else:
        router["lapsum_k"] = 1.5
    cfg = tiny_config(
        corpus, tmp_path / "run", model={**tiny_config(corpus, tmp_path).model, **model_kw}, steps=1
    )
    train(cfg)  # prepares the data folder
    shard = TokenShard.open(tmp_path / "run" / "data" / "train.bin")
    it = batches(shard, 4, 32, 0)
    calib = [next(it) for _ in range(3)]
    torch.manual_seed(0)
    model = Transformer(cfg.model_config(vocab_size=shard.meta["vocab_size"]))
    thresholds = calibrate_thresholds(model, calib)
    assert len(thresholds) == 2 and model.training
    model.eval()
    with torch.no_grad():
        active = torch.zeros(2)
        for x, _ in calib:
            out = model(x)
            active += torch.stack(
                [o.computed_TK.sum(-1).float().mean() for o in out.router_outputs]
            )
    # every layer keeps about k = 1.5 experts per token on the batches it was set on
    n_tokens = 3 * 4 * 32
    assert torch.allclose(active / 3, torch.full((2,), 1.5), atol=1.0 / n_tokens + 1e-6)


def test_training_logs_and_moves_the_budget(corpus: Path, tmp_path: Path) -> None:
    model = {
        **tiny_config(corpus, tmp_path).model,
        "moe_layers": "all",
        "k_total": 3.0,
        "router": {"map": "lapsum", "selection": "threshold", "cap_factor": 2.0},
    }
    run = tmp_path / "alloc"
    summary = train(tiny_config(corpus, run, model=model, steps=12, lr=0.05, calibrate_batches=2))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and len(rows[0]["calibrated_thresholds"]) == 2
    logged = [r for r in rows if "k_layers" in r]
    assert len(logged) == 12
    for r in logged:
        assert sum(r["k_layers"]) == pytest.approx(3.0, abs=1e-5)
        assert min(r["k_layers"]) >= 1.0
        assert len(r["active_layers"]) == 2 and len(r["tau_layers"]) == 2
        assert r["active_experts"] == pytest.approx(sum(r["active_layers"]) / 2)
    assert logged[-1]["k_layers"] != pytest.approx([1.5, 1.5], abs=1e-6)  # eta learned
    assert summary["k_layers"] == pytest.approx(logged[-1]["k_layers"])
    # the checkpoint carries eta and the calibrated thresholds; stats read them back
    loaded = load_run(run)
    assert loaded.model.moe_layers[0].router.threshold == pytest.approx(
        rows[0]["calibrated_thresholds"][0]
    )
    st = stats(run, max_batches=2)
    assert st["learned_allocation"] is True
    assert [lay["lapsum_k"] for lay in st["layers"]] == pytest.approx(logged[-1]["k_layers"])
    for lay in st["layers"]:
        rc_thr = loaded.model.moe_layers[lay["layer"]].router.threshold
        assert lay["truncation"] == pytest.approx(rc_thr * lay["lapsum_k"] / 4)
        assert lay["lipschitz"] == pytest.approx(lay["weight_norm"] / (2 * lay["tau"]))


def test_resume_keeps_thresholds_and_budgets(corpus: Path, tmp_path: Path) -> None:
    """Interrupted and resumed, a calibrated learned-allocation run ends bit-identical to
    a straight one (eta, thresholds and every weight)."""
    model = {
        **tiny_config(corpus, tmp_path).model,
        "moe_layers": "all",
        "k_total": 3.0,
        "router": {"map": "lapsum", "selection": "threshold"},
    }

    def cfg(name: str):
        return tiny_config(corpus, tmp_path / name, model=model, steps=6, calibrate_batches=2)

    train(cfg("a"))
    train(cfg("b"), stop_after=3)
    train(cfg("b"), resume=True)
    a, b = load_run(tmp_path / "a").model, load_run(tmp_path / "b").model
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x == y, name
    thresholds = [layer.router.threshold for layer in b.moe_layers]
    assert thresholds == [layer.router.threshold for layer in a.moe_layers]
    assert all(t > 0 for t in thresholds)


def test_truncation_sweep(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scale 1 is the trained routing; a larger scale keeps fewer experts, scale 0 every
    expert (LapSum values are all positive, no cap here); the thresholds come back."""
    model = {
        **tiny_config(corpus, tmp_path).model,
        "router": {"map": "lapsum", "lapsum_k": 2.0, "selection": "threshold"},
    }
    run = tmp_path / "trunc"
    train(tiny_config(corpus, run, model=model, steps=4, calibrate_batches=2))
    loaded = load_run(run)
    before = [layer.router.threshold for layer in loaded.model.moe_layers]
    doc = evaluate_truncation(loaded, [0.0, 1.0, 2.0, 4.0], max_batches=2)
    assert [layer.router.threshold for layer in loaded.model.moe_layers] == before
    assert doc["thresholds"] == before
    rows = {r["threshold_scale"]: r for r in doc["results"]}
    st = stats(loaded, max_batches=2)
    assert rows[1.0]["nll"] == st["nll"]
    assert rows[1.0]["active_experts"] == st["mean"]["active_experts"]
    assert rows[0.0]["active_experts"] == 4.0  # E = 4
    active = [rows[sc]["active_experts"] for sc in (0.0, 1.0, 2.0, 4.0)]
    assert active == sorted(active, reverse=True) and active[-1] < active[0]
    with pytest.raises(ValueError, match=">= 0"):
        evaluate_truncation(loaded, [-1.0])
    assert main(["eval", str(run), "--threshold-scale", "1", "2", "--max-batches", "2"]) == 0
    text = capsys.readouterr().out
    assert "trained thresholds" in text and "validation split, " in text
    assert main(["eval", str(run), "--threshold-scale", "1", "--max-batches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["nll"] == pytest.approx(rows[1.0]["nll"])
    with pytest.raises(ValueError, match="--threshold-scale"):
        evaluate(loaded, [1, 2])
