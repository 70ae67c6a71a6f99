"""``moelab routing convert``: a record through moelab -> array -> megatron -> moelab with
the input's form named, --json, and the user's mistakes (an existing OUT, the input as
OUT, a file that does not say E, ids outside E) one line ``moelab routing: error: ...``
with exit code 2; an existing file is never replaced without --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moelab import cli
from moelab.cli.routing import FORMATS
from moelab.diagnostics import RoutingRecord, replay_formats

IDS = [[[0, 3], [1, 2], [2, 0]], [[3, 1], [0, 2], [1, 3]]]  # L = 2, T = 3, K = 2, E = 4


def _record(path: Path) -> RoutingRecord:
    rec = RoutingRecord(
        [torch.tensor(layer) for layer in IDS],
        [torch.ones(3, 2, dtype=torch.bool) for _ in IDS],
        4,
        token_ids=torch.tensor([5, 6, 7]),
    )
    rec.save(path)
    return rec


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab routing: error: ") and err.count("\n") == 1, err
    assert match in err, err


def test_convert_through_every_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert FORMATS == replay_formats.FORMATS  # --to's choices, named where --help needs no torch
    rec = _record(tmp_path / "r.safetensors")
    npz, pt, back = tmp_path / "r.npz", tmp_path / "r.pt", tmp_path / "back.safetensors"
    argv = ["routing", "convert", str(tmp_path / "r.safetensors"), str(npz), "--to", "array"]
    assert cli.main([*argv, "--moe-layers", "1,3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"read {tmp_path / 'r.safetensors'}: a moelab routing record (safetensors)",
        f"wrote {npz} as array: 3 tokens x 2 MoE layers [1, 3] x K=2, E=4, with token ids",
    ]
    with np.load(npz) as z:
        assert z["routed_experts"].transpose(1, 0, 2).tolist() == IDS
        assert z["moe_layer_ids"].tolist() == [1, 3]
    assert cli.main(["routing", "convert", str(npz), str(pt), "--to", "megatron", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["from"] == "array" and doc["to"] == "megatron" and doc["layer_ids"] == [1, 3]
    assert (doc["tokens"], doc["moe_layers"], doc["top_k"], doc["n_experts"]) == (3, 2, 2, 4)
    assert doc["token_ids_dropped"] is True and doc["unfilled"] == 0
    assert [t.tolist() for t in torch.load(pt, weights_only=True)] == IDS
    argv = ["routing", "convert", str(pt), str(back), "--to", "moelab", "--n-experts", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"read {pt}: a Megatron-Core router_replay file")
    again = RoutingRecord.load(back)
    for a, b in zip(again.ids_TK, rec.ids_TK, strict=True):
        assert torch.equal(a, b)
    assert all(bool(c.all()) for c in again.chosen_TK)


def test_mistakes_are_one_line_and_files_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "r.safetensors"
    _record(src)
    out = tmp_path / "kept.npz"
    out.write_bytes(b"the user's file")
    convert = ["routing", "convert", str(src)]
    _error(capsys, [*convert, str(out), "--to", "array"], f"{out} exists; give another OUT")
    assert out.read_bytes() == b"the user's file"
    _error(capsys, [*convert, str(src), "--to", "moelab", "--overwrite"], "is the input file")
    assert cli.main([*convert, str(out), "--to", "array", "--overwrite"]) == 0
    capsys.readouterr()
    # the file does not say E / the ids are outside the E given / E disagrees
    np.save(tmp_path / "engine.npy", np.array(IDS, dtype=np.int32).transpose(1, 0, 2))
    engine = ["routing", "convert", str(tmp_path / "engine.npy"), str(tmp_path / "e.npz")]
    _error(capsys, [*engine, "--to", "array"], "give n_experts (--n-experts E)")
    _error(capsys, [*engine, "--to", "array", "--n-experts", "3"], "routed_experts: expert ids")
    _error(
        capsys,
        [*convert, str(tmp_path / "x.npz"), "--to", "array", "--n-experts", "8"],
        "n_experts: the file says 4, the model has 8",
    )
    _error(
        capsys,
        [*engine, "--to", "array", "--n-experts", "4", "--moe-layers", "1,3,5"],
        "routed_experts: 2 layers, the model has 3 MoE layers",
    )
    # --json: the error document on stdout as well
    assert cli.main([*engine, "--to", "array", "--json"]) == 2
    captured = capsys.readouterr()
    assert "give n_experts" in json.loads(captured.out)["error"]
    assert not (tmp_path / "e.npz").exists()
    assert cli.main([*engine, "--to", "array", "--n-experts", "4"]) == 0
    assert capsys.readouterr().out.startswith(f"read {tmp_path / 'engine.npy'}: a bare")
