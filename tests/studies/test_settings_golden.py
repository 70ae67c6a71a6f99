"""Every study's arm configs at every scale, against a golden record
(tests/studies/golden_arm_configs.json): the full TrainConfig of each arm (seed 0) and,
at the paper scale, the train command it writes to commands.sh. Refactors of the
studies' settings must leave both exactly as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.studies import STUDIES, get_study
from moelab.studies.core import SCALES, arm_config, train_command

GOLDEN = Path(__file__).with_name("golden_arm_configs.json")
OPTIONS = ({}, {"dense": True})


def _record(name: str, scale: str, options: dict) -> dict:
    study = get_study(name)
    common = dict(study.common(scale))
    common.setdefault("progress", True)
    if scale == "paper":
        common = {k: v for k, v in common.items() if k not in ("threads", "progress")}
    arms = {}
    for arm in study.arms(scale, options):
        out = f"OUT/runs/{arm.name}/seed0"
        rec = {
            "label": arm.label,
            "config": arm_config(common, arm, 0, Path(out)).to_dict(),
        }
        if scale == "paper":
            rec["command"] = train_command(common, arm, 0, out, launcher=study.launcher)
        arms[arm.name] = rec
    return arms


def _cases() -> list[tuple[str, str, dict]]:
    cases = []
    for name in STUDIES:
        for scale in SCALES:
            if scale == "paper" and get_study(name).paper_refusal:
                continue
            for options in OPTIONS:
                cases.append((name, scale, options))
    return cases


def _key(name: str, scale: str, options: dict) -> str:
    return f"{name}/{scale}/{json.dumps(options, sort_keys=True)}"


def _all() -> dict:
    return {_key(*c): _record(*c) for c in _cases()}


@pytest.mark.parametrize("case", _cases(), ids=lambda c: _key(*c))
def test_arm_configs_match_the_golden_record(case):
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    # NOTE: through JSON, so that tuples and lists compare as the file holds them
    got = json.loads(json.dumps(_record(*case)))
    assert got == golden[_key(*case)]


def test_the_golden_record_has_every_case():
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert sorted(golden) == sorted(_key(*c) for c in _cases())


if __name__ == "__main__":  # regenerate: python -m tests.studies.test_settings_golden
    GOLDEN.write_text(json.dumps(_all(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
