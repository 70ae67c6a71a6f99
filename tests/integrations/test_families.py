"""Every MoE family of the installed transformers, on a tiny random model of it: the
statistics (every router's choice and weights against the family's written-out rule),
the budget sweep (the model's own K leaves NLL as it was; another K is applied or
refused), the router swap (logits equal to 1e-5) and one fine-tuning step, or moelab's
one-line refusal; and docs/huggingface.md's family table equal to these rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moelab.integrations.hf.families import moe_model_types
from tests.integrations import family_matrix as fm

TYPES = moe_model_types()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("families"))


def _docs_rows() -> dict[str, list[str]]:
    text = fm.docs_table()
    assert text is not None, f"{fm.DOCS} has no family table between {fm.BEGIN} and {fm.END}"
    rows = {}
    for line in text.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_enumeration_finds_the_known_families() -> None:
    named = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"}
    assert named | {"gpt_oss", "llama4_text", "longcat_flash", "phimoe", "qwen3_next"} <= set(TYPES)
    assert "llama" not in TYPES and "qwen2" not in TYPES  # dense families are not listed


@pytest.mark.parametrize("model_type", TYPES)
def test_family(model_type: str, tmp: str) -> None:
    row = fm.family_row(model_type, tmp)
    docs = _docs_rows()
    assert model_type in docs, (
        f"{model_type} is missing from the family table: run python -m "
        "tests.integrations.family_matrix"
    )
    assert docs[model_type] == [fm._cell(c) for c in row], (
        f"docs/huggingface.md's row of {model_type} is stale: run python -m "
        "tests.integrations.family_matrix"
    )


def test_the_table_lists_every_family_once() -> None:
    assert sorted(_docs_rows()) == sorted(TYPES)


def test_supported_families_grew() -> None:
    """The families whose statistics, sweep and swap all work: the seven named ones and
    the ones whose rule is written out (Llama 4, LongCat-Flash, Qwen3-Next, ...)."""
    rows = _docs_rows()
    full = [mt for mt, r in rows.items() if r[:3] == ["yes", "yes", "yes"]]
    for mt in ("mixtral", "deepseek_v3", "llama4_text", "longcat_flash", "qwen3_next"):
        assert mt in full
    assert rows["phimoe"][0] == "yes" and rows["phimoe"][2].startswith("refused: ")


def test_hybrid_model_without_full_attention_runs_without_a_cache(tmp_path: Path) -> None:
    """A Qwen3-Next with linear-attention layers only: transformers' default cache fails
    on it, and moelab's passes use none."""
    from moelab.integrations.hf.stats import hf_stats
    from tests.integrations import tiny_tokenizer
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_family_model("qwen3_next", layer_types=["linear_attention"] * 2)
    ids = torch.randint(3, 300, (1, 8))
    with pytest.raises(Exception, match=r"get_seq_length|Attention layers"):
        with torch.no_grad():
            model(input_ids=ids)  # the default: a cache
    data = tmp_path / "t.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    res = hf_stats("q", data, loaded=(model, tiny_tokenizer()), seq_len=16)
    assert res["family"] == "generic" and len(res["layers"]) == 2


def test_sparse_mixer_rule_against_phimoe() -> None:
    """PhiMoE's router in eval mode against the written-out sparse mixer on logits with
    ties inside and outside the 2 eps band (hand-built)."""
    from moelab.integrations.hf import rules
    from moelab.integrations.hf.families import moe_routers
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_family_model("phimoe")
    site = moe_routers(model)[0]
    assert site.rule is not None and site.rule.scores == "sparsemixer"
    eps = site.rule.jitter_eps
    z = torch.tensor([[1.0, 1.0 - eps, 0.5, -1.0], [2.0, 0.1, 1.99, 1.90]])
    ids, w = rules.apply_rule(site.rule, z, 2)
    # e1 = argmax; its weight is the softmax over the experts j with
    # (z_e1 - z_j) / max(|z_j|, z_e1) <= 2 eps: row 0 keeps expert 1 (gap eps), row 1
    # expert 2 (gap 0.005); e2 = the next best, alone in its band (gaps 0.49, 0.045)
    p0 = torch.softmax(torch.tensor([1.0, 1.0 - eps]), -1)[0]
    p1 = torch.softmax(torch.tensor([2.0, 1.99]), -1)[0]
    assert ids.tolist() == [[0, 1], [0, 2]]
    assert w[:, 0].tolist() == pytest.approx([float(p0), float(p1)], abs=1e-6)
    assert w[:, 1].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)


def test_refused_family_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moelab import cli
    from tests.integrations import tiny_tokenizer
    from tests.integrations.tiny_families import tiny_family_model

    refused = [mt for mt, r in _docs_rows().items() if r[0].startswith("refused: ")]
    assert refused, "no family is refused: pick another check"
    mt = refused[0]
    folder = tmp_path / mt
    tiny_family_model(mt).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = tmp_path / "t.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    capsys.readouterr()
    assert cli.main(["stats", "--hf", str(folder), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moelab stats: error: ")


@pytest.mark.parametrize("model_type", ["qwen3_next", "llama4_text", "longcat_flash"])
def test_swapped_family_saves_and_loads_back(model_type: str, tmp_path: Path) -> None:
    """A family swapped through its written-out rule (sparsemax routers) round-trips
    through save_pretrained / load_swapped exactly, LongCat's zero-expert rows included."""
    from moelab.integrations.hf.saved import load_swapped
    from moelab.integrations.hf.swap import swap_routers
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_family_model(model_type)
    swap_routers(model, map="sparsemax")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(tmp_path / "s")
    back = load_swapped(tmp_path / "s")
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, use_cache=False).logits, ref)


def test_a_family_whose_own_code_fails_at_another_k_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """LongCat-Flash's experts in transformers 5.24 fail at K = 1 (a squeeze of the slot
    dimension); the sweep says the family's code failed at that K, naming it."""
    from moelab.integrations.hf.families import UnsupportedModelError
    from moelab.integrations.hf.sweep import hf_eval
    from tests.integrations import tiny_tokenizer
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_family_model("longcat_flash")
    data = tmp_path / "t.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    loaded = (model, tiny_tokenizer())
    try:
        res = hf_eval("lc", data, [2, 3], seq_len=16, loaded=loaded)
    except UnsupportedModelError as err:  # pragma: no cover - another transformers
        pytest.fail(f"K = 2, 3 should run: {err}")
    assert [r["top_k"] for r in res["results"]] == [2, 3]
    import transformers

    if transformers.__version__ != "5.24.0":
        pytest.skip(
            f"the K = 1 failure is that of transformers 5.24.0, not {transformers.__version__}"
        )
    with pytest.raises(UnsupportedModelError, match=r"fails with top_k = 1") as err:
        hf_eval("lc", data, [1, 2], seq_len=16, loaded=loaded)
    msg = str(err.value)
    assert "longcat_flash" in msg and "runs with its own top_k = 2" in msg
    assert "modeling_longcat_flash.py" in msg  # where it failed
    assert "ValueError: not enough values to unpack" in msg  # what failed


def test_a_model_whose_own_forward_fails_is_refused_saying_what_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39, item 10: a LongCat-Flash whose config does not fit its own attention
    (num_key_value_heads = 2 with its latent attention) fails in transformers' forward at
    every K; moelab says that in one line, naming the error and where it came from, and
    blames no K (it blamed K = 1, and the model's own K gave a traceback)."""
    from moelab import cli
    from tests.integrations import tiny_text, tiny_tokenizer
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_family_model("longcat_flash", num_key_value_heads=2)
    with pytest.raises(RuntimeError, match="size of tensor"):  # the model's own failure
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    folder = tmp_path / "lc"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = tmp_path / "t.txt"
    data.write_text(tiny_text())
    runs = {
        "eval K=1,2": ["eval", "--hf", str(folder), "--data", str(data), "--top-k", "1", "2"],
        "eval K=3": ["eval", "--hf", str(folder), "--data", str(data), "--top-k", "3"],
        "eval own K": ["eval", "--hf", str(folder), "--data", str(data), "--top-k", "2"],
        "eval --map": [
            *("eval", "--hf", str(folder), "--data", str(data), "--top-k", "2"),
            *("--map", "sparsemax"),
        ],
        "stats": ["stats", "--hf", str(folder), "--data", str(data)],
    }
    for what, argv in runs.items():
        capsys.readouterr()
        assert cli.main(argv) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, (what, err)
        line = err[0]
        assert line.startswith(f"moelab {argv[0]}: error: "), (what, line)
        assert "'longcat_flash' model's own forward fails" in line, (what, line)
        assert "RuntimeError: The size of tensor a" in line, (what, line)
        assert "modeling_longcat_flash.py" in line, (what, line)
        assert "top_k = 1" not in line and "top_k = 3" not in line, (what, line)


@pytest.mark.parametrize("model_type", ["glm4_moe", "longcat_flash"])
def test_a_bfloat16_checkpoint_has_its_rule_read_at_float32(model_type: str) -> None:
    """A bf16 model: the rule is read on a float32 copy of each router (bf16 weights
    could not tell softmax from sigmoid renormalised), the same rule as in float32, and
    the swap's check passes."""
    from moelab.integrations.hf.families import moe_routers
    from moelab.integrations.hf.swap import swap_routers
    from tests.integrations.tiny_families import tiny_family_model

    want = [s.rule for s in moe_routers(tiny_family_model(model_type))]
    model = tiny_family_model(model_type).to(torch.bfloat16)
    assert [s.rule for s in moe_routers(model)] == want
    assert len(swap_routers(model)) == len(want)
