"""moelab report with saved Hugging Face results next to a moelab run.

The two JSON documents come from the real command line (`moelab stats --hf ... --json`,
`moelab eval --hf ... --json`) on a tiny saved Mixtral; the report's tables must hold
their numbers unchanged, beside the tiny softmax run of ``tests/report/conftest.py``."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from moelab import cli
from moelab.report import build_report
from moelab.report.report import read_result
from tests.integrations import save_tiny, tiny_text
from tests.report.conftest import capture_figures

MODEL = "tiny-mixtral"


def _cli_json(argv: list[str]) -> dict[str, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``stats.json`` and ``eval.json`` (K = 1, 2, 4) of a tiny Mixtral saved in a folder
    named tiny-mixtral, with the documents they hold."""
    root = tmp_path_factory.mktemp("hf")
    model_dir = save_tiny("mixtral", root / MODEL)
    text = root / "text.txt"
    text.write_text(tiny_text(), encoding="utf-8")
    common = ["--hf", str(model_dir), "--data", str(text), "--json"]
    stats_doc = _cli_json(["stats", *common])
    eval_doc = _cli_json(["eval", *common, "--top-k", "1", "2", "4"])
    files = {}
    for name, doc in (("stats", stats_doc), ("eval", eval_doc)):
        files[name] = root / f"{name}.json"
        files[name].write_text(json.dumps(doc), encoding="utf-8")
    return {"files": files, "stats": stats_doc, "eval": eval_doc, "model_dir": model_dir}


def _by_run(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["run"] == label]


def test_read_result_tells_stats_from_eval(hf_files: dict[str, Any]) -> None:
    assert read_result(hf_files["files"]["stats"])[0] == "stats"
    assert read_result(hf_files["files"]["eval"])[0] == "eval"


def test_report_holds_hf_rows(runs: list[Path], hf_files: dict[str, Any], tmp_path: Path) -> None:
    st, ev = hf_files["stats"], hf_files["eval"]
    assert st["run"] == ev["run"] == str(hf_files["model_dir"])  # paired by "run"
    out = tmp_path / "rep"
    argv = ["report", str(runs[0]), str(hf_files["files"]["stats"])]
    argv += [str(hf_files["files"]["eval"]), "--out", str(out), "--max-batches", "1"]
    with capture_figures() as figures:
        doc = _cli_json([*argv, "--top-k", "1", "2", "--json"])
    tables = doc["tables"]

    # routing table: the run, then one row for both files of the model, from its stats
    assert [r["run"] for r in tables["routing"]] == ["softmax", MODEL]
    (row,) = _by_run(tables["routing"], MODEL)
    mean = st["mean"]
    assert row["map"] == st["map"] == "softmax" and row["K"] == st["top_k"] == 2
    assert row["val loss"] == pytest.approx(st["nll"], rel=1e-12)
    assert row["discarded mass"] == pytest.approx(mean["discarded_mass"], rel=1e-12)
    assert row["contributors"] == pytest.approx(mean["contributors"], rel=1e-12)
    assert row["singleton %"] == pytest.approx(100 * mean["singleton_rate"], rel=1e-12)
    assert row["score RMS"] == pytest.approx(mean["score_rms"], rel=1e-12)

    # per layer, as the stats file has them
    layers = _by_run(tables["layers"], MODEL)
    assert [r["layer"] for r in layers] == [lay["layer"] for lay in st["layers"]] == [0, 1]
    for got, want in zip(layers, st["layers"], strict=True):
        assert got["discarded mass"] == pytest.approx(want["discarded_mass"], rel=1e-12)
        assert got["gap p50"] == pytest.approx(want["gap_p50"], rel=1e-12)
        assert got["block"] is None
    assert _by_run(tables["layers"], "softmax")  # the run's own layers stay

    # budget sweep: the eval file's K values, NLL and the model's own K
    (sweep,) = _by_run(tables["budget_sweep"], MODEL)
    assert sweep["trained K"] == ev["trained_top_k"] == 2
    for x in ev["results"]:
        assert sweep[f"NLL K={x['top_k']}"] == pytest.approx(x["nll"], rel=1e-12)
    assert sweep["increase trained K -> max K"] == pytest.approx(ev["nll_increase"], rel=1e-12)
    (run_sweep,) = _by_run(tables["budget_sweep"], "softmax")
    assert run_sweep["NLL K=4"] is None  # the run swept K = 1, 2 only
    detail = _by_run(tables["budget_sweep_detail"], MODEL)
    assert [r["K"] for r in detail] == [1, 2, 4]
    assert [r["trained"] for r in detail] == ["no", "yes", "no"]
    for got, want in zip(detail, ev["results"], strict=True):
        assert got["retained mass"] == pytest.approx(want["retained_mass"], rel=1e-12)
        assert got["contributors"] == pytest.approx(want["contributors"], rel=1e-12)
    line = next(
        ln for ax in figures["loss_vs_k.png"]["axes"] for ln in ax["lines"] if ln["label"] == MODEL
    )
    assert line["x"] == [1, 2, 4] and line["y"] == pytest.approx([x["nll"] for x in ev["results"]])

    # gaps and load from the stats; no certification row, no training curves
    (gap,) = _by_run(tables["gaps"], MODEL)
    assert gap["gap p90"] == pytest.approx(mean["gap_p90"], rel=1e-12)
    assert gap["threshold"] is None
    assert [r["run"] for r in tables["certification"]] == ["softmax"]
    assert (out / f"load_{MODEL}.png").is_file()
    text = (out / "report.md").read_text(encoding="utf-8")
    assert f"### Per layer: {MODEL}" in text
    assert f"Saved results (`{MODEL}`) have no training curves: left out here." in text
    assert "have no checkpoint to read the temperature" in text
    curves = [ln["label"] for ax in figures["loss_curves.png"]["axes"] for ln in ax["lines"]]
    assert "softmax: train" in curves and not any(MODEL in c for c in curves)
    tex = (out / "tables.tex").read_text(encoding="utf-8")
    assert "tiny-mixtral & softmax" in tex


def test_eval_file_alone(runs: list[Path], hf_files: dict[str, Any], tmp_path: Path) -> None:
    ev = hf_files["eval"]
    doc = build_report(
        [hf_files["files"]["eval"], runs[0]], tmp_path / "rep", top_ks=(1,), max_batches=1
    )
    row = doc["tables"]["routing"][0]
    own = next(x for x in ev["results"] if x["top_k"] == ev["trained_top_k"])
    assert row["run"] == MODEL and row["K"] == 2
    assert row["val loss"] == pytest.approx(own["nll"], rel=1e-12)
    assert row["discarded mass"] is None  # no stats file
    assert not _by_run(doc["tables"]["layers"], MODEL)
    assert not _by_run(doc["tables"]["gaps"], MODEL)
    text = Path(doc["report"]).read_text(encoding="utf-8")
    assert "No `moelab stats` result given for this model." in text


def test_wrong_json_is_one_line_error(
    runs: list[Path], hf_files: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run": "x", "rows": []}), encoding="utf-8")
    argv = ["report", str(runs[0]), str(bad), "--out", str(tmp_path / "rep")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moelab report: error: ")
    assert "neither a `moelab stats --hf ... --json` result" in err and str(bad) in err
    assert not (tmp_path / "rep").exists()  # nothing computed or written

    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        build_report([garbled], tmp_path / "rep2")
    twice = [hf_files["files"]["stats"], hf_files["files"]["stats"]]
    with pytest.raises(ValueError, match="a second `moelab stats` result for the model"):
        build_report(twice, tmp_path / "rep3")


def test_results_without_a_run(hf_files: dict[str, Any], tmp_path: Path) -> None:
    files = hf_files["files"]
    doc = build_report([files["eval"], files["stats"]], tmp_path / "rep")
    assert [r["run"] for r in doc["tables"]["routing"]] == [MODEL]
    assert doc["tables"]["certification"] == [] and "lapsum" not in doc["tables"]
    names = {Path(f).name for f in doc["files"]}
    assert {"loss_vs_k.png", "nll_vs_active.png", f"load_{MODEL}.png"} <= names
    assert "gaps.png" not in names and "radii.png" not in names
    text = Path(doc["report"]).read_text(encoding="utf-8")
    assert "No run logged a loss." in text
