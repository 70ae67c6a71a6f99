from __future__ import annotations

from typing import Any, Optional

import pytest

from moelab.routing.config import RouterConfig
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


def _router(*items: str) -> RouterConfig:
    return apply_overrides(TrainConfig(), items).model_config().router_config()


@pytest.mark.parametrize("text", ["no", "off", "false", "0", "No", "OFF", "False"])
def test_bool_override_false_words(text: str) -> None:
    # a non-empty string is truthy: "no" must not switch renormalisation on
    assert _router(f"router.renorm={text}").renorm is False
    assert apply_overrides(TrainConfig(), [f"progress={text}"]).progress is False


@pytest.mark.parametrize("text", ["yes", "on", "true", "1", "YES", "On", "True"])
def test_bool_override_true_words(text: str) -> None:
    assert _router(f"router.renorm={text}").renorm is True


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("router.renorm=maybe", r"router\.renorm takes a bool .*'maybe'"),
        ("router.renorm=2", r"router\.renorm takes a bool"),
        ("progress=", "progress takes a bool"),
        ("steps=2.5", r"steps takes an int; got '2\.5'"),
        ("router.top_k=2.5", r"router\.top_k takes an int"),
        ("top_k=true", "top_k takes an int or none/null"),
        ("lr=fast", "lr takes a finite float"),
        ("lr=nan", "lr takes a finite float"),
        ("router.alpha=high", r"router\.alpha takes a finite float or none/null"),
        ("betas=[0.9]", r"betas takes 2 floats"),
        ("betas=0.9,x", r"betas takes 2 floats"),
        ("model.n_layers=two", r"model\.n_layers takes an int"),
    ],
)
def test_override_type_errors_name_field_and_type(item: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(TrainConfig(), [item])


def test_overrides_follow_the_declared_types() -> None:
    cfg = apply_overrides(
        TrainConfig(),
        ["lr=1", "steps=30", "betas=0.8,0.9", "alpha=null", "data=None", "router.lapsum_k=2"],
    )
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # a float field takes an int
    assert cfg.steps == 30 and cfg.betas == (0.8, 0.9)
    assert cfg.alpha is None and cfg.data is None
    assert cfg.model["router"]["lapsum_k"] == 2.0
    # a string field keeps the text as it is, even when it looks like a number or a bool
    assert apply_overrides(TrainConfig(), ["out=123"]).out == "123"
    assert apply_overrides(TrainConfig(), ["device=cpu"]).device == "cpu"
    # str | list[int]: a list when it reads as one, else the string
    assert apply_overrides(TrainConfig(), ["moe_layers=1"]).model["moe_layers"] == [1]
    assert apply_overrides(TrainConfig(), ["moe_layers=[0, 1]"]).model["moe_layers"] == [0, 1]
    assert apply_overrides(TrainConfig(), ["moe_layers=all"]).model["moe_layers"] == "all"


def test_parse_value_typed() -> None:
    assert parse_value("off", bool) is False and parse_value(" On ", bool) is True
    assert parse_value("7", int) == 7
    assert parse_value("7", float) == 7.0 and isinstance(parse_value("7", float), float)
    assert parse_value("NULL", int | None) is None
    assert parse_value("null", Optional[float]) is None  # noqa: UP045 (typing.Optional too)
    assert parse_value("3", Optional[int]) == 3  # noqa: UP045
    assert parse_value("none", str) == "none"  # no None for a plain str field
    assert parse_value("[1, 2]", list[int]) == [1, 2]
    assert parse_value('{"a": 1}', dict[str, Any]) == {"a": 1}
    with pytest.raises(ValueError, match="x takes an int; got 'none'"):
        parse_value("none", int, "x")
    with pytest.raises(ValueError, match="a list of ints"):
        parse_value("[1, 2.5]", list[int], "ids")


def test_empty_data_is_an_error() -> None:
    with pytest.raises(ValueError, match="data is an empty string"):
        TrainConfig(data="")
    with pytest.raises(ValueError, match="data is an empty string"):
        apply_overrides(TrainConfig(), ["data="])
