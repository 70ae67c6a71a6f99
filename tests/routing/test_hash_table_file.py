"""Hash tables made elsewhere (DeepSeek-V4's tid2eid): read from a file
(hash_table="file:PATH[#KEY]") or set with Hash.load_table, checked, routed by, saved with
the router, and reported by ``moelab stats`` as a learned router's layer is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moelab.routing.config import RouterConfig
from moelab.routing.router import Router
from moelab.routing.selection.hash import check_table, read_table

V, E, K = 30, 5, 2


def _table(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(V, E, generator=g).argsort(dim=1)[:, :K].contiguous()


def _config(table: str, **kw) -> RouterConfig:
    base = dict(d_model=8, n_experts=E, top_k=K, selection="hash", vocab_size=V)
    return RouterConfig(**{**base, "hash_table": table, **kw})


def test_tables_from_each_file_kind_route_as_stored(tmp_path: Path) -> None:
    table = _table()
    key = "model.layers.0.mlp.gate.tid2eid"  # a checkpoint of several tensors
    save_file({key: table.to(torch.int32), "other": torch.zeros(2)}, tmp_path / "ckpt.safetensors")
    save_file({"t": table}, tmp_path / "one.safetensors")
    np.save(tmp_path / "t.npy", table.numpy().astype(np.int16))
    torch.save(table, tmp_path / "t.pt")
    torch.save({"tid2eid": table}, tmp_path / "d.pt")
    # a sharded save_pretrained folder: the index names the shard of each tensor
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"other": torch.zeros(2)}, shards / "model-00001-of-00002.safetensors")
    save_file({key: table}, shards / "model-00002-of-00002.safetensors")
    weight_map = {"other": "model-00001-of-00002.safetensors"}
    weight_map[key] = "model-00002-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    specs = [
        f"file:{shards}#{key}",
        f"file:{tmp_path}/ckpt.safetensors#{key}",
        f"file:{tmp_path}/one.safetensors",
        f"file:{tmp_path}/t.npy",
        f"file:{tmp_path}/t.pt",
        f"file:{tmp_path}/d.pt",
        f"file:{tmp_path}/d.pt#tid2eid",
    ]
    ids_T = torch.randint(0, V, (40,))
    for spec in specs:
        router = Router(_config(spec))
        assert router.selection.table_VK.dtype == torch.int64
        assert torch.equal(router.selection.table_VK, table), spec
        out = router(torch.randn(40, 8), token_ids_T=ids_T)
        assert torch.equal(out.ids_TK, table[ids_T])  # a lookup, row by row


@pytest.mark.parametrize(
    ("table", "kw", "message"),
    [
        (_table().float(), {}, "integer expert ids, got dtype torch.float32"),
        (_table()[:, 0], {}, r"is \(V, K\), got shape \(30,\)"),
        (_table(), {"top_k": 3}, "K = 2 experts per token id but router.top_k = 3: set top_k = 2"),
        (_table() + 4, {}, r"must lie in \[0, n_experts = 5\), got \[4, 8\]"),
        (torch.zeros(V, K, dtype=torch.int64), {}, r"lists an expert twice for token id 0"),
    ],
)
def test_bad_tables_are_refused_in_one_line(tmp_path: Path, table, kw, message: str) -> None:
    path = tmp_path / "t.pt"
    torch.save(table, path)
    with pytest.raises(ValueError, match=message) as err:
        _config(f"file:{path}", **kw)
    assert f"hash_table='file:{path}'" in str(err.value) and "\n" not in str(err.value)


def test_a_table_for_another_vocabulary_is_refused_when_the_router_is_built(
    tmp_path: Path,
) -> None:
    """V is checked against the model's vocab_size when the rule is built: a training
    run checks its config before its tokenizer gives the model's V."""
    path = tmp_path / "t.pt"
    torch.save(_table()[:-1], path)
    config = _config(f"file:{path}")  # the config is checked but for V
    with pytest.raises(ValueError, match="has 29 rows but the model's vocab_size is 30"):
        Router(config)


def test_bad_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    save_file({"a": _table(), "b": _table(1)}, tmp_path / "two.safetensors")
    (tmp_path / "t.txt").write_text("0 1\n")
    cases = {
        "file:": "names no file",
        f"file:{tmp_path}/missing.npy": "no file",
        f"file:{tmp_path}/two.safetensors": r"holds 2 tensors \(a, b\); name one",
        f"file:{tmp_path}/two.safetensors#c": "the file has no tensor 'c'",
        f"file:{tmp_path}/t.txt": "from .safetensors, .npy or .pt files, not '.txt'",
        f"file:{tmp_path}": "needs model.safetensors.index.json and the tensor's name",
        "hashed": r"hash_table must be one of \('random', 'balanced'\) or file:PATH\[#KEY\]",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            _config(spec)
    with pytest.raises(ValueError, match="a table file is named file:PATH"):
        read_table("random")


def test_load_table_sets_a_checked_table_that_travels_with_the_router() -> None:
    router = Router(_config("random"))
    table = _table(3)
    router.selection.load_table(table.to(torch.int32))
    assert torch.equal(router.selection.table_VK, table)
    with pytest.raises(ValueError, match="must lie in"):
        router.selection.load_table(table + E)
    assert torch.equal(router.selection.table_VK, table)  # a refused table changes nothing
    fresh = Router(_config("random"))
    fresh.load_state_dict(router.state_dict())
    assert torch.equal(fresh.selection.table_VK, table)
    assert torch.equal(check_table(table.numpy(), V, E, K), table)


def test_stats_report_a_file_table_layers_load(
    four_step_run: Path, small_corpus: Path, tmp_path: Path
) -> None:
    """Every token id to experts (0, 1): half the computed slots each, experts 2 and 3
    dead, load CV (population std / mean of [1/2, 1/2, 0, 0]) = 1."""
    from moelab.diagnostics import stats
    from moelab.train import train
    from tests.train import TINY_MODEL, tiny_config

    # the tokenizer of small_corpus at the tests' settings, hence the table's V
    vocab = json.loads((four_step_run / "config.json").read_text())["model"]["vocab_size"]
    table = torch.tensor([[0, 1]] * vocab)
    np.save(tmp_path / "tid2eid.npy", table.numpy())
    router = {"selection": "hash", "hash_table": f"file:{tmp_path}/tid2eid.npy"}
    run = tmp_path / "run"
    train(tiny_config(small_corpus, run, steps=2, model={**TINY_MODEL, "router": router}))
    st = stats(run, max_batches=1)
    (layer,) = st["layers"]
    assert layer["selection"] == "hash"
    assert layer["load_shares"] == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert layer["load_cv"] == pytest.approx(1.0)
    assert layer["dead_experts"] == 2
    assert layer["active_experts"] == pytest.approx(2.0)
