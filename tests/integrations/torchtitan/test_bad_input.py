"""What the torchtitan bridge refuses, each in one line: unknown and fixed keys, a model
without a router, routings the engine's dispatch cannot hold, another engine version."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from moelab.integrations.torchtitan import MoelabRouterConverter, check_version, swap_routers
from tests.integrations.torchtitan.tiny import build, moe_config


@pytest.fixture(scope="module")
def moe_state():
    return build(moe_config(top_k=2)).state_dict()


def _moe(state, load_balance: float | None = 1e-3):
    moe = build(moe_config(top_k=2, load_balance=load_balance))
    if load_balance is not None:
        moe.load_state_dict(state)
    return moe


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text
    for w in words:
        assert w in text, text


@pytest.mark.parametrize(
    "keys,words",
    [
        ({"mapp": "entmax"}, ("unknown router key 'mapp'", "did you mean 'map'")),
        ({"d_model": 16}, ("d_model comes from the torchtitan model",)),
        ({"map": "entmax", "alpha": 0.5}, ("alpha",)),
        ({"selection": "expert_choice"}, ("expert_choice", "token-choice")),
        ({"selection": "hash", "vocab_size": 10}, ("hash", "token id")),
        ({"n_null_experts": 1, "null_expert": "identity"}, ("identity", "null_expert='zero'")),
        ({"top_k": 3}, ("3 slots", "top_k=2", "MoelabRouterConverter")),
        ({"bias_rate": 1e-3}, ("load_balance_coeff", "drop bias_rate")),
        ({"bias_update": "quantile"}, ("load_balance_coeff", "bias_update='quantile'")),
    ],
    ids=lambda v: str(v)[:40],
)
def test_refused(moe_state, keys, words):
    moe = _moe(moe_state)
    with pytest.raises(ValueError) as err:
        swap_routers(moe, **keys)
    _one_line(err, *words)


def test_bias_rate_without_engine_balancing(moe_state):
    moe = _moe(moe_state, load_balance=None)
    swap_routers(moe, bias_rate=1e-3)
    assert moe.router.router.config.bias_rate == 1e-3


def test_no_router():
    with pytest.raises(ValueError) as err:
        swap_routers(torch.nn.Linear(4, 4))
    _one_line(err, "no torchtitan TokenChoiceTopKRouter", "(none)")


def test_swapped_twice(moe_state):
    moe = _moe(moe_state)
    swap_routers(moe)
    with pytest.raises(ValueError) as err:
        swap_routers(moe)
    _one_line(err, "swapped already")


def test_converter_bad_input():
    with pytest.raises(ValueError) as err:
        MoelabRouterConverter.Config(router_keys={"alhpa": 1.5}).build()
    _one_line(err, "unknown router key 'alhpa'")
    converter = MoelabRouterConverter.Config(router_keys={}, fqns=["nowhere"]).build()
    with pytest.raises(ValueError) as err:
        converter.convert(moe_config())
    _one_line(err, "no MoE", "nowhere")
    converter = MoelabRouterConverter.Config(router_keys={"k_total": 4.0}).build()
    with pytest.raises(ValueError) as err:
        converter.convert(moe_config())
    _one_line(err, "k_total", "swap_routers")


def test_engine_version(monkeypatch):
    assert check_version() == "0.3.0"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.1")
    with pytest.raises(ImportError) as err:
        check_version()
    _one_line(err, "torchtitan==0.3.0", "torchtitan 0.2.1 is installed")
