"""The sparse-maps study's paper scale against what *How Sparse Probability Maps Shape
Mixture-of-Experts Routing* states (numbers copied from the paper, with their place)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moelab import cli
from moelab.studies import run_study
from moelab.studies.sparse_maps import TOP_KS, SparseMapsStudy
from moelab.train import TrainConfig

# Table 4: layers, width, Q/KV heads, FF width, MoE layers, experts; total, active and
# router parameters as the paper rounds them (M = 1e6, B = 1e9, K = 1e3)
TABLE_4: dict[str, dict[str, Any]] = {
    "dense-283m": dict(layers=10, width=768, heads=(12, 3), ff=3072, moe=0, experts=None,
                       total=283e6, active=283e6, router=0, unit=1e6),
    "300m": dict(layers=8, width=320, heads=(8, 2), ff=2048, moe=4, experts=26,
                 total=297e6, active=108e6, router=33e3, unit=1e6),
    "dense-1b": dict(layers=18, width=1536, heads=(24, 6), ff=6144, moe=0, experts=None,
                     total=1.01e9, active=1.01e9, router=0, unit=1e7),
    "1b": dict(layers=9, width=768, heads=(12, 3), ff=3072, moe=4, experts=27,
               total=1.01e9, active=302e6, router=83e3, unit=1e6),
}  # fmt: skip

# Abstract and Table 1: the four maps, each trained with K = 2 (Table 3 caption)
MAPS = {
    "softmax": ("softmax", None),
    "entmax15": ("entmax", 1.5),
    "sparsemax": ("sparsemax", None),
    "normmax2": ("normmax", 2.0),
}

# Table 6 and 8: the MoE layers sit at network depths 2, 4, 6 and 8 (1-based blocks)
MOE_DEPTHS = [2, 4, 6, 8]

# Tables 3 and 9: the frozen-weight budgets
BUDGETS = (1, 2, 4, 8)

UNSTATED = (
    "seq_len",
    "batch_size",
    "steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "betas",
    "grad_clip",
    "router.aux_weight",
    "vocab_size",
    "eval_batches",
    "data",
    "seed",
)
"""Training settings the paper does not state: moelab's choice, marked as such."""


@pytest.fixture(scope="module")
def paper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("paper")
    return out, run_study("sparse-maps", out, scale="paper", progress=False)


def _arm(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / "paper" / f"{name}.json").read_text())


def _size(name: str) -> str:
    return name if name.startswith("dense") else name.rsplit("-", 1)[1]


def test_paper_scale_trains_nothing_and_lists_every_arm(paper) -> None:
    out, doc = paper
    assert doc["trained"] is False and not (out / "runs").exists()
    names = [c["arm"] for c in doc["configs"]]
    assert names == [
        "dense-283m",
        *(f"{m}-300m" for m in MAPS),
        # the softmax-balanced variant of each sparse map (Figure 6: 300M)
        *(f"{m}-sb-300m" for m in MAPS if m != "softmax"),
        "dense-1b",
        *(f"{m}-1b" for m in MAPS),
    ]
    commands = (out / "paper" / "commands.sh").read_text().splitlines()
    assert sum(c.startswith("torchrun --nproc-per-node 8 -m moelab train") for c in commands) == 13
    # dense references are part of the paper scale without --dense
    assert [a.name for a in SparseMapsStudy().arms("paper", {})] == names


@pytest.mark.parametrize(
    "name", ["dense-283m", *(f"{m}-300m" for m in MAPS), "dense-1b", "softmax-1b"]
)
def test_architecture_and_parameter_counts_match_table_4(paper, name: str) -> None:
    out, _ = paper
    arm = _arm(out, name)
    want = TABLE_4[_size(name)]
    mc = TrainConfig.from_dict(arm["config"]).model_config()
    assert (mc.n_layers, mc.d_model, (mc.n_heads, mc.n_kv_heads), mc.d_ff) == (
        want["layers"],
        want["width"],
        want["heads"],
        want["ff"],
    )
    assert len(mc.moe_indices) == want["moe"]
    if want["moe"]:
        assert mc.n_experts == want["experts"]
        assert [b + 1 for b in mc.moe_indices] == MOE_DEPTHS
    counts = arm["params"]
    unit = want["unit"]
    assert abs(counts["total"] - want["total"]) <= unit / 2, counts
    assert abs(counts["active"] - want["active"]) <= unit / 2, counts
    assert abs(counts["router"] - want["router"]) <= 500, counts


def test_moelab_params_prints_the_arm_counts(paper, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = paper
    for name in ("dense-283m", "softmax-300m", "dense-1b", "softmax-1b"):
        arm = _arm(out, name)
        assert cli.main(["params", "--preset", arm["config"]["preset"], "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert {k: printed[k] for k in ("total", "active", "router")} == arm["params"]


@pytest.mark.parametrize("size", ["300m", "1b"])
def test_routers_are_the_papers_four_maps_at_top_2(paper, size: str) -> None:
    out, _ = paper
    for name, (map_name, alpha) in MAPS.items():
        arm = _arm(out, f"{name}-{size}")
        rc = TrainConfig.from_dict(arm["config"]).model_config().router_config()
        assert (rc.map, rc.top_k) == (map_name, 2)
        if alpha is not None:
            assert rc.alpha == alpha
        # Table 2 caption: the main models balance with the map's own probabilities
        assert rc.aux_probs == "map" and rc.aux_weight > 0
        assert arm["sources"]["router.map"].startswith("stated:")
        assert arm["sources"]["preset"].startswith("stated: Table 4")
        if size == "300m" and name != "softmax":
            sb = _arm(out, f"{name}-sb-300m")
            rc_sb = TrainConfig.from_dict(sb["config"]).model_config().router_config()
            assert (rc_sb.map, rc_sb.top_k, rc_sb.alpha) == (rc.map, 2, rc.alpha)
            assert rc_sb.aux_probs == "softmax" and rc_sb.aux_weight == rc.aux_weight
            assert sb["config"]["preset"] == arm["config"]["preset"] == "paper-300m"
            assert sb["sources"]["router.aux_probs"].startswith("stated:")
    assert TOP_KS == BUDGETS


def test_every_value_is_stated_or_marked_moelabs_choice(paper) -> None:
    out, doc = paper
    sources = doc["sources"]
    for key in UNSTATED:
        assert sources[key].startswith("moelab's choice"), key
    for key in ("preset", "router.top_k", "router.aux_probs"):
        assert sources[key].startswith("stated:"), key
    assert all(v.startswith(("stated:", "moelab's choice")) for v in sources.values())
    arm = _arm(out, "entmax15-1b")
    assert arm["sources"]["router.alpha"].startswith("stated:")
    assert arm["sources"]["preset"].endswith("(paper-1b)")
    config = arm["config"]
    # the moelab choices are what the config holds
    assert (config["seq_len"], config["batch_size"], config["steps"]) == (2048, 256, 20000)
    assert (config["lr"], config["min_lr"], config["warmup_steps"]) == (6e-4, 6e-5, 2000)
    report = (out / "report.md").read_text()
    assert "moelab's choice" in report and "stated: Table 4" in report
