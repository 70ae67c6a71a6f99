"""Each routing stage takes a small frozen config of its own settings, which RouterConfig
(the flat, public front) builds; the checks that span two stages live in
moelab/routing/pairings.py, and a stage's config refuses a bad setting by itself with
the message RouterConfig gives."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import moelab
from moelab.routing import RouterConfig, gates, losses, selection
from moelab.routing.mapping import MapConfig
from moelab.routing.scorer import ScorerConfig
from moelab.routing.temperature import TemperatureConfig

ROUTING = Path(moelab.__file__).resolve().parent / "routing"


def test_router_config_builds_each_stage_config() -> None:
    rc = RouterConfig(
        d_model=6, n_experts=8, top_k=3, map="entmax", gate="renorm", routed_scaling=2.0,
        n_null_experts=2, schedule="cosine", aux_scope="sequence", z_loss_weight=0.1,
    )  # fmt: skip
    assert rc.scorer_config == ScorerConfig(6, 10, 0.02, False)
    assert rc.map_config == MapConfig("entmax", 8, 1.5, None)  # the map's default alpha
    assert rc.gate_config == gates.GateConfig("renorm", 2.0)
    assert rc.temperature_config == TemperatureConfig(d_model=6, schedule="cosine")
    sel = rc.selection_config
    assert (sel.selection, sel.n_experts, sel.top_k) == ("topk", 8, 3)
    bal = rc.balancing_config
    assert (bal.n_experts, bal.n_scored, bal.aux_scope, bal.z_loss_weight) == (
        8,
        10,
        "sequence",
        0.1,
    )
    for config in (rc.scorer_config, rc.map_config, rc.gate_config, sel, bal):
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.n_experts = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "key", "message"),
    [
        (lambda: TemperatureConfig(d_model=4, tau_min=0), "tau_min", "tau_min must be > 0"),
        (lambda: MapConfig("entmax", 8, alpha=1.0), "alpha", "alpha"),
        (lambda: gates.GateConfig("map", 0.0), "routed_scaling", "routed_scaling must be"),
        (lambda: selection.SelectionConfig(8, top_p=0), "top_p", r"top_p must lie in \(0, 1\]"),
        (lambda: losses.BalancingConfig(8, 8, aux_scope="x"), "aux_scope", "aux_scope must"),
        (lambda: ScorerConfig(0, 8), "d_model", "d_model and n_experts must be positive"),
    ],
)
def test_a_stage_config_refuses_alone_as_router_config_does(build, key, message) -> None:
    with pytest.raises(ValueError, match=message) as alone:
        build()
    values = {"tau_min": 0, "alpha": 1.0, "routed_scaling": 0.0, "top_p": 0, "aux_scope": "x"}
    flat = {"d_model": 0} if key == "d_model" else {key: values[key]}
    if key == "alpha":
        flat["map"] = "entmax"
    with pytest.raises(ValueError) as front:
        RouterConfig(**{"d_model": 4, "n_experts": 8, **flat})
    assert str(front.value) == str(alone.value)


def test_the_check_that_spans_gate_and_selection_lives_in_the_wiring() -> None:
    # a stage alone accepts it: the gate knows no K, top-K knows no gate
    assert selection.SelectionConfig(8, top_k=1).top_k == 1
    assert gates.GateConfig("renorm").rule == "renorm"
    with pytest.raises(ValueError, match="renorm with top_k=1 makes every gate weight 1"):
        RouterConfig(d_model=4, n_experts=8, top_k=1, renorm=True)
    # hash routing with K = 1 and renorm is the paper's plain hash layer: allowed
    RouterConfig(d_model=4, n_experts=8, top_k=1, renorm=True, selection="hash", vocab_size=9)


def test_no_stage_reads_router_config() -> None:
    """Only the front (config.py), the wiring (router.py) and the package's __init__
    name RouterConfig in an import."""
    importers = set()
    for path in sorted(ROUTING.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and any(
                a.name == "RouterConfig" for a in node.names
            ):
                importers.add(str(path.relative_to(ROUTING)))
    assert importers == {"__init__.py", "router.py"}
