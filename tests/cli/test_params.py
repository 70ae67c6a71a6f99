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


_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


@pytest.mark.parametrize("experts", ["4", "64000", "1000000000", "100000000000"])
def test_params_text_of_huge_models(capsys: pytest.CaptureFixture[str], experts: str) -> None:
    # the short figure beside each exact count reads back as that count (0.5% at most
    # off: three significant figures or more) and is short (was "196864.00B")
    assert cli.main(["params", "--preset", "tiny", "--set", f"n_experts={experts}"]) == 0
    for line in capsys.readouterr().out.splitlines()[1:]:
        short, exact = line.split()[1], int(line.split("(")[1].rstrip(")").replace(",", ""))
        if exact < 1000:
            assert short == str(exact)
            continue
        value = float(short[:-1]) * _UNITS[short[-1]] if short[-1] in _UNITS else float(short)
        assert value == pytest.approx(exact, rel=5e-3), line
        assert len(short) <= 8, line
