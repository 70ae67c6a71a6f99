"""docs/extending.md, "Adding a study": the page's toy study (run from its code block)
and its one line in ``moelab.studies.STUDIES`` make a study that ``moelab study`` lists,
trains at the quick scale and reports, and whose paper scale is refused in one line."""

from __future__ import annotations

import json

import pytest

from moelab import cli, studies
from tests._docs import install_page_module
from tests.train import make_corpus


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    install_page_module(monkeypatch, "extending.md", "moelab.studies.toy")  # the new file
    monkeypatch.setitem(studies.STUDIES, "toy", ("moelab.studies.toy", "ToyStudy"))  # the line


def test_a_new_study_is_one_module_and_one_line(toy, tmp_path, capsys) -> None:
    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    out = tmp_path / "out"
    args = ["study", "toy", "--scale", "quick", "--data", str(corpus), "--out", str(out)]
    assert cli.main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (table,) = doc["tables"]
    assert table["key"] == "toy-main"
    assert [r["arm"] for r in table["rows"]] == ["softmax, top-2", "sparsemax, top-2"]
    for arm, row in zip(("softmax", "sparsemax"), table["rows"], strict=True):
        run = out / "runs" / arm / "seed0"
        config = json.loads((run / "config.json").read_text())
        assert config["model"]["router"]["map"] == arm
        assert config["model"]["router"]["top_k"] == 2 and config["steps"] == 8
        summary = json.loads((run / "summary.json").read_text())
        assert row["val_loss"]["values"] == [summary["val_loss"]]
    assert "## Validation loss" in (out / "report.md").read_text()
    assert cli.main(["study", "toy", "--scale", "paper", "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err == (
        "moelab study: error: toy has no paper scale; use --scale quick or --scale cpu\n"
    )
