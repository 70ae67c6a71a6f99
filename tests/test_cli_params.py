"""`moelab params`: parameter counts of a preset, as text or one JSON document."""

from __future__ import annotations

import json

import pytest

from moelab import cli
from moelab.model import available_presets, load_preset, param_counts


@pytest.mark.parametrize("preset", ["paper-300m", "tiny"])
def test_params_json(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    assert cli.main(["params", "--preset", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"preset", "total", "active", "router"}
    assert out["preset"] == preset
    assert out == {"preset": preset, **param_counts(load_preset(preset))}
    assert all(isinstance(out[k], int) for k in ("total", "active", "router"))


def test_params_json_paper_300m(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["params", "--preset", "paper-300m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["total"] / 1e6) == 297 and round(out["active"] / 1e6) == 108
    assert round(out["router"] / 1e3) == 33


def test_params_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["params", "--preset", "paper-1b"]) == 0
    text = capsys.readouterr().out
    assert "paper-1b" in text and "1.01B" in text and "302.4M" in text and "82.9K" in text


def test_params_rejects_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["params", "--preset", "no-such-model"])
    assert "invalid choice" in capsys.readouterr().err


def test_params_help_lists_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["params", "--help"])
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in available_presets())
