from __future__ import annotations

import pytest

from moelab.train import TrainConfig, apply_overrides
from moelab.train.config import parse_value


def test_parse_value() -> None:
    assert parse_value("3") == 3
    assert parse_value("1e-3") == pytest.approx(1e-3)
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("None") is None and parse_value("null") is None
    assert parse_value("[0.9, 0.99]") == [0.9, 0.99]
    assert parse_value("entmax") == "entmax"


def test_apply_overrides_nested_keys() -> None:
    base = TrainConfig()
    cfg = apply_overrides(
        base,
        [
            "router.map=entmax",
            "model.router.alpha=1.5",
            "lr=1e-3",
            "n_layers=2",
            "model.d_model=64",
            "betas=[0.8, 0.9]",
            "data=some/folder",
        ],
    )
    assert cfg.model == {"router": {"map": "entmax", "alpha": 1.5}, "n_layers": 2, "d_model": 64}
    assert cfg.lr == pytest.approx(1e-3) and cfg.betas == (0.8, 0.9)
    assert cfg.data == "some/folder"
    mc = cfg.model_config()
    assert (mc.n_layers, mc.d_model) == (2, 64)
    assert mc.router_config().map == "entmax" and mc.router_config().alpha == 1.5
    assert base.lr == TrainConfig().lr and base.model == {}  # the input is unchanged


def test_shortcuts_override_router() -> None:
    cfg = TrainConfig(map="sparsemax", top_k=1, model={"router": {"map": "softmax"}})
    rc = cfg.model_config().router_config()
    assert (rc.map, rc.top_k) == ("sparsemax", 1)


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("nosuchkey=1", "unknown config key 'nosuchkey'"),
        ("router.nosuch=1", "unknown router key 'router.nosuch'"),
        ("model.nosuch=1", "unknown config key 'model.nosuch'"),
        ("lr.x=1", "has no sub-keys"),
        ("lr", "key=value"),
    ],
)
def test_apply_overrides_errors(item: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(TrainConfig(), [item])


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="max_seq_len"):
        TrainConfig(seq_len=4096)
    with pytest.raises(ValueError, match="device"):
        TrainConfig(device="tpu")
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="nope")
