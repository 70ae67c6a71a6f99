"""docs/extending.md, "Adding a command": the page's new module (the toy
``moelab/cli/hello.py``, run from the page's code block) and one line in
``moelab.cli.COMMANDS`` make a command
that --help lists, that prints one JSON document with --json and whose user error is
one line with exit code 2."""

from __future__ import annotations

import json

import pytest

from moelab import cli
from tests._docs import install_page_module


@pytest.fixture
def hello(monkeypatch: pytest.MonkeyPatch) -> None:
    install_page_module(monkeypatch, "extending.md", "moelab.cli.hello")  # the new file
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "hello"))  # the registry line


def test_a_new_command_is_one_module_and_one_line(hello, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "say hello (a toy command)" in capsys.readouterr().out
    assert cli.main(["hello", "world", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"name": "world", "times": 1}
    assert cli.main(["hello", "world", "--times", "3"]) == 0
    assert capsys.readouterr().out == "hello, world (3 times)\n"
    assert cli.main(["hello", "world", "--times", "0", "--json"]) == 2
    out, err = capsys.readouterr()
    assert err == "moelab hello: error: --times must be >= 1, got 0\n"
    assert json.loads(out) == {"error": "--times must be >= 1, got 0"}
    with pytest.raises(ValueError, match="--times must be >= 1"):
        cli.main(["hello", "world", "--times", "0", "--debug"])
