"""--help of the top command and of every sub-command without torch (it took seconds:
`import moelab` and the parsers loaded it): the help's defaults are read from the
modules' sources, and checked here against the modules themselves."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from moelab.cli.common import preset_names, source_literals
from tests.cli.make_help_snapshot import help_texts

_NO_TORCH = """
import sys
sys.modules["torch"] = None  # an import of torch fails
sys.modules["numpy"] = None
from moelab import cli
for argv in {argvs!r}:
    try:
        cli.main([*argv, "--help"])
    except SystemExit as stop:
        assert stop.code == 0, (argv, stop.code)
    else:
        raise AssertionError(argv)
"""


def _commands() -> list[list[str]]:
    """Every command line whose --help the snapshot holds ("data-prepare" -> data prepare)."""
    names = [n.removesuffix(".txt") for n in help_texts()]
    return [[] if n == "moelab" else n.split("-") for n in names]


def test_every_help_without_torch() -> None:
    argvs = _commands()
    assert ["train"] in argvs and ["data", "prepare"] in argvs and [] in argvs
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(argvs=argvs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_import_moelab_does_not_load_torch() -> None:
    code = "import sys, moelab; assert 'torch' not in sys.modules; print(moelab.maps.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "moelab.maps"  # the lazy names still resolve


def test_lazy_names_are_the_modules_own() -> None:
    import moelab
    from moelab import moe, routing

    assert moelab.MoE is moe.MoE and moelab.RouterConfig is routing.RouterConfig
    with pytest.raises(AttributeError):
        moelab.no_such_name  # noqa: B018


def test_help_defaults_are_the_modules_own() -> None:
    from moelab.cli.train import _SHOWN, _train_defaults
    from moelab.data import prepare, sources
    from moelab.model import available_presets
    from moelab.train import TrainConfig

    assert preset_names() == available_presets()
    expected = ", ".join(
        f"{f.name}={f.default!r}"
        for f in dataclasses.fields(TrainConfig)
        if f.name not in _SHOWN and f.default is not dataclasses.MISSING
    )
    assert _train_defaults() == expected
    names = ("DEFAULT_VOCAB_SIZE", "DEFAULT_SAMPLE_CHARS", "DEFAULT_VAL_FRACTION", "DEFAULT_SEED")
    assert source_literals("moelab.data.prepare", *names) == {n: getattr(prepare, n) for n in names}
    assert source_literals("moelab.data.sources", "FORMATS") == {"FORMATS": sources.FORMATS}
