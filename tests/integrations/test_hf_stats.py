"""Routing statistics and the budget sweep of Hugging Face MoE models, and their CLI.

The routing of each family is checked against values worked out by hand on fixed logits
(E = 8, K = 3, 4 groups of 2 experts, 2 groups kept), read through the installed
transformers' own router modules; the sweep against the unmodified model's loss."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moelab import cli
from moelab.diagnostics.accumulators import FIELDS
from moelab.integrations.hf.families import (
    UnsupportedModelError,
    moe_routers,
    route_site,
    top_k,
)
from moelab.integrations.hf.stats import collect, hf_stats, load_hf, read_texts, token_batches
from moelab.integrations.hf.sweep import hf_eval
from tests.integrations import FAMILIES, save_tiny, tiny_model, tiny_text

Z = [
    [3.0, 0.1, 2.5, 0.0, 2.8, 0.2, -1.0, -2.0],
    [0.0, 1.0, -0.5, 2.0, 0.5, -1.5, 1.5, 0.3],
    [-1.0, 0.4, 0.0, -0.3, 0.2, 1.2, 2.2, 0.9],
]
"""Fixed router logits of 3 tokens over E = 8 experts."""
K = 3
V3_BIAS = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
"""DeepSeek-V3's e_score_correction_bias in the hand-worked example (expert 6 favoured)."""
SCALE = 2.5  # routed_scaling_factor of the tiny DeepSeek configs

# The chosen experts, worked out by hand from Z (see the comments):
GREEDY = [{0, 2, 4}, {1, 3, 6}, {5, 6, 7}]  # the 3 largest logits of each row
# DeepSeek-V2 group_limited_greedy, groups {0,1} {2,3} {4,5} {6,7} scored by their best
# softmax value: row 0 keeps groups 0 (3.0) and 2 (2.8) -> 0, 4, 5; row 1 keeps 1 (2.0)
# and 3 (1.5) -> 3, 6, 7; row 2 keeps 3 (2.2) and 2 (1.2) -> 6, 5, 7
V2_GROUPED = [{0, 4, 5}, {3, 6, 7}, {5, 6, 7}]
# DeepSeek-V3: sigmoid + bias, groups scored by the sum of their two best biased scores:
# row 0: g0 .953+.525, g1 .924+.5, g2 .943+.550, g3 .769+.119 -> g2, g0 -> 0, 4, 5;
# row 1: g3 (1.318+.574) and g1 (.881+.378) -> 6, 3, 7; row 2: g3, g2 -> 6, 5, 7
V3_GROUPED = [{0, 4, 5}, {3, 6, 7}, {5, 6, 7}]

EXPECTED_IDS = {
    "mixtral": GREEDY,
    "qwen2_moe": GREEDY,
    "qwen3_moe": GREEDY,
    "olmoe": GREEDY,
    "deepseek_v2": V2_GROUPED,
    "deepseek_v3": V3_GROUPED,
    "gpt_oss": GREEDY,
}


def _softmax(z: list[float]) -> list[float]:
    m = max(z)
    e = [math.exp(v - m) for v in z]
    return [v / sum(e) for v in e]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _expected_weight(family: str, z: list[float], ids: set[int], i: int) -> float:
    """Gate weight of expert i of the chosen ``ids`` for one row, by each family's rule."""
    p = _softmax(z)
    if family in ("mixtral", "qwen3_moe", "gpt_oss"):  # renormalised over the k
        # (GPT-OSS: softmax over the k logits = the softmax over E renormalised)
        return p[i] / sum(p[j] for j in ids)
    if family in ("qwen2_moe", "olmoe"):  # norm_topk_prob=False in the tiny configs
        return p[i]
    if family == "deepseek_v2":
        return p[i] * SCALE
    s = {j: _sigmoid(z[j]) for j in ids}  # deepseek_v3: unbiased, normalised, scaled
    return s[i] / sum(s.values()) * SCALE


def _stats_probs(family: str, z: list[float]) -> list[float]:
    if family == "deepseek_v3":
        a = [_sigmoid(v) for v in z]
        return [v / sum(a) for v in a]
    return _softmax(z)


def _fixed_router(family: str) -> tuple[torch.nn.Module, object, torch.Tensor]:
    """A tiny model whose first router gives exactly Z for the returned inputs x."""
    model = tiny_model(family)
    site = moe_routers(model)[0]
    with torch.no_grad():
        site.weight.zero_()
        site.weight[:, :8] = torch.eye(8)
        if site.bias is not None:
            site.bias.zero_()
        if site.choice_bias is not None:
            site.choice_bias.copy_(torch.tensor(V3_BIAS))
    x = torch.zeros(len(Z), site.weight.shape[1])
    x[:, :8] = torch.tensor(Z)
    return model, site, x


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_semantics_by_hand(family: str) -> None:
    model, site, x = _fixed_router(family)
    with top_k(model, K):
        logits, weights, ids = site.router(x)  # the installed transformers' router
        ref_ids, ref_weights = route_site(site, logits)  # moelab's reference routing
    assert torch.allclose(logits.float(), torch.tensor(Z))
    for t, z in enumerate(Z):
        want = EXPECTED_IDS[family][t]
        for got_ids, got_w in ((ids[t], weights[t]), (ref_ids[t], ref_weights[t])):
            assert set(got_ids.tolist()) == want
            for i, w in zip(got_ids.tolist(), got_w.tolist(), strict=True):
                assert w == pytest.approx(_expected_weight(family, z, want, i), abs=1e-6)
    assert site.router.top_k == 2  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_by_hand(family: str) -> None:
    model, site, x = _fixed_router(family)
    with top_k(model, K), collect(model) as acc:
        site.router(x)
    res = acc.layers[0].result()
    want = EXPECTED_IDS[family]
    discarded = [
        1 - sum(_stats_probs(family, z)[i] for i in ids) for z, ids in zip(Z, want, strict=True)
    ]
    assert res["states"] == 3
    if family == "deepseek_v3":  # sigmoid scores have no fixed total: no discarded mass
        assert res["discarded_mass"] is None and res["discarded_mass_support_ge3"] is None
    else:
        assert res["discarded_mass"] == pytest.approx(sum(discarded) / 3, abs=1e-6)
        assert res["discarded_mass_support_ge3"] == pytest.approx(sum(discarded) / 3, abs=1e-6)
    assert res["contributors"] == 3 and res["active_experts"] == 3
    assert res["singleton_rate"] == 0 and res["pair_rate"] == 0  # full support
    load = [sum(i in ids for ids in want) for i in range(8)]
    mean = sum(load) / 8
    cv = math.sqrt(sum((v - mean) ** 2 for v in load) / 8) / mean
    assert res["nominal_cv"] == pytest.approx(cv) and res["contrib_cv"] == pytest.approx(cv)
    assert res["load_shares"] == pytest.approx([v / 9 for v in load])
    assert res["dead_experts"] == load.count(0)
    centred = [v - sum(z) / 8 for z in Z for v in z]
    rms = math.sqrt(sum(c * c for c in centred) / len(centred))
    assert res["score_rms"] == pytest.approx(rms, rel=1e-6)
    # top-2 logit gaps 0.2, 0.5, 1.0
    assert res["gap_p50"] == pytest.approx(0.5, abs=1e-3)
    assert res["frac_gap_ge1"] == pytest.approx(1 / 3) and res["frac_gap_ge2"] == 0
    assert res["threshold"] is None
    assert acc.map_name == ("sigmoid" if family == "deepseek_v3" else "softmax")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(tiny_text(), encoding="utf-8")
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_sweep_at_own_k_is_the_unmodified_model(family: str, tmp_path: Path, text: Path) -> None:
    model_dir = save_tiny(family, tmp_path / family)
    loaded = load_hf(model_dir)
    model, tokenizer = loaded
    result = hf_eval(model_dir, text, [1, 2], seq_len=64, loaded=loaded)
    # the reference: the model as loaded, its own loss, no moelab code in the forward
    total, n = 0.0, 0
    with torch.no_grad():
        for x in token_batches(tokenizer, read_texts(text), 64, 4):
            x = x.to(model.device)  # load_hf puts the model on the GPU when there is one
            out = model(input_ids=x, labels=x)
            total += float(out.loss) * x[:, 1:].numel()
            n += x[:, 1:].numel()
    rows = {r["top_k"]: r for r in result["results"]}
    assert result["trained_top_k"] == 2 and rows[2]["tokens"] == n
    assert rows[2]["nll"] == pytest.approx(total / n, abs=1e-6)
    assert abs(rows[1]["nll"] - rows[2]["nll"]) > 1e-6  # K=1 routes differently
    assert rows[1]["contributors"] == 1 and rows[2]["contributors"] == 2
    if family == "deepseek_v3":  # sigmoid scores: no retained mass
        assert rows[1]["retained_mass"] is None and rows[2]["retained_mass"] is None
    else:
        assert rows[1]["retained_mass"] < rows[2]["retained_mass"] < 1
    assert all(r.top_k == 2 for r in (s.router for s in moe_routers(model)))  # restored


def test_sweep_refuses_impossible_k(tmp_path: Path, text: Path) -> None:
    model_dir = save_tiny("deepseek_v3", tmp_path / "m")
    with pytest.raises(ValueError, match="top-k <= 4"):  # 2 of 4 groups of 2 experts
        hf_eval(model_dir, text, [5], seq_len=64)


def test_max_tokens_bounds_the_tokens(tmp_path: Path, text: Path) -> None:
    model_dir = save_tiny("mixtral", tmp_path / "m")
    res = hf_stats(model_dir, text, max_tokens=100, seq_len=32)
    assert res["tokens"] == 100 and res["mean"]["states"] == 200  # 2 layers
    full = hf_stats(model_dir, text, seq_len=32)
    assert full["tokens"] > 100


def _llama(path: Path) -> Path:
    import transformers as tf

    from tests.integrations import tiny_tokenizer

    cfg = tf.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_unsupported_model_names_the_families(tmp_path: Path) -> None:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
        )
    )
    with pytest.raises(UnsupportedModelError, match=r"supported: mixtral, qwen2_moe.*gpt_oss"):
        moe_routers(model)


# -- command line ----------------------------------------------------------------------


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_stats_and_eval(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny("qwen3_moe", tmp_path / "m")
    doc = _json(capsys, ["stats", "--hf", str(model_dir), "--data", str(text), "--json"])
    assert doc["run"] == str(model_dir) and doc["map"] == "softmax"
    assert set(FIELDS) <= set(doc["mean"]) and len(doc["layers"]) == 2
    assert [lay["layer"] for lay in doc["layers"]] == [0, 1]
    assert doc["mean"]["threshold"] is None and doc["mean"]["contributors"] == 2
    argv = ["eval", "--hf", str(model_dir), "--data", str(text.parent), "--top-k", "1", "2"]
    doc = _json(capsys, [*argv, "--json"])
    assert doc["run"] == str(model_dir) and doc["trained_top_k"] == 2
    assert [r["top_k"] for r in doc["results"]] == [1, 2]
    assert {"nll", "retained_mass", "contributors"} <= set(doc["results"][0])
    # the swap path: sparsemax routers from the same gate weights
    doc = _json(capsys, [*argv, "--map", "sparsemax", "--json"])
    assert doc["map"] == "sparsemax" and doc["results"][1]["contributors"] <= 2
    assert cli.main(["stats", "--hf", str(model_dir), "--data", str(text)]) == 0
    out = capsys.readouterr()
    assert "mean over MoE layers" in out.out and "discarded_mass" in out.out


def test_cli_user_errors(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def error(argv: list[str]) -> str:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"moelab {argv[0]}: error: ")
        return err[0]

    missing = str(tmp_path / "missing")
    assert "no such directory" in error(["stats", "--hf", missing, "--data", str(text)])
    dense = _llama(tmp_path / "llama")
    model_dir = save_tiny("mixtral", tmp_path / "m")
    capsys.readouterr()
    msg = error(["stats", "--hf", str(dense), "--data", str(text)])
    assert "'llama' is not a supported" in msg and "deepseek_v3" in msg
    assert "--data" in error(["stats", "--hf", str(model_dir)])
    assert "no such file" in error(["stats", "--hf", str(model_dir), "--data", missing])
    (model_dir / "config.json").rename(tmp_path / "config.json")
    assert "no config.json" in error(["stats", "--hf", str(model_dir), "--data", str(text)])
    (tmp_path / "config.json").rename(model_dir / "config.json")
    (model_dir / "tokenizer.json").unlink()
    assert "no tokenizer" in error(["stats", "--hf", str(model_dir), "--data", str(text)])
    assert "not both" in error(["eval", "R", "--hf", str(model_dir), "--top-k", "1"])
    assert "RUN, or --hf" in error(["stats"])
    argv = ["stats", "--hf", missing, "--data", str(text), "--max-tokens", "1"]
    assert "--max-tokens must be >= 2" in error(argv)  # before the model is read
    model_dir = save_tiny("mixtral", tmp_path / "m2")
    capsys.readouterr()
    assert "top-k must be in 1..8" in error(
        ["eval", "--hf", str(model_dir), "--data", str(text), "--top-k", "9"]
    )


@pytest.mark.parametrize(
    ("model_type", "family", "map_name"),
    [("flex_olmo", "generic", "softmax"), ("glm4_moe", "generic_sigmoid", "sigmoid")],
)
def test_other_families_through_their_routers(
    model_type: str, family: str, map_name: str, tmp_path: Path, text: Path
) -> None:
    """A family moelab does not name, whose routers return (logits, weights, indices):
    statistics and the sweep read the router's own choice."""
    import transformers as tf

    from tests.integrations import tiny_tokenizer

    kw = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    if model_type == "flex_olmo":
        cfg = tf.FlexOlmoConfig(**kw, num_experts=8)
    else:
        cfg = tf.Glm4MoeConfig(
            **kw, n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=0,
            n_group=1, topk_group=1,
        )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded = load_hf(tmp_path / "m")
    sites = moe_routers(loaded[0])
    assert len(sites) == 2 and sites[0].family.name == family
    res = hf_stats(tmp_path / "m", text, seq_len=64, loaded=loaded)
    assert res["map"] == map_name and res["mean"]["contributors"] == 2
    if map_name == "softmax":
        assert 0 < res["mean"]["discarded_mass"] < 1
    else:  # sigmoid scores have no fixed total: no discarded mass
        assert res["mean"]["discarded_mass"] is None
    sweep = hf_eval(tmp_path / "m", text, [1, 2], seq_len=64, loaded=loaded)
    assert sweep["results"][1]["nll"] == pytest.approx(res["nll"], abs=1e-6)
    assert sweep["results"][0]["contributors"] == 1


def test_text_streams_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading stops at --max-tokens: a long file is tokenised piece by piece."""
    from moelab.integrations.hf import stats
    from tests.integrations import tiny_tokenizer

    tok = tiny_tokenizer()
    calls = []

    class Counting:
        eos_token_id = tok.eos_token_id

        def __call__(self, text: str, **kw: object) -> object:
            calls.append(len(text))
            return tok(text, **kw)

    path = tmp_path / "long.txt"
    path.write_text(tiny_text(200), encoding="utf-8")  # ~60k characters, 200 lines
    monkeypatch.setattr(stats, "CHUNK_CHARS", 1000)
    batches = list(token_batches(Counting(), [path], 32, 2, max_tokens=100))
    assert sum(b.numel() for b in batches) == 100
    assert [tuple(b.shape) for b in batches] == [(2, 32), (1, 32), (1, 4)]
    assert 1 <= len(calls) <= 3 and max(calls) < 2000
    calls.clear()
    whole = list(token_batches(Counting(), [path], 32, 2))
    assert len(calls) >= 50  # every piece, then the EOS
    assert sum(b.numel() for b in whole) > 10_000


def test_missing_transformers_says_which_extra(
    tmp_path: Path, text: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny("olmoe", tmp_path / "m")
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    assert cli.main(["stats", "--hf", str(model_dir), "--data", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab stats: error: ") and "pip install 'moelab[hf]'" in err


def _stats_of(model, batches, pending: int, monkeypatch) -> dict:
    import moelab.integrations.hf.stats as stats

    monkeypatch.setattr(stats, "PENDING_ELEMENTS", pending)
    with collect(model) as acc:
        with torch.no_grad():
            for x in batches:
                model(input_ids=x, use_cache=False)
    return acc.result()


def test_held_router_outputs_give_the_statistics_of_each_forward_alone(monkeypatch) -> None:
    # collect holds the router outputs and adds them in one go; adding after every forward
    # (pending 1) and after all of them (pending 2**30) must give the same statistics
    model = tiny_model("mixtral").eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, model.config.vocab_size, (2, 12), generator=g) for _ in range(3)]
    each = _stats_of(model, batches, 1, monkeypatch)
    held = _stats_of(model, batches, 1 << 30, monkeypatch)
    assert [lay["states"] for lay in held["layers"]] == [3 * 2 * 12] * 2
    for a, b in zip(each["layers"], held["layers"], strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float) and not math.isnan(value):
                assert b[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
            else:
                assert b[key] == value or (value != value and b[key] != b[key]), key


def test_a_router_output_changed_in_place_after_the_hook_is_read_as_it_was(monkeypatch) -> None:
    model = tiny_model("mixtral").eval()
    x = torch.randint(
        0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4)
    )
    want = _stats_of(model, [x], 1, monkeypatch)
    sites = moe_routers(model)

    def scribble(module, args, output):  # registered after collect's hook: runs after it
        for t in output:
            if torch.is_tensor(t) and t.is_floating_point():
                t.mul_(0.0).add_(7.0)

    import moelab.integrations.hf.stats as stats

    monkeypatch.setattr(stats, "PENDING_ELEMENTS", 1 << 30)
    with collect(model) as acc:
        handles = [s.router.register_forward_hook(scribble) for s in sites]
        with torch.no_grad():
            model(input_ids=x, use_cache=False)
        for h in handles:
            h.remove()
    got = acc.result()
    assert got["layers"][0]["gap_p50"] == pytest.approx(want["layers"][0]["gap_p50"])
    assert got["layers"][0]["discarded_mass"] == pytest.approx(want["layers"][0]["discarded_mass"])


def test_a_failed_block_drops_what_was_held_and_removes_the_hooks(monkeypatch) -> None:
    import moelab.integrations.hf.stats as stats

    model = tiny_model("mixtral").eval()
    sites = moe_routers(model)
    monkeypatch.setattr(stats, "PENDING_ELEMENTS", 1 << 30)
    x = torch.randint(0, model.config.vocab_size, (1, 6))
    with pytest.raises(KeyboardInterrupt), collect(model) as acc:
        with torch.no_grad():
            model(input_ids=x, use_cache=False)
        raise KeyboardInterrupt
    assert all(layer.n_states == 0 for layer in acc.layers)
    assert all(not s.router._forward_hooks for s in sites)
