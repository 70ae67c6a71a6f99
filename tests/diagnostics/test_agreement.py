"""moelab analyze agreement: two hand-built routing records with known flips give the
known figures exactly (per layer, any layer, by position, the margins of the flipped
tokens); records that do not match are refused in one line naming the field; record()
keeps the ranking margins (ties exactly 0) and S, files without them still load; the
CLI round trip and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moelab.cli import main
from moelab.diagnostics import RoutingRecord, record, replay
from moelab.diagnostics.analysis import agreement
from moelab.diagnostics.replay import ranking_margins
from moelab.report.analysis import write_analysis
from moelab.routing import RouterConfig
from moelab.routing.router import Router

E, K, S, T = 6, 2, 4, 12  # 3 sequences of 4 tokens
FLIPS = {0: {1: [1, 4], 5: [5, 3]}, 1: {5: [4, 5], 10: [0, 3]}}
"""layer -> token -> B's ids where B's set differs from A's (A: token t takes
{t % E, (t + 1) % E}); one expert swapped, but two at token 10 of layer 1."""


def _pair(margins: bool = True) -> tuple[RoutingRecord, RoutingRecord]:
    """Two records of 2 layers, T = 12 (S = 4 in A), top-2 of 6 experts, with the flips
    of FLIPS and two differences that are no flip: the slots of token 3 in the other
    order (layer 0), and an unchosen slot of token 7 naming another expert (layer 1).
    ``margins``: A holds hand-set margins (B none)."""
    ids_a = [torch.tensor([[t % E, (t + 1) % E] for t in range(T)]) for _ in range(2)]
    chosen_a = [torch.ones(T, K, dtype=torch.bool) for _ in range(2)]
    ids_b = [x.clone() for x in ids_a]
    chosen_b = [x.clone() for x in chosen_a]
    for layer, flips in FLIPS.items():
        for t, ids in flips.items():
            ids_b[layer][t] = torch.tensor(ids)
    ids_b[0][3] = ids_a[0][3].flip(0)  # the same set in another slot order
    chosen_a[1][7, 1] = chosen_b[1][7, 1] = False  # an unchosen slot: its id does not count
    ids_b[1][7, 1] = 5
    m = None
    if margins:
        # top-1/2 margins 1 + t / 8; top-K/K+1 margins: the flipped tokens 0 (a tie) and
        # 0.5 in layer 0, 0.25 and 0.75 in layer 1, every other token 2 + t / 4 and one inf
        m = []
        for _ in range(2):
            m_T2 = torch.stack([1 + torch.arange(T) / 8, 2 + torch.arange(T) / 4], dim=1)
            m_T2[11, 1] = torch.inf
            m.append(m_T2.float())
        m[0][1, 1], m[0][5, 1] = 0.0, 0.5
        m[1][5, 1], m[1][10, 1] = 0.25, 0.75
    a = RoutingRecord(ids_a, chosen_a, E, map="softmax", margins_T2=m, seq_len=S)
    b = RoutingRecord(ids_b, chosen_b, E, map="softmax")
    return a, b


def test_known_flips_give_the_known_figures() -> None:
    a, b = _pair()
    doc = agreement(a, b)
    assert [lay["differ_tokens"] for lay in doc["layers"]] == [2, 2]
    assert [lay["differ"] for lay in doc["layers"]] == [2 / 12, 2 / 12]
    assert doc["differ_any_tokens"] == 3 and doc["differ_any"] == 3 / 12
    assert doc["differ_states"] == 4 / 24
    assert doc["layers_differing"] == [9, 2, 1]  # token 5 differs in both layers
    assert [lay["swapped_mean"] for lay in doc["layers"]] == [1.0, 1.5]
    assert doc["seq_len"] == S and doc["seq_len_from"] == "record"
    assert doc["position_axis"] == "position"
    by_pos = {p["lo"]: p for p in doc["positions"]}
    assert [(p["lo"], p["hi"], p["tokens"]) for p in doc["positions"]] == [
        (0, 1, 3), (1, 2, 3), (2, 3, 3), (3, 4, 3)
    ]  # fmt: skip
    assert by_pos[1]["differ_any_tokens"] == 2 and by_pos[1]["differ_any"] == 2 / 3
    assert by_pos[1]["differ_states"] == 3 / 6  # token 1 in one layer, token 5 in two
    assert by_pos[2]["differ_any"] == 1 / 3 and by_pos[2]["differ_states"] == 1 / 6
    assert by_pos[0]["differ_any"] == by_pos[3]["differ_any"] == 0.0


def test_identical_records_agree_and_positions_without_s_are_rows() -> None:
    a, _ = _pair()
    a.seq_len = None
    doc = agreement(a, a)
    assert doc["differ_any"] == 0.0 and doc["layers_differing"] == [12, 0, 0]
    assert doc["position_axis"] == "row" and doc["seq_len"] is None
    assert [(p["lo"], p["hi"]) for p in doc["positions"]] == [
        (0, 2), (2, 3), (3, 4), (4, 6), (6, 8), (8, 9), (9, 10), (10, 12)
    ]  # fmt: skip
    assert doc["layers"][0]["swapped_mean"] is None


def test_margins_of_the_flipped_tokens() -> None:
    a, b = _pair()
    doc = agreement(a, b)
    lay0 = doc["margins"]["A"]["layers"][0]
    # differing tokens 1 and 5: top-K/K+1 margins 0 (a tie) and 0.5
    got = lay0["topk"]["differing"]
    assert (got["tokens"], got["ties"], got["infinite"], got["min"]) == (2, 1, 0, 0.0)
    assert got["p50"] == 0.25
    assert got["p10"] == pytest.approx(0.05, abs=1e-15)
    assert got["p90"] == pytest.approx(0.45, abs=1e-15)
    # the rest: 2 + t / 4 for t in 0, 2, 3, 4, 6, 7, 8, 9, 10, and inf at t = 11
    got = lay0["topk"]["rest"]
    assert (got["tokens"], got["ties"], got["infinite"], got["min"]) == (10, 0, 1, 2.0)
    assert got["p50"] == 2 + 6 / 4  # the median of the nine finite ones
    assert got["p10"] == pytest.approx(2 + (0 + 0.8 * 2) / 4, abs=1e-12)
    assert lay0["top1"]["differing"]["p50"] == (1 + 1 / 8 + 1 + 5 / 8) / 2
    assert doc["margins"]["A"]["layers"][1]["topk"]["differing"]["p50"] == 0.5
    over = doc["margins"]["A"]["all"]["topk"]
    assert over["differing"]["tokens"] == 4 and over["differing"]["ties"] == 1
    assert over["rest"]["tokens"] == 20 and over["rest"]["infinite"] == 2
    rest = [2 + t / 4 for t in (0, 2, 3, 4, 6, 7, 8, 9, 10)]  # layer 0; then layer 1
    rest += [2 + t / 4 for t in (0, 1, 2, 3, 4, 6, 7, 8, 9)]
    assert over["rest"]["p50"] == float(np.median(rest))
    hist = doc["margins"]["A"]["histogram"]
    assert hist["bins"][0] == "0" and hist["bins"][-1] == "inf"
    assert hist["topk"]["differing"][0] == 1 and sum(hist["topk"]["differing"]) == 4
    assert hist["topk"]["rest"][-1] == 2 and sum(hist["topk"]["rest"]) == 20
    assert hist["topk"]["rest"][-2] == 0 and hist["topk"]["rest"][-3] == 18  # [1, 10)
    assert doc["margins"]["B"] is None
    assert doc["margins_unavailable"].startswith("B holds no margins")


def test_margins_unavailable_are_never_invented(tmp_path: Path) -> None:
    a, b = _pair(margins=False)
    doc = agreement(a, b)
    assert doc["margins"] == {"A": None, "B": None}
    assert "A and B hold no margins" in doc["margins_unavailable"]
    files = write_analysis(doc, tmp_path / "out")
    assert [f.name for f in files] == ["agreement.png", "agreement.md", "agreement.json"]
    md = files[1].read_text()
    assert "Margins unavailable: A and B hold no margins" in md and "| 0 | 16.67% | 2 |" in md
    # B's margins are used when A has none
    a2, _ = _pair()
    doc = agreement(b, a2, labels=("x", "y"))
    assert doc["margins"]["A"] is None and doc["margins"]["B"] is not None
    assert "Margins from `y`" in write_analysis(doc, tmp_path / "out2")[1].read_text()


def test_mismatched_records_are_refused_in_one_line() -> None:
    a, b = _pair()
    cases = [
        (RoutingRecord(a.ids_TK[:1], a.chosen_TK[:1], E), "n_layers differs: A has 2, B has 1"),
        (RoutingRecord(a.ids_TK, a.chosen_TK, E + 1), "n_experts differs: A has 6, B has 7"),
        (RoutingRecord(a.ids_TK, a.chosen_TK, E, n_null=1), "n_null differs: A has 0, B has 1"),
        (
            RoutingRecord([x[:8] for x in a.ids_TK], [x[:8] for x in a.chosen_TK], E),
            "tokens differs: A has 12, B has 8",
        ),
        (
            RoutingRecord(a.ids_TK, a.chosen_TK, E, seq_len=6),
            "seq_len differs: A was recorded with S=4, B was recorded with S=6",
        ),
    ]
    for other, message in cases:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as err:
            agreement(a, other)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="seq_len 6 differs from A's recorded S=4"):
        agreement(a, b, seq_len=6)
    a.seq_len = None
    with pytest.raises(ValueError, match="positive divisor of the 12 recorded tokens, got 5"):
        agreement(a, b, seq_len=5)
    assert agreement(a, b, seq_len=6)["positions"][0] == {
        "lo": 0, "hi": 1, "tokens": 2, "differ_any_tokens": 0, "differ_any": 0.0,
        "differ_states": 0.0,
    }  # fmt: skip


# --- what record() keeps --------------------------------------------------------------------


class _OneRouter(nn.Module):
    def __init__(self, **keys) -> None:
        super().__init__()
        self.router = Router(RouterConfig(d_model=4, n_experts=5, top_k=2, **keys))

    def forward(self, x_TD: torch.Tensor) -> None:
        self.router(x_TD)


def test_record_keeps_the_ranking_margins_and_ties_are_zero(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _OneRouter().eval()
    with torch.no_grad():
        model.router.weight.normal_()
        model.router.weight[0] = model.router.weight[1] = 2.0  # experts 0 and 1 tie
        model.router.bias.copy_(torch.tensor([0.0, 0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(16, 4)
    x[:6] = x[:6].abs() + 1  # these lead with experts 0 and 1
    with torch.no_grad(), record(model) as rec:
        model(x)
        model(x[:8])
    assert rec.seq_len is None  # called without sequences
    assert rec.margins_T2 is not None and rec.margins_T2[0].shape == (24, 2)
    # the reference: float64 ranking scores x W^T / tau + bias, sorted
    w = model.router.weight.double()
    tau = float(model.router.temperature.tau)
    rank = torch.cat([x, x[:8]]).double() @ w.T / tau + model.router.bias.double()
    top = rank.sort(dim=1, descending=True).values
    ref = torch.stack([top[:, 0] - top[:, 1], top[:, 1] - top[:, 2]], dim=1)
    torch.testing.assert_close(rec.margins_T2[0].double(), ref, atol=1e-5, rtol=0)
    tied = rank[:, 0] >= rank[:, 2:].max(dim=1).values  # 0 and 1 lead: an exact tie
    assert tied.any() and (rec.margins_T2[0][tied, 0] == 0).all()
    # the file keeps them; a file without them still loads, with None
    rec.save(tmp_path / "r.safetensors")
    back = RoutingRecord.load(tmp_path / "r.safetensors")
    assert torch.equal(back.margins_T2[0], rec.margins_T2[0]) and back.seq_len is None
    old = RoutingRecord(rec.ids_TK, rec.chosen_TK, rec.n_experts, map=rec.map)
    old.save(tmp_path / "old.safetensors")
    assert RoutingRecord.load(tmp_path / "old.safetensors").margins_T2 is None


def test_margins_only_where_the_rule_ranks_each_token() -> None:
    x = torch.randn(8, 4)
    model = _OneRouter(selection="expert_choice").eval()
    with torch.no_grad(), record(model) as rec:
        model(x)
    assert rec.margins_T2 is None
    model = _OneRouter(noise_std=1.0).train()  # exploration: the ranked scores are unseen
    assert ranking_margins(model.router, model.router(x)) is None
    model.eval()
    assert ranking_margins(model.router, model.router(x)) is not None
    with torch.no_grad(), record(model) as rec:
        model(x)
    with torch.no_grad(), replay(model, rec), record(model) as again:  # replayed slots
        model(x)
    assert rec.margins_T2 is not None and again.margins_T2 is None


def test_bad_margins_and_seq_len_are_refused() -> None:
    a, _ = _pair()
    with pytest.raises(ValueError, match=r"layer 0: margins must be float32 \(12, 2\)"):
        RoutingRecord(a.ids_TK, a.chosen_TK, E, margins_T2=[torch.zeros(12, 3)] * 2)
    with pytest.raises(ValueError, match="margins need one tensor per layer, got 1 for 2"):
        RoutingRecord(a.ids_TK, a.chosen_TK, E, margins_T2=[torch.zeros(12, 2)])
    with pytest.raises(ValueError, match="layer 1: margins must be >= 0 or \\+inf"):
        RoutingRecord(a.ids_TK, a.chosen_TK, E, margins_T2=[torch.zeros(12, 2), -torch.ones(12, 2)])
    with pytest.raises(ValueError, match="seq_len must be positive and divide its 12 tokens"):
        RoutingRecord(a.ids_TK, a.chosen_TK, E, seq_len=5)


# --- the CLI --------------------------------------------------------------------------------


def _error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("moelab analyze: error: "), err
    return err.strip()[len("moelab analyze: error: ") :]


def test_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _pair()
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    args = [
        "analyze",
        "agreement",
        str(tmp_path / "a.safetensors"),
        str(tmp_path / "b.safetensors"),
    ]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["differ_any"] == 3 / 12 and doc["seq_len"] == S
    assert doc["margins"]["A"]["layers"][0]["topk"]["differing"]["ties"] == 1
    folder = tmp_path / "agreement_a_vs_b"  # the default: beside A
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "agreement.json", "agreement.md", "agreement.png"
    ]  # fmt: skip
    assert json.loads((folder / "agreement.json").read_text())["differ_states"] == 4 / 24
    # text, again into the same folder (its own files are replaced), and --out
    assert main([*args, "--seq-len", "4", "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "**25.00%** (3 of 12)" in text and "S = 4, from the argument" in text
    assert "written: " in text and (tmp_path / "o" / "agreement.md").is_file()
    assert main(args) == 0


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _pair()
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.save(pa)
    RoutingRecord([x[:8] for x in b.ids_TK], [x[:8] for x in b.chosen_TK], E).save(pb)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "thesis.tex").write_text("x")
    cases = [
        (["agreement", str(pa)], "agreement compares two routing records: moelab analyze "
         "agreement A B"),
        (["agreement", str(pa), str(pb)], "tokens differs: "),
        (["agreement", str(pa), str(tmp_path / "nope.safetensors")], "no such file"),
        (["agreement", str(pa), str(tmp_path)], "is not a routing record file (a folder)"),
        (["agreement", str(pa), str(tmp_path / "notes.txt")], "is not a safetensors file"),
        (["agreement", str(pa), str(pa), "--data", "x.txt"], "drop --data"),
        (["agreement", str(pa), str(pa), "--out", str(tmp_path / "keep")], "thesis.tex"),
        (["agreement", str(pa), str(pa), "--seq-len", "5"], "positive divisor"),
        (["coactivation", str(tmp_path), str(pa)], "coactivation reads one run folder, got a "
         "second"),
        (["coactivation", str(tmp_path), "--seq-len", "4"], "--seq-len applies to agreement"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["analyze", *argv]) == 2, argv
        assert message in _error(capsys), argv
    assert not (tmp_path / "keep" / "agreement.json").exists()


def test_a_transformer_records_s_and_agrees_with_itself() -> None:
    from moelab.model import ModelConfig, Transformer

    torch.manual_seed(0)
    keys = dict(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=50)
    model = Transformer(ModelConfig(**keys, max_seq_len=8, n_experts=4, router={"top_k": 2}))
    x = torch.randint(0, 50, (3, 8))
    runs = []
    for _ in range(2):
        with torch.no_grad(), record(model.eval()) as rec:
            model(x)
        runs.append(rec)
    assert runs[0].seq_len == 8 and runs[0].margins_T2 is not None
    doc = agreement(*runs)
    assert doc["differ_any"] == 0.0 and doc["seq_len_from"] == "record"
    assert doc["margins"]["A"]["all"]["topk"]["rest"]["tokens"] == 24 * runs[0].n_layers
