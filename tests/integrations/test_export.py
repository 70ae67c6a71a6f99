"""moelab export (moelab.integrations.hf.export): tiny runs of several routers written as
transformers folders, loaded back with AutoModelForCausalLM (the native qwen2_moe folders
without custom code, the remote ones with trust_remote_code), and compared with moelab's
own model: float32 logits to 1e-5, greedy generation, the tokenizer's ids, the
lm-evaluation-harness's own hf model; the CLI's output and its one-line errors; the
native path's strict conditions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from moelab.cli import main
from moelab.diagnostics import load_run
from moelab.integrations.hf.export import (
    MARKER,
    ExportCheckError,
    export_run,
    native_obstacle,
)
from moelab.model import ModelConfig, Transformer
from moelab.train import train
from tests.train import TINY_MODEL, make_corpus, tiny_config

ROUTERS: dict[str, tuple[dict[str, Any], str]] = {
    # name: (model overrides of TINY_MODEL, the format auto must choose)
    "softmax": ({"router": {"renorm": False}}, "native"),
    "renorm_shared_gate": (
        {"router": {"renorm": True}, "n_shared_experts": 2, "shared_gate": True},
        "native",
    ),
    "all_shared_no_gate": (
        {"moe_layers": "all", "n_shared_experts": 1, "router": {"renorm": True}},
        "native",
    ),
    "list_layers": ({"n_layers": 3, "moe_layers": [0, 2], "router": {"top_k": 1}}, "native"),
    # rotary tables over 512 positions (float32 in transformers, float64 in moelab)
    "long_positions": ({"max_seq_len": 512, "router": {"renorm": True}}, "native"),
    "sparsemax": ({"router": {"map": "sparsemax"}}, "remote"),
    "entmax": ({"router": {"map": "entmax", "alpha": 1.5}}, "remote"),
    "lapsum": ({"router": {"map": "lapsum", "lapsum_k": 2.0}}, "remote"),
    "null_experts": ({"router": {"n_null_experts": 2, "renorm": True}}, "remote"),
    "hash": ({"router": {"selection": "hash"}}, "remote"),
}
"""The routers exported: their model overrides and the format ``auto`` must pick."""

pytestmark = pytest.mark.filterwarnings(
    # a native folder without shared experts has width-0 shared matrices
    "ignore:Initializing zero-element tensors:UserWarning"
)

L = TINY_MODEL["max_seq_len"]
PROMPT = "The cat sees the book"


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny run per router of :data:`ROUTERS`, trained 3 steps, built on demand."""

    class Runs(dict):
        def __missing__(self, name: str) -> Path:
            overrides, _ = ROUTERS[name]
            model = {**TINY_MODEL, **overrides}
            router = {"top_k": 2, **overrides.get("router", {})}
            model["router"] = router
            out = tmp_path_factory.mktemp("runs") / name
            kw = dict(steps=3, eval_batches=1, model=model, top_k=router["top_k"])
            train(tiny_config(corpus, out, **kw))
            self[name] = out
            return out

    return Runs()


@pytest.fixture(scope="module")
def exported(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """export_run(format="auto") of each run, on demand: name -> ExportResult."""

    class Exports(dict):
        def __missing__(self, name: str) -> Any:
            result = export_run(runs[name], tmp_path_factory.mktemp("hf") / name)
            self[name] = result
            return result

    return Exports()


def _load(folder: Path, remote: bool) -> Any:
    """AutoModelForCausalLM of ``folder`` in float32; asserts that transformers found
    every weight and no other (no missing, unexpected or mismatched keys)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=remote, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, info
    return model.eval()


def _ids(vocab: int, shape: tuple[int, int] = (3, L), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _greedy(model: Transformer, ids: list[int], n: int, eos: int) -> list[int]:
    """n greedy tokens of moelab's model after ``ids`` (stopping after eos)."""
    out = list(ids)
    for _ in range(n):
        nxt = int(model(torch.tensor([out])).logits_BSV[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
    return out


@pytest.mark.parametrize("name", list(ROUTERS))
def test_export_loads_and_matches_moelab(name: str, runs, exported) -> None:
    from transformers import AutoTokenizer

    result = exported[name]
    want_format = ROUTERS[name][1]
    assert result.format == want_format
    remote = want_format == "remote"
    folder = result.path
    py = sorted(p.name for p in folder.glob("*.py"))
    if remote:
        assert py == ["configuration_moelab.py", "modeling_moelab.py"]
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["model_type"] == "moelab" and "AutoModelForCausalLM" in cfg["auto_map"]
        assert result.reason and "router." in result.reason
        from transformers.utils import HF_MODULES_CACHE

        # the exporter's own reload of its temporary leaves no module copy behind
        cached = Path(HF_MODULES_CACHE) / "transformers_modules"
        assert not list(cached.glob(f"{folder.name}_moelab_export_tmp*"))
    else:
        assert py == []
        assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2_moe"
    readme = (folder / "README.md").read_text()
    assert f'from_pretrained("{folder.name}"' in readme and "_tmp" not in readme
    assert json.loads((folder / MARKER).read_text())["path"] == str(folder)
    assert result.max_abs_diff <= 1e-4

    loaded = load_run(runs[name])
    ours = loaded.model.float().eval()
    hf = _load(folder, remote)
    assert type(hf).__name__ == ("MoelabForCausalLM" if remote else "Qwen2MoeForCausalLM")
    if not remote:  # qwen2_moe's q/k/v biases, exactly 0
        biases = [p for n, p in hf.named_parameters() if n.endswith("_proj.bias")]
        assert len(biases) == 3 * ours.config.n_layers and all(not b.any() for b in biases)
    ids = _ids(ours.config.vocab_size, (2, ours.config.max_seq_len))
    with torch.no_grad():
        want = ours(ids).logits_BSV
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    assert prompt[0].tolist() == loaded.tokenizer.encode(PROMPT)
    gen = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    eos = loaded.tokenizer.eos_id
    assert gen[0].tolist() == _greedy(ours, prompt[0].tolist(), 8, eos)


def test_tokenizer_gives_moelab_ids(runs, exported) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported["softmax"].path)
    ours = load_run(runs["softmax"]).tokenizer
    for text in ["A small bird\tcarries  the bread.", "text with <|endoftext|> inside", "ü 🙂"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == ours.encode(text)
        assert tok.decode(ids) == ours.decode(ids) == text
    assert tok.eos_token_id == ours.eos_id


def test_lm_eval_hf_model_matches_moelab_harness_model(runs, exported) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip(
        "accelerate",
        reason="accelerate is not installed (lm-evaluation-harness's hf model needs it)",
    )
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from moelab.integrations.lm_eval import MoelabLM

    requests = [
        Instance("loglikelihood", {}, (ctx, cont), i, metadata=("t", i, 1))
        for i, (ctx, cont) in enumerate(
            [("The cat sees the book in the", " morning"), ("A dog", " likes the garden.")]
        )
    ]
    for name in ("renorm_shared_gate", "sparsemax"):  # a native and a remote folder
        ours = MoelabLM(loaded=load_run(runs[name]), batch_size=2)
        theirs = HFLM(
            pretrained=str(exported[name].path),
            backend="causal",
            device="cpu",
            dtype="float32",
            batch_size=2,
            trust_remote_code=exported[name].format == "remote",
        )
        for (a, ga), (b, gb) in zip(
            ours.loglikelihood(requests), theirs.loglikelihood(requests), strict=True
        ):
            assert a == pytest.approx(b, abs=1e-5) and ga == gb


def test_cli_prints_what_it_wrote_and_how_to_load_it(runs, tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(runs["softmax"]), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"to {out}" in text and "native Qwen2MoeForCausalLM" in text
    assert f"AutoModelForCausalLM.from_pretrained({str(out)!r})" in text
    assert "checked: reloaded with transformers" in text
    # again into the same folder (a previous export), remote, as JSON
    assert main(["export", str(runs["softmax"]), "--out", str(out), "--format", "remote",
                 "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "remote" and doc["architecture"] == "MoelabForCausalLM"
    assert "trust_remote_code=True" in doc["loading_code"]
    assert "modeling_moelab.py" in doc["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moelab export: error: "), err
    return err


def test_cli_errors_are_one_line(runs, tmp_path, capsys) -> None:
    soft, sparse = str(runs["softmax"]), str(runs["sparsemax"])
    err = _error(["export", soft, "--out", str(tmp_path / "a"), "--step", "99"], capsys)
    assert "no checkpoint of step 99 (steps it has: 3)" in err
    err = _error(["export", sparse, "--out", str(tmp_path / "b"), "--format", "native"], capsys)
    assert "router.map = 'sparsemax'" in err and "--format remote" in err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    err = _error(["export", soft, "--out", str(foreign)], capsys)
    assert "not empty and not a moelab export" in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    err = _error(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "c")], capsys)
    assert "does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_failed_check_keeps_nothing(runs, tmp_path, monkeypatch) -> None:
    from moelab.integrations.hf import export

    monkeypatch.setattr(export, "CHECK_ATOL", -1.0)  # every difference is too large
    with pytest.raises(ExportCheckError, match="nothing was written"):
        export_run(runs["softmax"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def _tiny(**router: Any) -> Transformer:
    keys = dict(TINY_MODEL, vocab_size=50, router={"top_k": 2, **router})
    return Transformer(ModelConfig(**keys)).eval()


@pytest.mark.parametrize(
    ("router", "named"),
    [
        ({"map": "sparsemax"}, "router.map = 'sparsemax'"),
        ({"temperature": 2.0}, "router.temperature = 2.0"),
        ({"capacity_factor": 1.0}, "router.capacity_factor = 1.0"),
        ({"scorer_bias": True}, "router.scorer_bias = True"),
        ({"n_null_experts": 1}, "router.n_null_experts = 1"),
        ({"routed_scaling": 2.0}, "router.routed_scaling = 2.0"),
        ({"straight_through": True}, "router.gate = 'straight_through'"),
        ({"selection": "top_p"}, "router.selection = 'top_p'"),
        ({"n_groups": 2, "topk_groups": 1}, "router.n_groups = 2"),
    ],
)
def test_native_is_refused_for_any_routing_change(router: dict, named: str) -> None:
    assert named in (native_obstacle(_tiny(**router)) or "")


def test_native_conditions_read_the_routers_state() -> None:
    assert native_obstacle(_tiny()) is None
    assert native_obstacle(_tiny(aux_weight=0.1, noise_std=0.5, jitter=0.05, init_std=0.01)) is None
    model = _tiny()
    model.moe_layers[0].router.bias[0] = 0.5  # a moved selection bias
    assert "selection bias" in native_obstacle(model)
    model = _tiny()
    model.moe_layers[0].router.temperature.tau.fill_(0.5)
    assert "tau = 0.5" in native_obstacle(model)
    model = _tiny()
    model.moe_layers[0].router.top_k = 1  # an inference budget: still one K, exported
    assert native_obstacle(model) is None


def test_remote_folder_says_it_needs_moelab(exported) -> None:
    folder = exported["sparsemax"].path
    code = (folder / "modeling_moelab.py").read_text()
    assert "raise ImportError(" in code and "moelab must be installed" in code
    readme = (folder / "README.md").read_text()
    assert "needs moelab" in readme and "trust_remote_code=True" in readme
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["moelab_model"]["router"]["map"] == "sparsemax"
    assert cfg["moelab_extra_state"] == {
        "blocks.1.ff.router._extra_state": {"top_k": 2, "truncation": 0.0}
    }
