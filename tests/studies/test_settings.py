"""moelab.studies.settings: the scales' base settings and a study's overrides."""

from __future__ import annotations

import pytest

from moelab.studies.settings import BASE, DEFAULT, QUICK_MODEL, settings


def test_overrides_merge_into_a_copy_of_the_base():
    got = settings(
        "quick",
        {"steps": 12, "model.n_experts": 8, "model": {"router": {"top_k": 2}}, "lr": DEFAULT},
    )
    assert got["steps"] == 12 and "lr" not in got
    assert got["model"] == {**QUICK_MODEL, "n_experts": 8, "router": {"top_k": 2}}
    assert BASE["quick"]["model"] == QUICK_MODEL and QUICK_MODEL["n_experts"] == 4
    assert settings("quick") == BASE["quick"] and settings("quick") is not BASE["quick"]


def test_a_scale_without_a_base_is_refused():
    with pytest.raises(ValueError, match="no base settings"):
        settings("paper")
