"""The budget sweep and the statistics of a Hugging Face MoE model read what the routers
actually did: a K that some MoE layer does not take is refused, and so is a model with an
MoE layer whose routing is not read.

Models: a tiny PhiMoE (its router always chooses 2 experts, whatever ``top_k`` says), a
tiny DeepSeek-V4 whose first MoE layer routes by token id (a fixed table), and tiny
Mixtral models with one router altered in place; all random, built from their configs."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf

from moelab import cli
from moelab.integrations.hf import stats as hf_stats_module
from moelab.integrations.hf.families import UnsupportedModelError, moe_routers, top_k
from moelab.integrations.hf.stats import hf_stats, load_hf, read_texts, token_batches
from moelab.integrations.hf.sweep import PROBE_TOKENS, hf_eval
from tests.integrations import VOCAB, D, E, save_tiny, tiny_model, tiny_text, tiny_tokenizer

SMALL = dict(
    vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=512, num_experts_per_tok=2, pad_token_id=0, bos_token_id=0,
    eos_token_id=0, tie_word_embeddings=False,
)  # fmt: skip


def _save(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _phimoe(path: Path) -> Path:
    cfg = tf.PhimoeConfig(
        **SMALL, intermediate_size=128, num_key_value_heads=2, num_local_experts=E
    )
    torch.manual_seed(0)
    return _save(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), path)


def _deepseek_v4(path: Path, table: bool = True) -> Path:
    """Two MoE layers: the first routes by token id (``hash_moe``), the second by its
    scores. ``table``: a random table of 2 distinct experts per token id (at
    initialisation the table is all zeros: expert 0 twice)."""
    if not hasattr(tf, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepSeek-V4")
    cfg = tf.DeepseekV4Config(
        **SMALL, moe_intermediate_size=32, num_key_value_heads=1, head_dim=16,
        q_lora_rank=32, n_routed_experts=E, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=8, sliding_window=16, hc_mult=2, hc_sinkhorn_iters=3,
        mlp_layer_types=["hash_moe", "moe"],
        layer_types=["sliding_attention", "sliding_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    if table:
        g = torch.Generator().manual_seed(1)
        rows = [torch.randperm(E, generator=g)[:2] for _ in range(VOCAB)]
        with torch.no_grad():
            model.model.layers[0].mlp.gate.tid2eid.copy_(torch.stack(rows))
    return _save(model, path)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(tiny_text(), encoding="utf-8")
    return path


def _own_loss(model: Any, tokenizer: Any, text: Path, seq_len: int) -> float:
    """The unmodified model's mean next-token loss (transformers computes it)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for x in token_batches(tokenizer, read_texts(text), seq_len, 4):
            x = x.to(model.device)
            total += float(model(input_ids=x, labels=x).loss) * x[:, 1:].numel()
            n += x[:, 1:].numel()
    return total / n


def _forwards(model: Any) -> list[int]:
    """A counter of the model's forward calls (appended to by a hook)."""
    calls: list[int] = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return calls


# -- PhiMoE: a router that ignores top_k --------------------------------------------------


def test_phimoe_router_ignores_top_k() -> None:
    """The premise: PhiMoE's router returns 2 experts per token whatever top_k says."""
    model = tf.AutoModelForCausalLM.from_config(
        tf.PhimoeConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, num_local_experts=E)
    ).eval()
    site = moe_routers(model)[0]
    with top_k(model, 1):
        assert site.router.top_k == 1
        _, weights, ids = site.router(torch.randn(5, D))
    assert ids.shape == (5, 2) and weights.shape == (5, 2)


def test_sweep_refuses_a_k_the_phimoe_router_ignores(tmp_path: Path, text: Path) -> None:
    model_dir = _phimoe(tmp_path / "phimoe")
    with pytest.raises(ValueError) as err:
        hf_eval(model_dir, text, [1, 2, 4], seq_len=64)
    msg = str(err.value)
    assert isinstance(err.value, UnsupportedModelError)
    assert "top-k 1 was not applied to this 'phimoe' model (family generic)" in msg
    assert "MoE layers 0 (model.layers.0.mlp.router), 1 (model.layers.1.mlp.router)" in msg
    assert "chose 2 experts per token" in msg and "--top-k 2" in msg
    with pytest.raises(UnsupportedModelError, match="top-k 4 was not applied"):
        hf_eval(model_dir, text, [4], seq_len=64)


def test_downstream_refuses_a_k_the_phimoe_router_ignores(tmp_path: Path) -> None:
    """lm-evaluation-harness scores of a Hugging Face model at K carry that K only when
    the routers took it: the harness model probes the routing when K is set."""
    pytest.importorskip("lm_eval")
    from moelab.integrations.lm_eval.model import MoelabLM

    model_dir = _phimoe(tmp_path / "phimoe")
    with pytest.raises(UnsupportedModelError, match="top-k 1 was not applied to this 'phimoe'"):
        MoelabLM(hf=str(model_dir), top_k=1)
    lm = MoelabLM(hf=str(model_dir))
    with pytest.raises(UnsupportedModelError, match="top-k 4 was not applied"):
        lm.set_top_k(4)
    assert lm.top_k == 2  # the refused K left the model at its own
    lm.set_top_k(2)


def test_phimoe_sweep_at_its_own_k(tmp_path: Path, text: Path) -> None:
    model_dir = _phimoe(tmp_path / "phimoe")
    loaded = load_hf(model_dir)
    res = hf_eval(model_dir, text, [2], seq_len=64, loaded=loaded)
    (row,) = res["results"]
    assert res["family"] == "generic" and res["trained_top_k"] == 2
    assert row["nll"] == pytest.approx(_own_loss(*loaded, text, 64), abs=1e-6)
    assert row["active_experts"] == 2 and row["contributors"] == 2


def test_cli_eval_refuses_in_one_line(
    tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = _phimoe(tmp_path / "phimoe")
    capsys.readouterr()
    argv = ["eval", "--hf", str(model_dir), "--data", str(text), "--top-k", "1", "2", "4"]
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert line.startswith("moelab eval: error: top-k 1 was not applied to this 'phimoe' model")
    assert out.out == ""
    assert cli.main([*argv, "--json"]) == 2
    assert "'phimoe'" in json.loads(capsys.readouterr().out)["error"]


# -- a named family: the check is on what was measured ---------------------------------


def _fixed_k(router: torch.nn.Module, k: int, above: int = 0) -> None:
    """Make ``router`` (a Mixtral router) choose ``k`` experts whatever its top_k, on
    calls of more than ``above`` tokens (its own top_k otherwise)."""

    def forward(self: torch.nn.Module, hidden: torch.Tensor) -> Any:
        logits = torch.nn.functional.linear(hidden.reshape(-1, D), self.weight)
        kk = k if logits.shape[0] > above else self.top_k
        w, ids = logits.softmax(-1).topk(kk, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), ids

    router.forward = types.MethodType(forward, router)


def test_named_family_refused_on_measured_routing(tmp_path: Path, text: Path) -> None:
    """A Mixtral whose second router keeps 2 experts: its name is a supported family,
    the check still sees the routing, names that layer only, before any pass."""
    model_dir = save_tiny("mixtral", tmp_path / "m")
    model, tok = load_hf(model_dir)
    _fixed_k(moe_routers(model)[1].router, 2)
    calls = _forwards(model)
    with pytest.raises(UnsupportedModelError) as err:
        hf_eval(model_dir, text, [2, 1], seq_len=64, loaded=(model, tok))
    msg = str(err.value)
    assert "top-k 1 was not applied to this 'mixtral' model (family mixtral)" in msg
    assert "MoE layer 1 (model.layers.1.mlp.gate) chose 2 experts per token" in msg
    assert "layers.0" not in msg
    assert len(calls) == 1  # the probe at K = 1 (not at its own K), before any pass
    res = hf_eval(model_dir, text, [2], seq_len=64, loaded=(model, tok))
    assert res["results"][0]["nll"] == pytest.approx(_own_loss(model, tok, text, 64), abs=1e-6)


def test_pass_checks_all_it_captured(tmp_path: Path, text: Path) -> None:
    """A router that takes K on the probe's short input but not on the pass's batches is
    refused after the pass."""
    model_dir = save_tiny("mixtral", tmp_path / "m")
    model, tok = load_hf(model_dir)
    _fixed_k(moe_routers(model)[0].router, 2, above=PROBE_TOKENS)
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(model.layers.0.mlp.gate\) chose"):
        hf_eval(model_dir, text, [1], seq_len=64, loaded=(model, tok))


# -- DeepSeek-V4: a layer routed by token id --------------------------------------------


def test_deepseek_v4_stats_read_every_layer(tmp_path: Path, text: Path) -> None:
    model_dir = _deepseek_v4(tmp_path / "v4")
    model, tok = load_hf(model_dir)
    res = hf_stats(model_dir, text, seq_len=64, loaded=(model, tok))
    names = [lay["name"] for lay in res["layers"]]
    assert names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert [lay["routed_by"] for lay in res["layers"]] == ["token_id", "scores"]
    # the model's rule is its learned layer's (layer 0 chooses by token id and has none)
    assert res["rule"] is not None and "sqrt(softplus)" in res["rule"]
    # layer 0's load: the table's experts of every token fed, counted here
    table = model.model.layers[0].mlp.gate.tid2eid
    ids = torch.cat([x.reshape(-1) for x in token_batches(tok, read_texts(text), 64, 4)])
    counts = torch.bincount(table[ids].reshape(-1), minlength=E).double()
    assert res["layers"][0]["load_shares"] == pytest.approx((counts / counts.sum()).tolist())
    assert res["layers"][0]["states"] == res["layers"][1]["states"] == ids.numel()
    assert res["tokens"] == ids.numel()


def test_deepseek_v4_sweep(tmp_path: Path, text: Path) -> None:
    model_dir = _deepseek_v4(tmp_path / "v4")
    loaded = load_hf(model_dir)
    with pytest.raises(UnsupportedModelError) as err:
        hf_eval(model_dir, text, [1, 2], seq_len=64, loaded=loaded)
    msg = str(err.value)
    assert "'deepseek_v4' model (family generic_sigmoid)" in msg
    assert "MoE layer 0 (model.layers.0.mlp.gate, routed by token id) chose 2 experts" in msg
    assert "layers.1" not in msg  # the scored layer takes K = 1
    res = hf_eval(model_dir, text, [2], seq_len=64, loaded=loaded)
    assert res["results"][0]["nll"] == pytest.approx(_own_loss(*loaded, text, 64), abs=1e-6)
    assert res["rule"] is not None and "sqrt(softplus)" in res["rule"]


def test_repeated_expert_is_not_k_experts(tmp_path: Path, text: Path) -> None:
    """DeepSeek-V4 at initialisation: its token-id table holds expert 0 twice per token,
    two slots but one expert; K = 1 is refused on the probe's tokens, and even its own
    K after its pass, on every token of the text."""
    model_dir = _deepseek_v4(tmp_path / "v4", table=False)
    loaded = load_hf(model_dir)
    with pytest.raises(UnsupportedModelError) as err:
        hf_eval(model_dir, text, [1, 2], seq_len=64, loaded=loaded)
    assert "layer 0 (model.layers.0.mlp.gate, routed by token id) chose 2 experts" in str(err.value)
    fed = sum(x.numel() for x in token_batches(loaded[1], read_texts(text), 64, 4))
    with pytest.raises(UnsupportedModelError, match=f"repeated an expert for {fed} tokens"):
        hf_eval(model_dir, text, [2], seq_len=64, loaded=loaded)


def test_cli_stats_marks_the_token_id_layer(
    tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = _deepseek_v4(tmp_path / "v4")
    capsys.readouterr()
    assert cli.main(["stats", "--hf", str(model_dir), "--data", str(text)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if "model.layers." in r]
    assert len(rows) == 2
    assert rows[0].endswith("model.layers.0.mlp.gate  (routed by token id)")
    assert rows[1].endswith("model.layers.1.mlp.gate")


# -- MoE layers whose routing is not read --------------------------------------------------


class PlainGate(torch.nn.Module):
    """A router moelab does not know (its class name is no ...TopKRouter)."""

    def __init__(self, router: torch.nn.Module) -> None:
        super().__init__()
        self.inner = router

    def forward(self, hidden: torch.Tensor) -> Any:
        return self.inner(hidden)


def test_unhooked_moe_layer_refused(
    tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("mixtral")
    block = model.model.layers[0].mlp
    block.gate = PlainGate(block.gate)
    with pytest.raises(UnsupportedModelError) as err:
        moe_routers(model)
    msg = str(err.value)
    assert "1 of the 2 MoE layers of this 'mixtral' model (family mixtral)" in msg
    assert "model.layers.0.mlp (MixtralSparseMoeBlock)" in msg and "layers.1" not in msg
    # the CLI says so in one line
    model_dir = save_tiny("mixtral", tmp_path / "m")
    monkeypatch.setattr(hf_stats_module, "load_hf", lambda d, **kw: (model, tiny_tokenizer()))
    capsys.readouterr()
    assert cli.main(["stats", "--hf", str(model_dir), "--data", str(text)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moelab stats: error: 1 of the 2 MoE layers")


def test_router_that_never_runs_refused(tmp_path: Path, text: Path) -> None:
    """A block that routes without calling its router module: the hooks read nothing."""
    model_dir = save_tiny("mixtral", tmp_path / "m")
    model, tok = load_hf(model_dir)
    block = model.model.layers[1].mlp
    block.forward = types.MethodType(lambda self, h: torch.zeros_like(h), block)
    with pytest.raises(UnsupportedModelError) as err:
        hf_stats(model_dir, text, seq_len=64, loaded=(model, tok))
    msg = str(err.value)
    assert "the routing of 1 of the 2 MoE layers of this 'mixtral' model" in msg
    assert "MoE layer 1 (model.layers.1.mlp.gate) never ran" in msg
    with pytest.raises(UnsupportedModelError, match="never ran"):
        hf_eval(model_dir, text, [2], seq_len=64, loaded=(model, tok))
