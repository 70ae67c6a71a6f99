"""Router keys renamed so that one name means one thing: ``truncation`` (the cut on p;
was ``threshold``, a word the maps' singleton gap threshold also uses),
``truncation_relative`` (was ``threshold_relative``) and ``token_cap_factor`` (the
per-token cap; was ``cap_factor``, beside the per-expert ``capacity_factor``). The old
names stay accepted: as keyword arguments, as attributes, through ``--set`` (parsed by
the new field's type) and in saved configs."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from moelab.routing import Router, RouterConfig
from moelab.routing.config import ALIASES, canonical_keys
from moelab.train import TrainConfig, apply_overrides

OLD = {"threshold": 0.25, "threshold_relative": True, "cap_factor": 1.5}
NEW = {"truncation": 0.25, "truncation_relative": True, "token_cap_factor": 1.5}
LAPSUM = {"map": "lapsum", "lapsum_k": 2.0, "selection": "threshold"}


def test_old_keyword_names_build_the_same_config() -> None:
    assert ALIASES == {
        "threshold": "truncation",
        "threshold_relative": "truncation_relative",
        "cap_factor": "token_cap_factor",
    }
    old = RouterConfig(d_model=8, n_experts=8, **LAPSUM, **OLD)
    new = RouterConfig(d_model=8, n_experts=8, **LAPSUM, **NEW)
    assert old == new and old.slots == 3  # ceil(2 * 1.5)
    assert (old.threshold, old.threshold_relative, old.cap_factor) == (0.25, True, 1.5)
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    assert set(NEW) <= fields and not set(OLD) & fields  # saved configs use the new names
    old.cap_factor = 2.0  # the old attribute writes the new field
    assert old.token_cap_factor == 2.0 and old.slots == 4
    assert RouterConfig(d_model=8, n_experts=8, cap_factor=None).token_cap_factor is None


def test_old_and_new_name_of_one_key_must_agree() -> None:
    same = RouterConfig(d_model=8, n_experts=8, **LAPSUM, threshold=0.3, truncation=0.3)
    assert same.truncation == 0.3
    with pytest.raises(ValueError, match=r"old name of router\.token_cap_factor; give one"):
        RouterConfig(d_model=8, n_experts=8, cap_factor=1.0, token_cap_factor=2.0)
    with pytest.raises(ValueError, match=r"token_cap_factor \(cap_factor\) must be > 0"):
        RouterConfig(d_model=8, n_experts=8, cap_factor=0.0)
    assert canonical_keys({"map": "lapsum", "cap_factor": 2}) == {
        "map": "lapsum",
        "token_cap_factor": 2,
    }


def test_router_attribute_and_checkpoint_state_under_the_old_name() -> None:
    router = Router(RouterConfig(d_model=8, n_experts=8, **LAPSUM, threshold=0.3))
    assert router.truncation == router.threshold == 0.3
    router.threshold = 0.4
    assert router.truncation == 0.4 and router.effective_threshold() == 0.4
    # a checkpoint written before the rename holds the cut as "threshold"
    fresh = Router(RouterConfig(d_model=8, n_experts=8, **LAPSUM))
    fresh.set_extra_state({"top_k": 3, "threshold": 0.125})
    assert (fresh.top_k, fresh.truncation) == (3, 0.125)
    assert fresh.get_extra_state() == {"top_k": 3, "truncation": 0.125}


def test_set_accepts_old_names_parsed_as_the_new_fields_type() -> None:
    base = TrainConfig(map="lapsum", model={"router": {"lapsum_k": 2.0, "selection": "threshold"}})
    cfg = apply_overrides(
        base, ["router.threshold=0.5", "router.threshold_relative=yes", "router.cap_factor=2"]
    )
    assert cfg.model["router"] == {
        "lapsum_k": 2.0,
        "selection": "threshold",
        "truncation": 0.5,
        "truncation_relative": True,  # "yes" read as a bool: the field's type
        "token_cap_factor": 2.0,
    }
    rc = cfg.model_config().router_config()
    assert (rc.truncation, rc.truncation_relative, rc.token_cap_factor) == (0.5, True, 2.0)
    off = apply_overrides(cfg, ["model.router.cap_factor=none"])
    assert off.model_config().router_config().token_cap_factor is None
    with pytest.raises(ValueError, match=r"router\.threshold takes a finite float; got 'high'"):
        apply_overrides(base, ["router.threshold=high"])
    with pytest.raises(ValueError, match=r"unknown router key 'router\.thresh'.*old names: cap"):
        apply_overrides(base, ["router.thresh=1"])


def test_a_new_name_overrides_an_old_one_given_before(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"lapsum_k": 2.0, "selection": "threshold", "cap_factor": 1.5}
    cfg = apply_overrides(
        {"map": "lapsum", "model": {"router": old}}, ["router.token_cap_factor=3"]
    )
    assert (
        cfg.model["router"]["token_cap_factor"] == 3.0 and "cap_factor" not in cfg.model["router"]
    )
    # a preset's router table and the overrides merge by the new names: an override in
    # either spelling replaces the preset's value
    from moelab.train import config as train_config

    preset = train_config.preset_data("tiny")
    preset["router"] = {"map": "lapsum", "lapsum_k": 2.0, "selection": "threshold"}
    for spelling in ("cap_factor", "token_cap_factor"):
        preset["router"][spelling] = 1.5
        table = copy.deepcopy(preset)
        monkeypatch.setattr(train_config, "preset_data", lambda name, t=table: copy.deepcopy(t))
        for key in ("cap_factor", "token_cap_factor"):
            rc = TrainConfig(model={"router": {key: 3.0}}).model_config().router_config()
            assert rc.token_cap_factor == 3.0
        del preset["router"][spelling]


def test_a_saved_config_with_the_old_names_loads() -> None:
    """config.json of a run written before the rename: the resolved router with the
    old keys."""
    cfg = TrainConfig(map="lapsum", model={"router": {"lapsum_k": 2.0, **LAPSUM, **NEW}})
    saved = cfg.to_dict()
    saved["model"] = cfg.resolved_model()
    router = saved["model"]["router"]
    for old, new in ALIASES.items():
        router[old] = router.pop(new)
    assert not set(NEW) & set(router)
    loaded = TrainConfig.from_dict(saved)
    assert loaded.model_config().router_config() == cfg.model_config().router_config()
    assert loaded.resolved_model() == cfg.resolved_model()
