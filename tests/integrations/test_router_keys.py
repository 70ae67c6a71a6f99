"""The key rules the engine bridges share (moelab.integrations.router_keys), on plain
dicts and RouterConfigs, with no engine installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moelab.integrations.router_keys import check_keys, merge_keys, refuse_undispatchable
from moelab.routing.config import RouterConfig


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, text


def test_imports_no_engine():
    code = (
        "import sys, moelab.integrations.router_keys\n"
        "bad = [m for m in ('torchtitan', 'olmo_core', 'transformers', 'megatron') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_keys_accepts_fields_aliases_and_extras():
    check_keys({"map": "entmax", "alpha": 1.5, "threshold": 0.1}, "X")
    check_keys({"k_total": 4.0}, "X", extra=("k_total",))
    check_keys({"scorer_bias": True}, "X")  # fixed only where the engine says so


@pytest.mark.parametrize(
    ("given", "kw", "words"),
    [
        ({"d_model": 8}, {}, ("d_model comes from the Eng model", "do not pass it")),
        ({"scorer_bias": True}, {"fixed": ("scorer_bias",)}, ("scorer_bias comes from",)),
        ({"mapp": "entmax"}, {}, ("unknown router key 'mapp' (did you mean 'map'?)", "Eng")),
        ({"zzz": 1, "qqq": 2}, {}, ("unknown router keys 'zzz', 'qqq' for Eng",)),
        ({"k_totl": 1}, {"extra": ("k_total",)}, ("did you mean 'k_total'", "or k_total")),
    ],
)
def test_check_keys_refuses_in_one_line(given, kw, words):
    with pytest.raises(ValueError) as err:
        check_keys(given, "Eng", **kw)
    _one_line(err, *words)


ENGINE = {"d_model": 8, "n_experts": 8, "top_k": 2, "renorm": True, "n_groups": 4}
ENGINE |= {"topk_groups": 2}


def test_merge_gate_key_replaces_the_engines():
    keys = merge_keys(ENGINE | {"straight_through": False}, {"gate": "probs"})
    assert keys["gate"] == "probs" and "renorm" not in keys and "straight_through" not in keys
    assert merge_keys(ENGINE, {"map": "entmax"}) == ENGINE | {"map": "entmax"}


def test_merge_selection_without_groups_drops_them():
    keys = merge_keys(ENGINE, {"selection": "top_p"})
    assert "n_groups" not in keys and "topk_groups" not in keys and "rank_by" not in keys
    keys = merge_keys(ENGINE, {"selection": "top_p"}, rank_by_without_groups="probs")
    assert keys["rank_by"] == "probs" and "n_groups" not in keys
    given = {"selection": "top_p", "rank_by": "logits"}
    assert merge_keys(ENGINE, given, rank_by_without_groups="probs")["rank_by"] == "logits"
    # a rule that runs after group-limited choice, or groups given: the groups stay
    assert merge_keys(ENGINE, {"selection": "topk"})["n_groups"] == 4
    given = {"selection": "top_p", "n_groups": 2}
    assert merge_keys(ENGINE, given)["n_groups"] == 2
    # no groups to drop: rank_by stays as the engine's keys set it
    plain = {"d_model": 8, "n_experts": 8, "top_k": 2}
    assert "rank_by" not in merge_keys(
        plain, {"selection": "top_p"}, rank_by_without_groups="probs"
    )
    RouterConfig(**merge_keys(ENGINE, {"selection": "top_p"}, rank_by_without_groups="probs"))


def _config(**keys):
    return RouterConfig(**({"d_model": 8, "n_experts": 8, "top_k": 2} | keys))


@pytest.mark.parametrize(
    ("keys", "kw", "words"),
    [
        ({"selection": "expert_choice"}, {}, ("expert_choice", "token-choice", "the Eng MoE")),
        ({"selection": "hash", "vocab_size": 10}, {}, ("token id", "Eng")),
        ({"n_null_experts": 1, "null_expert": "identity"}, {}, ("identity", "'zero'")),
        ({"n_null_experts": 1, "null_expert": "constant"}, {}, ("learned vector", "Eng")),
        ({"top_k": 3}, {"top_k": 2}, ("3 slots", "top_k=2", "cap the rule at 2")),
        ({"top_k": 3}, {"top_k": 2, "raise_top_k": "widen it"}, ("or widen it",)),
    ],
)
def test_refuse_undispatchable(keys, kw, words):
    with pytest.raises(ValueError) as err:
        refuse_undispatchable(_config(**keys), "Eng", **kw)
    _one_line(err, *words)


def test_held_routings_pass():
    refuse_undispatchable(_config(n_null_experts=2, null_expert="zero"), "Eng", top_k=2)
    refuse_undispatchable(_config(top_k=1), "Eng", top_k=2)  # fewer slots: padded
    refuse_undispatchable(_config(top_k=4), "Eng")  # no width given: not checked
    refuse_undispatchable(_config(selection="expert_choice"), "Eng", expert_choice=True)
