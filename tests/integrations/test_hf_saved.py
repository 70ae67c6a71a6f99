"""Saving a swapped Hugging Face model (moelab.integrations.hf.saved): save_swapped then
load_swapped gives the same logits and Router state bit for bit, for every family and
for non-default Routers (sparse maps, a loss-free bias moved by training, temperature
schedules, null experts); the folder is a plain transformers folder that loads with no
missing or unexpected key; mismatched or foreign folders are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.integrations import tiny_model

pytest.importorskip("transformers")

import transformers as tf

from moelab.integrations.hf import saved as saved_mod
from moelab.integrations.hf.saved import ROUTERS_JSON, ROUTERS_WEIGHTS, load_swapped, save_swapped
from moelab.integrations.hf.swap import (
    SWAP_FAMILIES,
    DeepseekV2Groups,
    moelab_aux_loss,
    step_swapped,
    swap_routers,
    swapped_routers,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 12)) -> torch.Tensor:
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _assert_same_routers(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ra, rb = swapped_routers(a), swapped_routers(b)
    assert len(ra) == len(rb) > 0
    for x, y in zip(ra, rb, strict=True):
        assert x.router.config == y.router.config
        assert type(x.router.selection) is type(y.router.selection)
        sx, sy = x.router.state_dict(), y.router.state_dict()
        assert sx.keys() == sy.keys()
        for key, value in sx.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sy[key]), key
            else:
                assert value == sy[key], key


def _plain_load(path):
    model, info = tf.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_default_swap_round_trip(tmp_path, family: str) -> None:
    model = tiny_model(family)
    original = _logits(model)
    swap_routers(model)
    swapped = _logits(model)
    model.save_pretrained(tmp_path / "m")  # the swap binds it to save_swapped
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert {"config.json", "model.safetensors", ROUTERS_JSON, ROUTERS_WEIGHTS} <= set(names)
    loaded = load_swapped(tmp_path / "m")
    assert torch.equal(_logits(loaded), swapped)
    _assert_same_routers(model, loaded)
    if family == "deepseek_v2":  # the tiny model's group-limited greedy choice
        rules = [type(r.router.selection) for r in swapped_routers(loaded)]
        assert rules == [DeepseekV2Groups] * 2
    plain = _plain_load(tmp_path / "m")
    assert not swapped_routers(plain)
    torch.testing.assert_close(_logits(plain), swapped, atol=1e-6, rtol=0)
    assert torch.equal(_logits(plain), original)  # the weights are the model's own


def _train(model: torch.nn.Module, steps: int = 3) -> None:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids(2, (2, 16))
    for _ in range(steps):
        out = model(ids, labels=ids)
        loss = out.loss + moelab_aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_swapped(model)
    model.eval()


NON_DEFAULT = [
    ("mixtral", dict(map="sparsemax", renorm=False), 0),
    ("qwen3_moe", dict(map="entmax", alpha=1.5, selection="threshold", truncation=0.05), 0),
    ("deepseek_v3", dict(bias_rate=0.05), 3),
    ("gpt_oss", dict(temperature=2.0, schedule="cosine", tau_final=0.5, anneal_steps=4), 2),
    ("mixtral", dict(schedule="lipschitz", lipschitz_target=2.0, n_null_experts=2), 2),
]


@pytest.mark.parametrize(
    ("family", "keys", "steps"), NON_DEFAULT, ids=lambda c: str(c) if isinstance(c, str) else None
)
def test_non_default_round_trip(tmp_path, family: str, keys: dict, steps: int) -> None:
    model = tiny_model(family)
    routers = swap_routers(model, **keys)
    if steps:
        _train(model, steps)
    r0 = routers[0].router
    if "bias_rate" in keys:
        assert r0.bias.abs().sum() > 0  # the loss-free bias moved
    if keys.get("schedule"):
        assert int(r0.temperature.step) == steps
        assert float(r0.temperature.tau) != keys.get("temperature", 1.0)
    swapped = _logits(model)
    save_swapped(model, tmp_path / "m")
    loaded = load_swapped(tmp_path / "m")
    assert torch.equal(_logits(loaded), swapped)
    _assert_same_routers(model, loaded)
    # the plain folder holds the Routers' current weights for the E real experts
    plain = _plain_load(tmp_path / "m")
    hf = dict(plain.named_parameters()) | dict(plain.named_buffers())
    doc = json.loads((tmp_path / "m" / ROUTERS_JSON).read_text())
    for entry, swapped_router in zip(doc["layers"], routers, strict=True):
        r = swapped_router.router
        assert torch.equal(hf[entry["name"] + ".weight"], r.weight[:8].detach())
        if family == "deepseek_v3":
            assert torch.equal(hf[entry["name"] + ".e_score_correction_bias"], r.bias[:8])
        assert entry["config"] == {**entry["config"], **keys}


def test_the_routers_json(tmp_path) -> None:
    model = tiny_model("mixtral")
    routers = swap_routers(model, map="entmax", alpha=1.5)
    routers[0].top_k = 3
    save_swapped(model, tmp_path / "m")
    doc = json.loads((tmp_path / "m" / ROUTERS_JSON).read_text())
    assert doc["format_version"] == saved_mod.FORMAT_VERSION and doc["family"] == "mixtral"
    assert [x["name"] for x in doc["layers"]] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    assert doc["layers"][0]["state"]["_extra_state"]["top_k"] == 3
    assert doc["layers"][0]["config"]["alpha"] == 1.5
    assert "l1_sparsity" in doc["not_saved"]
    assert sorted(doc["files"]) == sorted(p.name for p in (tmp_path / "m").iterdir())
    assert swapped_routers(load_swapped(tmp_path / "m"))[0].top_k == 3


def test_refusals(tmp_path) -> None:
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="no swapped router"):
        save_swapped(model, tmp_path / "plain")
    swap_routers(model)
    # a folder with files save_swapped did not write
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("mine")
    with pytest.raises(FileExistsError, match=r"thesis\.tex"):
        model.save_pretrained(tmp_path / "busy")
    assert (tmp_path / "busy" / "thesis.tex").read_text() == "mine"
    # a previous save is replaced, but not once something else was put beside it
    save_swapped(model, tmp_path / "m")
    save_swapped(model, tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        save_swapped(model, tmp_path / "m")
    (tmp_path / "m" / "notes.txt").unlink()
    (tmp_path / "git").mkdir()
    (tmp_path / "git" / ".git").mkdir()  # dot files count: saving replaces the folder
    with pytest.raises(FileExistsError, match=r"\.git"):
        save_swapped(model, tmp_path / "git")
    # a json naming another layer count: one clear error, nothing swapped
    doc = json.loads((tmp_path / "m" / ROUTERS_JSON).read_text())
    doc["layers"] = doc["layers"][:1]
    (tmp_path / "m" / ROUTERS_JSON).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="holds 1 MoE layers, the model has 2"):
        load_swapped(tmp_path / "m")
    # a renamed layer
    save_swapped(model, tmp_path / "m")
    doc = json.loads((tmp_path / "m" / ROUTERS_JSON).read_text())
    doc["layers"][1]["name"] = "model.layers.1.mlp.router"
    (tmp_path / "m" / ROUTERS_JSON).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="router names differ"):
        load_swapped(tmp_path / "m")
    # router tensors of another shape (a config with null experts the tensors lack)
    save_swapped(model, tmp_path / "m")
    doc = json.loads((tmp_path / "m" / ROUTERS_JSON).read_text())
    doc["layers"][0]["config"]["n_null_experts"] = 2
    (tmp_path / "m" / ROUTERS_JSON).write_text(json.dumps(doc))
    shapes = r"layer_00\.weight has shape \(8, 64\), the Router \(10, 64\)"
    with pytest.raises(ValueError, match=shapes):
        load_swapped(tmp_path / "m")
    # a plain transformers folder, and a newer format
    tf.AutoModelForCausalLM.from_config(model.config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="not a folder written by save_swapped"):
        load_swapped(tmp_path / "hf")
    doc["format_version"] = 99
    (tmp_path / "m" / ROUTERS_JSON).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="upgrade moelab"):
        load_swapped(tmp_path / "m")


def test_a_failed_save_leaves_no_folder(tmp_path, monkeypatch) -> None:
    model = tiny_model("mixtral")
    swap_routers(model)
    save_swapped(model, tmp_path / "old")
    before = sorted(p.name for p in (tmp_path / "old").iterdir())

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saved_mod, "write_json", crash)
    for target in ("new", "old"):
        with pytest.raises(OSError, match="disk full"):
            save_swapped(copy.deepcopy(model), tmp_path / target)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no staging left behind


def test_the_docs_example(tmp_path, monkeypatch, capsys) -> None:
    from tests._docs import page_code
    from tests.integrations import save_tiny, tiny_text

    path = save_tiny("mixtral", tmp_path / "tiny-mixtral")
    tok = tf.AutoTokenizer.from_pretrained(path)
    monkeypatch.chdir(tmp_path)
    code = page_code("huggingface.md", "from moelab.integrations.hf.saved import load_swapped\n")
    scope = dict(
        tf=tf,
        torch=torch,
        path=path,
        ids=tok(tiny_text(), return_tensors="pt").input_ids[:, :64],
        swap_routers=swap_routers,
        moelab_aux_loss=moelab_aux_loss,
        step_swapped=step_swapped,
    )
    exec(compile(code, "docs/huggingface.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "reloaded == saved: True" in out
    assert "max |logits diff| 0.0971" in out  # the page's output
    assert sorted(p.name for p in (tmp_path / "tiny-mixtral-entmax").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        ROUTERS_JSON,
        ROUTERS_WEIGHTS,
    ]


def test_bfloat16_round_trip(tmp_path) -> None:
    from tests.integrations import save_tiny

    save_tiny("deepseek_v3", tmp_path / "tiny")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.bfloat16)
    swap_routers(model, map="sparsemax")  # float32 Routers in a bfloat16 model
    model.save_pretrained(tmp_path / "m")
    loaded = load_swapped(tmp_path / "m", dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(_logits(loaded), _logits(model))
    _assert_same_routers(model, loaded)


def _changed(family: str = "mixtral", **keys) -> torch.nn.Module:
    """A tiny model of ``family`` swapped with ``keys``, its Routers' weights moved off the
    HF ones (as fine-tuning would)."""
    from tests.integrations import FAMILIES
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_model(family) if family in FAMILIES else tiny_family_model(family)
    with torch.no_grad():
        for r in swap_routers(model, **keys):
            r.router.weight.add_(0.1 * torch.randn_like(r.router.weight))
    return model


def _ours(record) -> list[str]:
    return [str(w.message) for w in record if "load_swapped" in str(w.message)]


def test_save_pretrained_of_another_routing_keeps_it_and_says_how_to_load_it(tmp_path) -> None:
    """Issue 39, item 8: the folder of a swapped model's save_pretrained reloads with the
    moelab routers through load_swapped, bit for bit; transformers' own from_pretrained
    gives the family's routing, and the save says so instead of dropping them silently."""
    model = _changed(map="entmax", alpha=1.5)
    want = _logits(model)
    with pytest.warns(UserWarning, match="load_swapped") as record:
        model.save_pretrained(tmp_path / "m")
    (message,) = _ours(record)
    assert "2 of the 2 MoE layers" in message and "map='entmax'" in message
    assert "alpha=1.5" in message and "mixtral's own routing" in message
    assert str(tmp_path / "m") in message
    assert torch.equal(_logits(load_swapped(tmp_path / "m")), want)
    assert (_logits(_plain_load(tmp_path / "m")) - want).abs().max() > 1e-3
    # a top_k set after the swap is routing that a plain load does not have either
    model = _changed()
    swapped_routers(model)[1].top_k = 3
    with pytest.warns(UserWarning, match="load_swapped") as record:
        save_swapped(model, tmp_path / "k")
    assert "1 of the 2 MoE layers" in _ours(record)[0] and "top_k=3" in _ours(record)[0]
    # Mixtral has no selection bias of its own: a moved one is lost in a plain load
    model = _changed(bias_rate=0.05)
    _move_bias(model)
    with pytest.warns(UserWarning, match="load_swapped") as record:
        save_swapped(model, tmp_path / "b")
    assert "the selection bias" in _ours(record)[0]


def _move_bias(model: torch.nn.Module) -> None:
    """Move the swapped Routers' selection bias, as loss-free balancing would."""
    with torch.no_grad():
        for r in swapped_routers(model):
            r.router.bias.add_(0.05 * torch.randn_like(r.router.bias))


SAME_ROUTING = [
    ("mixtral", {}),
    ("mixtral", {"aux_weight": 0.1, "z_loss_weight": 0.01}),  # training-only keys
    ("deepseek_v3", {"bias_rate": 0.05}),  # its selection bias is saved in the model
    ("qwen3_next", {}),
]


@pytest.mark.parametrize(("family", "keys"), SAME_ROUTING, ids=str)
def test_saving_the_familys_own_routing_says_nothing(tmp_path, recwarn, family, keys) -> None:
    """A swap that routes as the family's rule on fine-tuned weights (and a moved
    DeepSeek-V3 correction bias): a plain from_pretrained routes as the Routers do, so
    the save has nothing to warn about."""
    model = _changed(family, **keys)
    if "bias_rate" in keys:
        _move_bias(model)
    model.save_pretrained(tmp_path / "m")
    assert not _ours(recwarn)
    plain = _plain_load(tmp_path / "m")
    with torch.no_grad():
        ids = _ids()
        a = plain(ids, use_cache=False).logits
        b = model(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _saved_folder(tmp_path, **keys):
    """(folder, text, the swapped model saved there): a tiny Mixtral swapped with ``keys``
    and moved off its HF router weights, saved by its save_pretrained with the tiny
    tokenizer beside it, and a text file."""
    import warnings

    from tests.integrations import tiny_text, tiny_tokenizer

    model = _changed(**keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text(tiny_text())
    return tmp_path / "m", tmp_path / "t.txt", model


def _nll64(model: torch.nn.Module, folder, text) -> float:
    """The mean next-token NLL of the whole text (one window: the tiny text is shorter
    than the window) as one document followed by EOS, in float64."""
    tok = tf.AutoTokenizer.from_pretrained(folder)
    ids = [*tok(text.read_text(), add_special_tokens=False).input_ids, tok.eos_token_id]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits.double()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return float(-logp.gather(1, x[0, 1:, None]).mean())


def test_moelab_reads_a_saved_swapped_folder_with_its_routers(tmp_path, capsys) -> None:
    """Issue 39, item 8: ``moelab stats --hf`` and ``moelab eval --hf`` of a folder saved
    from a swapped model measure the saved moelab routers (its map, its weights), not
    the family's own routing; the commands that read only the model's own routers
    refuse it in one line."""
    from moelab import cli

    folder, text, model = _saved_folder(tmp_path, map="entmax", alpha=1.5)
    own = _nll64(model, folder, text)
    plain = _nll64(_plain_load(folder), folder, text)
    assert abs(plain - own) > 1e-4  # the two routings tell apart
    capsys.readouterr()
    assert cli.main(["stats", "--hf", str(folder), "--data", str(text), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["map"], st["alpha"], st["top_k"]) == ("entmax", 1.5, 2)
    assert st["nll"] == pytest.approx(own, rel=1e-6)
    assert [x["name"] for x in st["layers"]] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    argv = ["eval", "--hf", str(folder), "--data", str(text), "--top-k", "1", "2", "--json"]
    assert cli.main(argv) == 0
    ev = json.loads(capsys.readouterr().out)
    assert (ev["map"], ev["trained_top_k"]) == ("entmax", 2)
    nll = {r["top_k"]: r["nll"] for r in ev["results"]}
    assert nll[2] == pytest.approx(own, rel=1e-6)
    for r in swapped_routers(model):
        r.top_k = 1
    assert nll[1] == pytest.approx(_nll64(model, folder, text), rel=1e-6)
    # the human output says whose routing it read
    assert cli.main(["stats", "--hf", str(folder), "--data", str(text)]) == 0
    assert "moelab routers" in capsys.readouterr().out.splitlines()[0]
    # --map on routers that are moelab's already
    assert cli.main([*argv[:-1], "--map", "sparsemax"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moelab eval: error: ")
    assert ROUTERS_JSON in err[0] and "--map" in err[0]
    # analyze hooks the saved moelab Routers too (their map, not the family's routing)
    argv = ["analyze", "coactivation", "--hf", str(folder), "--data", str(text)]
    argv += ["--out", str(tmp_path / "analysis"), "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["map"], doc["alpha"], doc["top_k"], doc["n_layers"]) == ("entmax", 1.5, 2, 2)
