"""Every command's ``--help`` is the golden text of ``help_snapshot/`` (made by
``make_help_snapshot.py``): the command line's refactors change no flag, default or
help line unless the snapshot is remade in a commit that says what moved."""

from __future__ import annotations

import pytest

from tests.cli.make_help_snapshot import SNAPSHOT, help_texts


@pytest.fixture(scope="module")
def texts(request) -> dict[str, str]:
    mp = pytest.MonkeyPatch()
    mp.setenv("COLUMNS", "100")
    try:
        return help_texts()
    finally:
        mp.undo()


def test_the_same_commands_have_a_help(texts):
    assert sorted(texts) == sorted(p.name for p in SNAPSHOT.glob("*.txt"))


def test_every_help_is_the_snapshot(texts):
    for name, text in texts.items():
        assert text == (SNAPSHOT / name).read_text(), f"--help of {name} changed"
