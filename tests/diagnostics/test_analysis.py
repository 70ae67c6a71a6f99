"""moelab analyze: each analysis against routings with known answers, the certified-radius
claim (and a check that it catches a wrong radius), the CLI on a tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moelab import RouterConfig
from moelab.cli import main
from moelab.diagnostics.analysis import (
    CoactivationCounts,
    RoutingSource,
    coactivation,
    fragility,
    saturation,
    specialization,
    top1,
    used_mask,
)
from moelab.routing import Router
from moelab.routing.output import RouterOutput
from moelab.train import train
from tests.train import make_corpus, tiny_config


class _Tiny(nn.Module):
    """Token id -> embedding -> one router: a one-layer model with planted routing."""

    def __init__(self, emb: torch.Tensor, weight: torch.Tensor, top_k: int, map: str = "softmax"):
        super().__init__()
        V, D = emb.shape
        self.emb = nn.Embedding(V, D)
        self.emb.weight.data.copy_(emb)
        rc = RouterConfig(d_model=D, n_experts=weight.shape[0], top_k=top_k, map=map)
        self.router = Router(rc)
        self.router.weight.data.copy_(weight)
        self.eval()

    def forward(self, x_BS: torch.Tensor) -> RouterOutput:
        return self.router(self.emb(x_BS).reshape(-1, self.emb.weight.shape[1]))


class _Source(RoutingSource):
    def __init__(self, model: _Tiny, texts: dict, step: int | None = None) -> None:
        self.model, self.routers = model, [model.router]
        self.label, self.kind, self.map, self.alpha = "tiny", "run", model.router.config.map, None
        self.top_k, self.n_experts, self.step = (
            model.router.top_k,
            model.router.config.n_experts,
            step,
        )
        self.texts, self.tokens_per_step = texts, 10

    def batches(self, data=None):
        yield from self.texts[data]

    def as_output(self, layer, returned):
        return returned

    def gate(self, layer):
        return self.router_weight(), self.model.router.temperature.tau.detach().float()

    def router_weight(self):
        return self.model.router.weight.detach().float()

    def decode(self, token_id):
        return f"<{token_id}>"


def _planted(V: int = 16, E: int = 4, top_k: int = 1, scale: float = 10.0) -> _Tiny:
    """Token v goes to expert v % E (one-hot embeddings, a router that reads them)."""
    weight = torch.zeros(E, V)
    for v in range(V):
        weight[v % E, v] = scale
    return _Tiny(torch.eye(V), weight, top_k)


def _out(ids, weights, E=4) -> RouterOutput:
    ids = torch.tensor(ids)
    w = torch.tensor(weights, dtype=torch.float32)
    z = torch.zeros(ids.shape[0], E)
    return RouterOutput(z, z, z, ids, w, torch.ones_like(ids, dtype=torch.bool),
                        torch.zeros_like(ids, dtype=torch.bool), z.new_zeros(()))  # fmt: skip


def test_used_mask_and_top1() -> None:
    out = _out([[2, 0], [1, 3], [0, 1]], [[0.7, 0.3], [0.0, 1.0], [0.0, 0.0]])
    assert used_mask(out).tolist() == [
        [True, False, True, False],
        [False, False, False, True],
        [False, False, False, False],
    ]
    assert top1(out).tolist() == [2, 3, -1]


def test_coactivation_counts_by_hand() -> None:
    acc = CoactivationCounts(4)
    acc.update_mask(used_mask(_out([[0, 1], [0, 1], [0, 2], [3, 2]], [[0.5, 0.5]] * 4)))
    res = acc.result(min_count=1)
    assert res["counts"][0] == [3, 2, 1, 0]
    assert res["conditional"][0][1] == pytest.approx(2 / 3)
    # n = (3, 2, 2, 1), S = 8: expected P(1 | 0) = (2 - 1) * 2 / (8 - 3)
    assert res["expected"][0][1] == pytest.approx(2 / 5)
    assert res["lift"][0][1] == pytest.approx((2 / 3) / (2 / 5))
    assert res["counts"][0][3] == 0 and res["lift"][0][3] == 0


def test_coactivation_independent_choice_has_lift_one_and_finds_a_planted_pair() -> None:
    g = torch.Generator().manual_seed(0)
    T, E = 40_000, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    acc = CoactivationCounts(E)
    acc.update_mask(used_mask(_out(ids.tolist(), [[0.5, 0.5]] * T, E)))
    lift = np.array(acc.result()["lift"], dtype=float)
    off = lift[~np.eye(E, dtype=bool)]
    assert np.abs(off - 1).max() < 0.06  # 1 / (E - 1) is the independent P(j | i)
    planted = CoactivationCounts(E)
    ids[: T // 4] = torch.tensor([5, 6])
    planted.update_mask(used_mask(_out(ids.tolist(), [[0.5, 0.5]] * T, E)))
    top = planted.result()["top_pairs"][0]
    assert (top["i"], top["j"]) == (5, 6) and top["lift"] > 2


def test_coactivation_of_a_source() -> None:
    x = torch.arange(16).reshape(2, 8)
    doc = coactivation(_Source(_planted(top_k=1), {None: [x]}), min_count=1)
    lay = doc["layers"][0]
    assert doc["tokens"] == 16 and lay["load"] == [4, 4, 4, 4]
    assert lay["counts"][0][1] == 0  # top-1: no two experts together


def test_saturation_of_edited_checkpoints() -> None:
    x = [torch.arange(16).reshape(2, 8)]
    final = _planted()
    same = _planted()
    shifted = _planted()
    shifted.router.weight.data.copy_(final.router.weight.data.roll(1, dims=0))  # e -> e + 1
    half = _planted()
    half.router.weight.data[:, :8] = shifted.router.weight.data[:, :8]  # tokens 0-7 moved
    models = [shifted, half, same, final]
    doc = saturation([lambda m=m: _Source(m, {None: x}) for m in models], [10, 20, 30, 40])
    got = [r["mean"]["top1_agreement"] for r in doc["checkpoints"]]
    assert got == [0.0, 0.5, 1.0, 1.0]
    assert [r["training_tokens"] for r in doc["checkpoints"]] == [100, 200, 300, 400]
    assert doc["checkpoints"][1]["layers"][0]["set_overlap"] == 0.5


def test_saturation_needs_two_checkpoints() -> None:
    with pytest.raises(ValueError, match="keep_every"):
        saturation([lambda: None], [1])


def test_vocabulary_and_domain_specialization() -> None:
    src = _Source(
        _planted(top_k=1),
        {"a": [torch.tensor([[0, 1, 4, 5] * 5])], "b": [torch.tensor([[2, 3] * 10])]},
    )
    doc = specialization(src, ["a", "b"], min_count=5)
    voc = doc["vocabulary"][0]
    assert voc["token_ids"] == 6 and voc["mean"] == 1.0 and voc["uniform"] == 0.25
    assert voc["experts"][0]["top_tokens"][0]["id"] in (0, 4)
    a, b = doc["domains"]
    assert a["layers"][0]["share"] == [0.5, 0.5, 0.0, 0.0]
    assert b["layers"][0]["ratio_to_uniform"] == [0.0, 0.0, 2.0, 2.0]


def _gapped(n: int = 200, seed: int = 0) -> _Source:
    """Two experts with rows w and -w (for which the certified radius is nearly tight
    at small gaps), tokens with small top-2 gaps, three of them tied."""
    g = torch.Generator().manual_seed(seed)
    D = 8
    w = torch.randn(D, generator=g)
    w = w / w.norm()
    x = torch.randn(n, D, generator=g)
    x = x - (x @ w)[:, None] * w + (torch.rand(n, generator=g) * 0.05)[:, None] * w
    x[:3] = x[:3] - (x[:3] @ w)[:, None] * w  # exact ties
    model = _Tiny(x, torch.stack([w, -w]), top_k=1)
    return _Source(model, {None: [torch.arange(n)[None]]})


def test_fragility_zero_perturbation_changes_nothing() -> None:
    doc = fragility(_gapped(), "perturb", eps=[0.0])
    r = doc["results"][0]
    assert r["set_changed"] == 0 and r["argmax_changed"] == 0 and r["certified"]["holds"]


def test_fragility_tied_tokens_flip_in_the_smallest_gap_bin() -> None:
    doc = fragility(_gapped(), "perturb", eps=[1e-6], seed=1)
    bins = doc["results"][0]["layers"][0]["by_gap"]
    assert sum(b["set_changed"] for b in bins) == bins[0]["set_changed"] >= 1


def test_certified_radius_claim_holds_and_a_doubled_radius_is_caught() -> None:
    eps = [0.002, 0.005, 0.01, 0.02, 0.05]
    doc = fragility(_gapped(), "perturb", eps=eps, direction="adversarial")
    assert all(r["certified"]["holds"] for r in doc["results"])
    assert any(r["argmax_changed"] > 0 for r in doc["results"])
    doubled = fragility(_gapped(), "perturb", eps=eps, direction="adversarial", radius_scale=2)
    assert not all(r["certified"]["holds"] for r in doubled["results"])


def test_fragility_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--setting"):
        fragility(_gapped(), "fp8")
    with pytest.raises(ValueError, match="--eps"):
        fragility(_gapped(), "perturb", eps=[-1.0])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"))
    run = tmp_path_factory.mktemp("runs") / "moe"
    cfg = tiny_config(
        corpus, run, map="sparsemax", steps=20, eval_batches=2, log_every=10,
        checkpoint_every=5, keep_every=5,
    )  # fmt: skip
    train(cfg)
    return run


def test_cli_on_a_trained_run(tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["analyze", "saturation", str(tiny_run), "--max-batches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == [5, 10, 15, 20]
    assert doc["checkpoints"][-1]["mean"]["top1_agreement"] == 1.0
    for bf in (["fragility", "--setting", "bf16"], ["fragility", "--eps", "0", "0.01", "0.1"]):
        assert main(["analyze", bf[0], str(tiny_run), *bf[1:], "--max-batches", "2", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert all(r["certified"]["holds"] for r in doc["results"])  # the claim, trained
    for name in ("coactivation", "specialization"):
        assert main(["analyze", name, str(tiny_run), "--max-batches", "2"]) == 0
    files = sorted(p.name for p in (tiny_run / "analyze").iterdir())
    assert {
        "saturation.json",
        "saturation.png",
        "fragility_bf16.png",
        "fragility_perturb.json",
    } <= set(files)
    capsys.readouterr()
    assert main(["report", str(tiny_run), "--out", str(tiny_run.parent / "rep")]) == 0
    md = (tiny_run.parent / "rep" / "report.md").read_text()
    assert "## Routing analyses" in md and "Saturation" in md and "Stale" not in md


def test_cli_user_errors(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "thesis.tex").write_text("x")
    assert main(["analyze", "coactivation", str(tiny_run), "--out", str(tmp_path)]) == 2
    assert main(["analyze", "saturation", str(tiny_run), "--step", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("moelab analyze: error: --out") and "thesis.tex" in err[0]
    assert err[1] == "moelab analyze: error: saturation reads every kept checkpoint; drop --step"


def test_hf_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    from tests.integrations import save_tiny, tiny_text

    text = tmp_path / "text.txt"
    text.write_text(tiny_text(), encoding="utf-8")
    a = save_tiny("qwen2_moe", tmp_path / "step100", seed=0)
    b = save_tiny("qwen2_moe", tmp_path / "step200", seed=1)
    out = tmp_path / "out"
    args = ["--data", str(text), "--out", str(out), "--max-tokens", "256", "--json"]
    assert main(["analyze", "saturation", "--hf", str(b), "--hf", str(b), *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["mean"]["top1_agreement"] for r in doc["checkpoints"]] == [1.0, 1.0]
    assert main(["analyze", "saturation", "--hf", str(a), "--hf", str(b), *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == [100, 200]
    assert doc["checkpoints"][0]["mean"]["top1_agreement"] < 1.0  # another random model
    assert main(["analyze", "fragility", "--hf", str(b), *args, "--eps", "0", "0.05"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["set_changed"] == 0
    assert all(r["certified"]["holds"] for r in doc["results"])
    assert main(["analyze", "fragility", "--hf", str(b), *args, "--setting", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["certified"] is None
    for name in ("coactivation", "specialization"):
        assert main(["analyze", name, "--hf", str(b), *args]) == 0
    capsys.readouterr()
    assert main(["analyze", "coactivation", "--hf", str(b), "--data", str(text)]) == 2
    assert "give --out DIR" in capsys.readouterr().err


def test_fragility_kernels_setting(tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    from moelab import maps

    args = ["analyze", "fragility", str(tiny_run), "--setting", "kernels", "--max-batches", "1"]
    code = main([*args, "--out", str(tiny_run.parent / "k"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    if maps.backend() != "cpu-kernels":
        assert code == 2 and "kernels are not in use" in doc["error"]
        return
    assert code == 0 and doc["setting"] == "kernels"
    assert doc["results"][0]["certified"]["holds"]
    assert doc["tokens"] > 0
