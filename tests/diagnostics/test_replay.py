"""Routing replay (moelab.diagnostics.replay): a replayed forward chooses exactly the
recorded experts (same numerics, bf16 autocast, a perturbed router), the gate weights
keep their gradient, records that do not fit are refused in one line, the file round
trips, swapped Hugging Face models replay too, and ``moelab eval --record / --replay``
reports the replayed NLL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moelab.cli import main
from moelab.diagnostics import RoutingRecord, record, replay
from moelab.diagnostics.replay import REPLAY_FORMAT
from moelab.model import ModelConfig, Transformer
from moelab.routing import RouterConfig
from moelab.routing.router import Router
from moelab.train import train
from tests._docs import page_code
from tests.train import make_corpus, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


def _model(seed: int = 0, **kw) -> Transformer:
    """A tiny random moelab Transformer: 4 blocks, 2 MoE layers of 4 experts, top-2."""
    torch.manual_seed(seed)
    keys = dict(
        n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=100, max_seq_len=16
    )
    keys.update(n_experts=kw.pop("n_experts", 4), router={"top_k": 2, **kw.pop("router", {})})
    keys.update(kw)
    return Transformer(ModelConfig(**keys)).eval()


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 16), vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _recorded(model: Transformer, n_batches: int = 2) -> tuple[RoutingRecord, list]:
    """Record ``n_batches`` forwards; (the record, each forward's output)."""
    outs = []
    with torch.no_grad(), record(model) as rec:
        for b in range(n_batches):
            x = _ids(b)
            outs.append(model(x, x))
    return rec, outs


def _routes(model: Transformer, n_batches: int = 2) -> list:
    with torch.no_grad():
        return [model(_ids(b), _ids(b)) for b in range(n_batches)]


def _one_line_error(match: str):
    return pytest.raises(ValueError, match=match)


def test_record_then_replay_is_exact() -> None:
    model = _model()
    rec, outs = _recorded(model)
    assert (rec.n_layers, rec.tokens, rec.top_k, rec.n_experts) == (2, 64, 2, 4)
    for layer in range(2):
        own = torch.cat([o.router_outputs[layer].ids_TK for o in outs])
        assert torch.equal(rec.ids_TK[layer], own) and rec.chosen_TK[layer].all()
    with replay(model, rec):
        again = _routes(model)
    assert rec.consumed == [64, 64]
    for a, b in zip(outs, again, strict=True):
        assert torch.equal(a.loss, b.loss) and torch.equal(a.logits_BSV, b.logits_BSV)
        for ra, rb in zip(a.router_outputs, b.router_outputs, strict=True):
            assert torch.equal(ra.ids_TK, rb.ids_TK)
            assert torch.equal(ra.weights_TK, rb.weights_TK)
            assert torch.equal(ra.chosen_TK, rb.chosen_TK)
    # the selection rule is restored: no instance forward left behind
    assert all("forward" not in layer.router.selection.__dict__ for layer in model.moe_layers)
    # a partial replay is fine and says how far it got; a new context restarts at 0
    with replay(model, rec):
        _routes(model, 1)
    assert rec.consumed == [32, 32]


def test_bf16_autocast_replays_the_fp32_choice() -> None:
    model = _model(1)
    rec, _ = _recorded(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _routes(model)  # the code path runs; bf16 may or may not change the choice
        with replay(model, rec):
            outs = _routes(model)
    for layer in range(2):
        ids = torch.cat([o.router_outputs[layer].ids_TK for o in outs])
        chosen = torch.cat([o.router_outputs[layer].chosen_TK for o in outs])
        assert torch.equal(ids, rec.ids_TK[layer]) and torch.equal(chosen, rec.chosen_TK[layer])


def test_replay_overrides_a_different_choice() -> None:
    model = _model(2)
    rec, _ = _recorded(model)
    with torch.no_grad():
        for layer in model.moe_layers:
            layer.router.weight.neg_()  # the router now prefers the experts it avoided
    fresh = _routes(model)
    own = torch.cat([o.router_outputs[0].ids_TK for o in fresh])
    assert not torch.equal(own.sort(-1).values, rec.ids_TK[0].sort(-1).values)  # planted
    with replay(model, rec):
        outs = _routes(model)
    for layer in range(2):
        ids = torch.cat([o.router_outputs[layer].ids_TK for o in outs])
        assert torch.equal(ids, rec.ids_TK[layer])


def test_gradients_reach_the_router_through_the_gates() -> None:
    model = _model(3)
    rec, _ = _recorded(model, 1)
    model.train()
    with replay(model, rec):
        out = model(_ids(0), _ids(0))
    assert out.loss is not None
    out.loss.backward()
    for layer in model.moe_layers:
        grad = layer.router.weight.grad
        assert grad is not None and bool(grad.abs().sum() > 0)


@pytest.mark.parametrize("map_name", ["softmax", "sparsemax"])
def test_replayed_gate_gradient_matches_a_reference(map_name: str) -> None:
    """The router computes in float32 whatever the input dtype (it casts), so gradcheck
    in float64 does not apply; the router's gradient is compared with a float64 reference
    of the replayed gate: probs = map(x W^T) gathered at the fixed ids, renormalised."""
    from moelab import maps

    torch.manual_seed(0)
    cfg = RouterConfig(d_model=6, n_experts=5, top_k=2, map=map_name, renorm=True, aux_weight=0.0)
    router = Router(cfg)
    x_TD = torch.randn(7, 6)
    # planted ids, not those the router would choose: every token takes experts 3 and 4
    ids_TK = torch.tensor([[3, 4]] * 7)
    rec = RoutingRecord([ids_TK], [torch.ones(7, 2, dtype=torch.bool)], 5)
    coef_TK = torch.randn(7, 2)
    with replay(router, rec):
        out = router(x_TD)
    assert torch.equal(out.ids_TK, ids_TK)
    (out.weights_TK * coef_TK).sum().backward()
    assert router.weight.grad is not None

    w = router.weight.detach().double().requires_grad_(True)

    def gate(w_ED: torch.Tensor) -> torch.Tensor:
        probs_TE = maps.info(map_name).fn(x_TD.double() @ w_ED.t())
        p_TK = probs_TE.gather(-1, ids_TK)
        return p_TK / p_TK.sum(-1, keepdim=True).clamp_min(1e-30)

    (gate(w) * coef_TK.double()).sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(router.weight.grad.double(), w.grad, atol=1e-5, rtol=1e-4)
    if map_name == "softmax":  # smooth: the reference itself passes gradcheck
        assert torch.autograd.gradcheck(gate, (w.detach().clone().requires_grad_(True),))


def test_records_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    model = _model()
    rec, _ = _recorded(model, 1)
    cases = [
        (_model(n_layers=6), r"record has 2 MoE layers, the model 3"),
        (_model(n_experts=8), r"4 experts \(\+0 null\) per layer, the model's layer 0 8"),
    ]
    for other, match in cases:
        with _one_line_error(match) as err, replay(other, rec):
            pass
        assert "\n" not in str(err.value)
    # T: a second batch runs past the end of a one-batch record
    with _one_line_error(r"T=32 tokens from row 32, past the end .*\(T=32, K=2\)") as err:
        with replay(model, rec):
            _routes(model, 2)
    assert "\n" not in str(err.value)
    assert all("forward" not in layer.router.selection.__dict__ for layer in model.moe_layers)
    # K: the router routes with 3 slots, the record holds 2
    for layer in model.moe_layers:
        layer.router.top_k = 3
    with _one_line_error(r"record has K=2 slots per token \(T=32\), the model's router K=3"):
        with replay(model, rec):
            _routes(model, 1)
    # ids out of range
    with _one_line_error(r"ids span \[0, 9\], outside \[0, 3\]"):
        RoutingRecord([torch.tensor([[0, 9]])], [torch.ones(1, 2, dtype=torch.bool)], 4)
    # K changed inside one record
    with _one_line_error(r"layer 0 was called with K = \[2, 3\]"), record(model):
        _routes(model, 1)
        for layer in model.moe_layers:
            layer.router.top_k = 2
        _routes(model, 1)
    # nesting
    with _one_line_error("replaying a routing record already"), replay(model, rec):
        with replay(model, rec):
            pass


def test_files_that_are_not_records_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a tensor file at all\n")
    with _one_line_error(r"is not a safetensors file .*: record it again") as err:
        RoutingRecord.load(bad)
    assert "\n" not in str(err.value)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "pt"})
    with _one_line_error(r"not a routing record \(format 'pt', expected 'moelab-routing-replay'"):
        RoutingRecord.load(other)
    rec, _ = _recorded(_model(), 1)
    tensors = {k: v for k, v in _tensors(rec).items() if not k.startswith("layer_01")}
    short = tmp_path / "short.safetensors"
    save_file(tensors, str(short), metadata=rec.metadata())
    with _one_line_error(r"says 2 layers but lacks layer_01.ids, layer_01.chosen"):
        RoutingRecord.load(short)
    with pytest.raises(FileNotFoundError):
        RoutingRecord.load(tmp_path / "absent.safetensors")


def _tensors(rec: RoutingRecord) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(rec.n_layers):
        out[f"layer_{i:02d}.ids"] = rec.ids_TK[i]
        out[f"layer_{i:02d}.chosen"] = rec.chosen_TK[i]
    return out


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = _model(router={"selection": "threshold", "map": "sparsemax", "truncation": 0.1})
    rec, _ = _recorded(model)
    assert not all(bool(c.all()) for c in rec.chosen_TK)  # a truncating rule: some unused
    path = tmp_path / "routing.safetensors"
    rec.save(path)
    back = RoutingRecord.load(path)
    assert back.metadata() == rec.metadata()
    assert back.metadata()["format"] == REPLAY_FORMAT and back.map == "sparsemax"
    for a, b in zip(rec.ids_TK + rec.chosen_TK, back.ids_TK + back.chosen_TK, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["routing.safetensors"]  # no temporary
    with replay(model, back):
        outs = _routes(model)
    for layer in range(2):
        chosen = torch.cat([o.router_outputs[layer].chosen_TK for o in outs])
        assert torch.equal(chosen, rec.chosen_TK[layer])


def test_swapped_hf_model() -> None:
    pytest.importorskip("transformers")
    from moelab.integrations.hf.swap import collect_router_outputs, swap_routers
    from tests.integrations import tiny_model

    model = tiny_model("mixtral")
    swap_routers(model)
    x = _ids(0, (2, 12), vocab=320)
    with torch.no_grad(), record(model) as rec:
        ref = model(x).logits
    assert (rec.n_layers, rec.tokens, rec.top_k, rec.n_experts) == (2, 24, 2, 8)
    with torch.no_grad(), replay(model, rec):
        same = model(x).logits
    torch.testing.assert_close(same, ref, atol=0, rtol=0)
    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.weight.neg_()
        with replay(model, rec), collect_router_outputs(model) as outs:
            model(x)
    assert [torch.equal(o.ids_TK, rec.ids_TK[i]) for i, o in enumerate(outs)] == [True, True]


def test_docs_example_runs() -> None:
    exec(compile(page_code("replay.md", "# routing replay"), "docs/replay.md", "exec"), {})


# ------------------------------------------------------------------ moelab eval


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"))
    run = tmp_path_factory.mktemp("runs") / "moe"
    train(tiny_config(corpus, run, steps=4))
    return run


def test_cli_record_then_replay(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "routing.safetensors"
    common = ["eval", str(tiny_run), "--top-k", "2", "--max-batches", "2", "--json"]
    assert main([*common, "--record", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["results"]
    assert doc["record"]["file"] == str(path) and doc["record"]["nll"] == row["nll"]
    assert doc["record"]["routed_tokens"] == 2 * 4 * 32  # 2 batches of 4 x 32 tokens
    # the record knows each row's token: the inputs of the evaluation's batches, in order
    from moelab.diagnostics import load_run
    from moelab.diagnostics.evaluate import shard_batches

    loaded = load_run(tiny_run)
    it = shard_batches(loaded.val_shard(), loaded, None, None)
    want = torch.cat([next(it)[0].reshape(-1) for _ in range(2)])
    assert torch.equal(RoutingRecord.load(path).token_ids, want)
    assert main([*common, "--replay", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rep = doc["replay"]
    assert rep["nll"] == rep["nll_own"] == doc["results"][0]["nll"]
    assert rep["changed_fraction"] == 0.0 and rep["consumed"] == rep["routed_tokens"]
    assert main([*common[:-1], "--replay", str(path)]) == 0
    assert "chosen sets changed 0.00%" in capsys.readouterr().out
    # another K, or more batches than were recorded: one line each
    assert main(["eval", str(tiny_run), "--top-k", "1", "2", "--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab eval: error: --replay evaluates the recorded K=2 only")
    assert err.count("\n") == 1
    assert main([*common[:4], "--max-batches", "3", "--replay", str(path)]) == 2
    assert "past the end of the routing record" in capsys.readouterr().err


def test_cli_replay_of_another_model(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.safetensors"
    rec, _ = _recorded(_model(n_layers=2, n_experts=8), 1)  # 1 MoE layer, as the run
    rec.save(path)
    assert main(["eval", str(tiny_run), "--top-k", "2", "--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab eval: error: ") and err.count("\n") == 1
    assert "the routing record has 8 experts" in err
