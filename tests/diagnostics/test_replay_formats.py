"""Routing records in the engines' forms (moelab.diagnostics.replay_formats): the array
form and Megatron-Core's list of per-layer tensors against hand-built expected values,
round trips moelab <-> array <-> megatron exact, a converted record replays as the
original did, unfilled slots and null experts as documented, an engine's all-layer
array narrowed to the MoE layers, and every bad record refused in one line naming the
field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moelab.diagnostics import RoutingRecord, record, replay
from moelab.diagnostics.replay_formats import (
    ARRAY_FORMAT,
    UNFILLED,
    check_record,
    detect_format,
    from_array,
    load_any,
    load_array,
    load_megatron,
    moe_layer_ids,
    save_array,
    save_as,
    save_megatron,
    to_array,
)
from moelab.model import ModelConfig, Transformer
from tests._docs import page_code


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


# a hand-built record: T = 4 tokens, L = 3 MoE layers, K = 2, E = 6
IDS = [
    [[0, 5], [1, 2], [3, 4], [5, 0]],
    [[2, 3], [2, 4], [0, 1], [1, 5]],
    [[4, 1], [3, 0], [2, 5], [0, 3]],
]
TOKENS = [11, 7, 93, 2]


def _hand_record(chosen: list | None = None, n_null: int = 0) -> RoutingRecord:
    ids = [torch.tensor(layer, dtype=torch.int64) for layer in IDS]
    chosen_TK = [torch.ones(4, 2, dtype=torch.bool) for _ in IDS]
    if chosen is not None:
        chosen_TK = [torch.tensor(c, dtype=torch.bool) for c in chosen]
    return RoutingRecord(
        ids, chosen_TK, 6, n_null, "softmax", token_ids=torch.tensor(TOKENS, dtype=torch.int64)
    )


def _same(a: RoutingRecord, b: RoutingRecord, token_ids: bool = True) -> None:
    assert (a.n_layers, a.tokens, a.n_experts, a.n_null) == (
        b.n_layers,
        b.tokens,
        b.n_experts,
        b.n_null,
    )
    for x, y in zip(a.ids_TK, b.ids_TK, strict=True):
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y)
    for x, y in zip(a.chosen_TK, b.chosen_TK, strict=True):
        assert x.dtype == y.dtype == torch.bool and torch.equal(x, y)
    if token_ids:
        assert a.token_ids is not None and torch.equal(a.token_ids, b.token_ids)


def _one_line(match: str):
    return pytest.raises(ValueError, match=match)


def _refused(fn, *args, match: str, **kw) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_the_array_is_tokens_by_layers_by_slots() -> None:
    rec = _hand_record()
    experts_TLK = to_array(rec)
    assert experts_TLK.dtype == torch.int32 and experts_TLK.shape == (4, 3, 2)
    # row t, layer l, slot k is IDS[l][t][k] (independent of the code: the literal)
    for t in range(4):
        for layer in range(3):
            assert experts_TLK[t, layer].tolist() == IDS[layer][t]


def test_round_trip_moelab_array_megatron_is_exact(tmp_path: Path) -> None:
    rec = _hand_record()
    rec.save(tmp_path / "r.safetensors")
    save_array(RoutingRecord.load(tmp_path / "r.safetensors"), tmp_path / "r.npz", [1, 3, 5])
    arr, layers = load_array(tmp_path / "r.npz")
    assert layers == [1, 3, 5]
    _same(rec, arr)
    save_megatron(arr, tmp_path / "r.pt")
    meg = load_megatron(tmp_path / "r.pt", n_experts=6)
    _same(rec, meg, token_ids=False)  # Megatron's form holds the indices only
    assert meg.token_ids is None
    # and back through every form once more, from the megatron one (token ids re-attached)
    meg.token_ids = rec.token_ids
    for to, name in (("moelab", "b.safetensors"), ("array", "b.npz"), ("megatron", "b.pt")):
        save_as(meg, tmp_path / name, to)
        back = load_any(tmp_path / name, 6)
        assert back.source == to
        _same(rec, back.record, token_ids=to != "megatron")


def test_the_files_hold_what_the_docs_say(tmp_path: Path) -> None:
    rec = _hand_record()
    save_array(rec, tmp_path / "r.npz", [1, 3, 5])
    with np.load(tmp_path / "r.npz", allow_pickle=False) as z:
        assert sorted(z.files) == sorted(
            ["format", "routed_experts", "token_ids", "moe_layer_ids", "n_experts", "n_null"]
        )
        assert str(z["format"]) == ARRAY_FORMAT
        assert z["routed_experts"].dtype == np.int32 and z["routed_experts"].shape == (4, 3, 2)
        assert z["routed_experts"][:, 2].tolist() == IDS[2]
        assert z["token_ids"].dtype == np.int64 and z["token_ids"].tolist() == TOKENS
        assert z["moe_layer_ids"].tolist() == [1, 3, 5] and int(z["n_experts"]) == 6
    # Megatron's form: RouterReplay.set_replay_data(torch.load(path)) takes it as it is
    save_megatron(rec, tmp_path / "r.pt")
    layers = torch.load(tmp_path / "r.pt", weights_only=True)
    assert isinstance(layers, list) and len(layers) == 3
    for layer, expected in zip(layers, IDS, strict=True):
        assert layer.dtype == torch.int64 and layer.tolist() == expected
    # its static-buffer layout, one (T, L, K) tensor, reads too
    torch.save(torch.tensor(IDS).permute(1, 0, 2).contiguous(), tmp_path / "static.pt")
    _same(rec, load_megatron(tmp_path / "static.pt", 6), token_ids=False)
    # the moelab file: token_ids beside the layers' tensors
    rec.save(tmp_path / "r.safetensors")
    with safe_open(str(tmp_path / "r.safetensors"), framework="pt") as f:
        assert f.get_tensor("token_ids").tolist() == TOKENS
    assert [detect_format(tmp_path / n) for n in ("r.npz", "r.pt", "r.safetensors")] == [
        "array",
        "megatron",
        "moelab",
    ]


def test_a_record_without_token_ids_is_the_old_file(tmp_path: Path) -> None:
    rec = _hand_record()
    rec.token_ids = None
    rec.save(tmp_path / "old.safetensors")
    with safe_open(str(tmp_path / "old.safetensors"), framework="pt") as f:
        assert "token_ids" not in f.keys()
    back = RoutingRecord.load(tmp_path / "old.safetensors")
    assert back.token_ids is None
    _same(rec, back, token_ids=False)


def test_unfilled_slots_are_minus_one_and_come_back_unchosen(tmp_path: Path) -> None:
    chosen = [
        [[1, 1], [1, 0], [1, 1], [1, 0]],
        [[1, 1], [1, 1], [1, 1], [1, 1]],
        [[1, 0], [1, 1], [1, 1], [1, 1]],
    ]
    rec = _hand_record(chosen)
    experts_TLK = to_array(rec)
    assert experts_TLK[1, 0].tolist() == [1, UNFILLED] and experts_TLK[0, 2].tolist() == [4, -1]
    assert int((experts_TLK == -1).sum()) == 3
    save_array(rec, tmp_path / "r.npz")
    back, _ = load_array(tmp_path / "r.npz")
    for layer in range(3):
        want = torch.tensor(chosen[layer], dtype=torch.bool)
        assert torch.equal(back.chosen_TK[layer], want)
        # filled slots keep their ids; an unfilled slot's id is not kept (read as 0)
        ids = torch.tensor(IDS[layer])
        assert torch.equal(back.ids_TK[layer], torch.where(want, ids, torch.zeros_like(ids)))
    _refused(save_megatron, rec, tmp_path / "r.pt", match="layer 0: 2 unfilled slots")


def test_null_experts_keep_their_ids_in_the_array_and_megatron_refuses_them(
    tmp_path: Path,
) -> None:
    rec = RoutingRecord(
        [torch.tensor([[0, 6], [7, 1]])], [torch.ones(2, 2, dtype=torch.bool)], 6, n_null=2
    )
    save_array(rec, tmp_path / "r.npz")
    back, _ = load_array(tmp_path / "r.npz")
    assert back.n_null == 2 and back.ids_TK[0].tolist() == [[0, 6], [7, 1]]
    _refused(save_megatron, rec, tmp_path / "r.pt", match="layer 0: null expert ids")


def test_an_engines_array_with_every_decoder_layer_is_narrowed(tmp_path: Path) -> None:
    # vLLM / SGLang: (tokens - 1, num_hidden_layers, top_k) int32, dense layers left 0;
    # here 4 decoder layers of which 1 and 3 are MoE layers
    engine = np.zeros((4, 4, 2), dtype=np.int32)
    engine[:, 1] = np.array(IDS[0], dtype=np.int32)
    engine[:, 3] = np.array(IDS[1], dtype=np.int32)
    np.save(tmp_path / "engine.npy", engine)
    assert detect_format(tmp_path / "engine.npy") == "npy"
    rec, layers = load_array(tmp_path / "engine.npy", 6, layer_ids=[1, 3])
    assert layers == [1, 3] and rec.n_layers == 2
    assert rec.ids_TK[0].tolist() == IDS[0] and rec.ids_TK[1].tolist() == IDS[1]
    # the MoE layers only: taken as they are
    rec, layers = load_array(tmp_path / "engine.npy", 6)
    assert layers == [0, 1, 2, 3] and rec.n_layers == 4


def test_a_converted_record_replays_as_the_original() -> None:
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            n_layers=4,
            d_model=32,
            n_heads=2,
            n_kv_heads=1,
            d_ff=64,
            vocab_size=100,
            max_seq_len=16,
            n_experts=4,
            router={"top_k": 2},
        )
    ).eval()
    x = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record(model) as rec:
        own = model(x, x)
    assert moe_layer_ids(model) == [1, 3]
    check_record(rec, model=model, text=x)
    engine = to_array(rec).numpy()  # as an engine would return it: int32 (T, L, K)
    converted = from_array(engine, 4, token_ids=x.reshape(-1).numpy())
    check_record(converted, model=model, text=x)
    with torch.no_grad(), replay(model, converted):
        again = model(x, x)
    assert torch.equal(own.loss, again.loss) and torch.equal(own.logits_BSV, again.logits_BSV)


# ------------------------------------------------------------------ bad records


def test_bad_records_are_refused_in_one_line(tmp_path: Path) -> None:
    good = to_array(_hand_record()).numpy()
    # wrong E: ids up to 5 read with E = 4
    _refused(
        from_array, good, 4, match=r"routed_experts: expert ids span \[0, 5\], outside \[0, 3\]"
    )
    # negative ids other than -1
    bad = good.copy()
    bad[0, 0, 0] = -3
    _refused(from_array, bad, 6, match=r"routed_experts: expert ids span \[-3, 5\]")
    # wrong dtype, wrong rank
    _refused(
        from_array,
        good.astype(np.float32),
        6,
        match="routed_experts: dtype float32, expected int32",
    )
    _refused(from_array, good[:, 0], 6, match=r"routed_experts: shape \(4, 2\), expected \(tokens")
    # token ids of another length or type
    _refused(
        from_array,
        good,
        6,
        token_ids=np.arange(5),
        match="token_ids: 5 tokens, routed_experts has 4",
    )
    _refused(from_array, good, 6, token_ids=np.zeros(4), match="token_ids: float64")
    rec = _hand_record()
    # wrong layer count, wrong E, wrong K against the model
    _refused(check_record, rec, n_layers=4, match="routed_experts: 3 MoE layers, the model has 4")
    _refused(
        check_record, rec, n_experts=8, match="n_experts: the record has 6 experts, the model 8"
    )
    _refused(check_record, rec, top_k=4, match=r"top_k: the record has K = \[2, 2, 2\]")
    # another text's length; another text of the same length
    _refused(
        check_record, rec, text=list(range(7)), match="routed_experts: 4 tokens, the text has 7"
    )
    msg = _refused(check_record, rec, text=[*TOKENS, 5], match="the text has 5")
    assert "last sampled token" in msg  # the engines' one row less, named
    _refused(
        check_record, rec, text=[11, 7, 94, 3], match="token_ids: differ from the text's at 2 of 4"
    )
    # the .npz's E against the model's, its layer map against the model's
    save_array(rec, tmp_path / "r.npz", [1, 3, 5])
    _refused(load_array, tmp_path / "r.npz", 8, match="n_experts: the file says 6, the model has 8")
    _refused(load_array, tmp_path / "r.npz", layer_ids=[0, 1, 2], match="moe_layer_ids: the file's")
    # an engine array with fewer layers than the model's MoE layers
    np.save(tmp_path / "two.npy", good[:, :2])
    _refused(
        load_array,
        tmp_path / "two.npy",
        6,
        layer_ids=[1, 3, 5],
        match="routed_experts: 2 layers, the model has 3 MoE layers",
    )
    _refused(load_array, tmp_path / "two.npy", match="give n_experts")
    # Megatron files: ragged layers, float indices, negative indices, not tensors
    torch.save([torch.zeros(4, 2).long(), torch.zeros(3, 2).long()], tmp_path / "ragged.pt")
    _refused(
        load_megatron, tmp_path / "ragged.pt", 6, match="routed_experts: the layers have shapes"
    )
    torch.save([torch.zeros(4, 2)], tmp_path / "float.pt")
    _refused(
        load_megatron, tmp_path / "float.pt", 6, match="layer 0: dtype float32, expected int64"
    )
    torch.save([torch.full((4, 2), -1)], tmp_path / "neg.pt")
    _refused(load_megatron, tmp_path / "neg.pt", 6, match="routed_experts: expert id -1")
    torch.save({"a": 1}, tmp_path / "dict.pt")
    _refused(load_megatron, tmp_path / "dict.pt", 6, match="holds a dict")
    (tmp_path / "notes.txt").write_text("hello")
    _refused(detect_format, tmp_path / "notes.txt", match="not a routing record this moelab reads")
    # a record whose layers have different K has no array form
    mixed = RoutingRecord(
        [torch.zeros(2, 1).long(), torch.zeros(2, 2).long()],
        [torch.ones(2, 1).bool(), torch.ones(2, 2).bool()],
        4,
    )
    _refused(to_array, mixed, match=r"routed_experts: the layers hold K = \[1, 2\]")
    # token ids on the record itself: checked by validate()
    _refused(
        RoutingRecord,
        [torch.zeros(2, 1).long()],
        [torch.ones(2, 1).bool()],
        4,
        token_ids=torch.zeros(3).long(),
        match=r"token_ids: torch.int64 \(3,\), expected int64 \(2,\)",
    )


def test_the_docs_example_runs() -> None:
    exec(compile(page_code("replay.md", "# routing formats"), "docs/replay.md", "exec"), {})
