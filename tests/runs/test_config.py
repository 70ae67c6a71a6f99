"""moelab.runs.config.read_config: a run's config.json read back, or refused in one line
that names the file and the field and says to put the run's own back (never to start
over); flat: nested settings as dotted keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moelab.runs import read_config
from moelab.runs.config import flat
from moelab.train import TrainConfig


def _run(tmp_path: Path, content: Any) -> Path:
    (tmp_path / "config.json").write_text(
        content if isinstance(content, str) else json.dumps(content)
    )
    return tmp_path


def test_a_runs_settings_read_back(tmp_path: Path) -> None:
    saved = TrainConfig(steps=7).to_dict()
    assert read_config(_run(tmp_path, saved)) == json.loads(json.dumps(saved))


def test_a_folder_without_config_json_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a moelab run folder"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{oops", "is not valid JSON"),
        ([1, 2], "holds an array ([1, 2]), not an object of the run's settings"),
        (None, "holds null"),
        ({"seq_len": "8"}, 'seq_len is "8", not a whole number'),
        ({"model": {"router": 3}}, "model.router is 3, not an object"),
        ({"run_info": 3}, "run_info is 3, not an object"),
        ({"steps": -1}, "is not a valid run config"),
    ],
)
def test_a_config_json_that_is_not_a_runs_settings_is_one_line(
    tmp_path: Path, content: Any, says: str
) -> None:
    run = _run(tmp_path, content)
    with pytest.raises(ValueError) as err:
        read_config(run)
    message = str(err.value)
    assert "\n" not in message and str(run / "config.json") in message
    assert says in message, message
    assert "put the run's own config.json back" in message


def test_the_fix_names_the_newest_checkpoints_settings(tmp_path: Path) -> None:
    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match=r"step_00000004/state\.json holds the run's settings"):
        read_config(_run(tmp_path, [1]))


def test_flat_spells_nested_settings_as_dotted_keys() -> None:
    nested = {"n_layers": 2, "router": {"map": "entmax", "ks": (1, 2)}}
    assert flat(nested, "model.") == {
        "model.n_layers": 2,
        "model.router.map": "entmax",
        "model.router.ks": [1, 2],
    }
