"""The audit of a study's paired-difference records (moelab.studies.audit.audit) on
hand-built results documents with a planted mismatch, an unlabeled record and a missing
cell, and ``--seeds auto`` (moelab.studies.run_study_auto) on a study whose runs are
stubbed: planted per-seed values with known noise, a fake clock that each trained run
advances by a minute. The seeds it adds are checked against the t-quantiles of scipy."""

from __future__ import annotations

import copy
import json
import math

import pytest
from scipy import stats as sps

import moelab.studies.auto as auto
import moelab.studies.driver as driver
from moelab.studies import Arm, Study, StudyTable, run_study_auto
from moelab.studies.audit import audit, source_record
from moelab.studies.paired import (
    Finding,
    Source,
    findings_section,
    paired_difference,
    paired_tables,
)
from moelab.studies.tables import Section
from tests.train import TINY_MODEL, make_corpus

# --------------------------------------------------------------------------- audit


def _doc() -> dict:
    """A results document as write_outputs makes it: arms a (the reference), b, c; a
    main table with one per-seed column and one plain number; its paired table; one
    paired finding and one measure."""
    arms = {"a": "arm A", "b": "arm B", "c": "arm C"}
    main = StudyTable(
        "main",
        "Main",
        [("arm", "arm", "s"), ("loss", "loss", ".3f"), ("size", "size", "d")],
        [
            {"arm": "arm A", "loss": [1.0, 2.0, 3.5], "size": 3},
            {"arm": "arm B", "loss": [1.5, 2.25, 3.0], "size": 4},
            {"arm": "arm C", "loss": [0.5, 1.0, 4.0], "size": 5},
        ],
    )
    paired = paired_tables([main], "a", 3, arms=arms)
    found = Finding(
        "b_worse",
        "B is worse",
        "Δ loss, b − a",
        paired_difference([1.5, 2.25, 3.0], [1.0, 2.0, 3.5]),
        source=Source("main", "loss", "b", "a"),
    )
    ratio = Finding("ratio", "a ratio", "r", paired_difference([1, 2, 3], [0, 0, 0]), measure=True)
    tables = [main, *paired]
    return {
        "arms": [{"name": k, "label": v} for k, v in arms.items()],
        "seeds": [0, 1, 2],
        "reference": "a",
        "tables": [t.to_json() for t in tables],
        "findings": [f.to_json(lambda s: source_record(s, tables, arms)) for f in (found, ratio)],
    }


def test_audit_passes_labelled_records_and_names_them_in_full():
    doc = _doc()
    assert audit(doc) == []
    paired = next(t for t in doc["tables"] if t["key"] == "paired_main")
    assert [r["source"] for r in paired["rows"]] == [
        {
            "table": "main",
            "column": "loss",
            "arms": [x, "a"],
            "rows": [{"arm": lab}, {"arm": "arm A"}],
        }
        for x, lab in (("b", "arm B"), ("c", "arm C"))
    ]
    # by hand: c − a seed by seed
    assert paired["rows"][1]["paired"]["values"] == [-0.5, -1.0, 0.5]
    assert doc["findings"][0]["kind"] == "paired difference"
    assert doc["findings"][1]["kind"] == "measure"


def test_audit_catches_a_mismatched_record():
    doc = _doc()
    paired = next(t for t in doc["tables"] if t["key"] == "paired_main")
    paired["rows"][0]["paired"]["values"][1] += 1e-6  # not b − a at seed 1
    (problem,) = audit(doc)
    assert problem.startswith("paired_main row 0") and "not b − a of main.loss" in problem
    doc = _doc()
    doc["findings"][0]["source"]["arms"] = ["c", "a"]  # names the wrong arm
    (problem,) = audit(doc)
    assert "finding b_worse" in problem and "not arm 'c'" in problem
    doc = _doc()
    doc["findings"][0]["effect"]["values"] = [0.5, 0.25, 0.5]  # values the table does not hold
    (problem,) = audit(doc)
    assert "finding b_worse: values" in problem


def test_audit_catches_unlabeled_records_and_missing_cells():
    doc = _doc()
    paired = next(t for t in doc["tables"] if t["key"] == "paired_main")
    del paired["rows"][1]["source"]
    doc["findings"][1]["kind"] = "unlabeled"
    problems = audit(doc)
    assert any("paired_main row 1" in p and "names no table" in p for p in problems)
    assert any("finding ratio: neither a paired difference" in p for p in problems)
    assert any("c's 'loss' has per-seed values but no paired difference" in p for p in problems)
    assert len(problems) == 3
    doc = _doc()
    paired = next(t for t in doc["tables"] if t["key"] == "paired_main")
    paired["rows"][0]["source"]["column"] = "size"  # a cell with no per-seed values
    assert any("holds no per-seed values" in p for p in audit(doc))


def test_audit_pairs_rows_picked_by_more_fields():
    """A table with several rows per arm: a finding names the two rows by their fields
    (the truncation sweep: the learned arm at 2 × minus at 1 ×)."""
    arms = {"s": "soft", "r": "ref"}
    sweep = StudyTable(
        "sweep",
        "Sweep",
        [("arm", "arm", "s"), ("scale", "scale", "s"), ("ae", "ae", ".2f")],
        [
            {"arm": "s", "scale": "1 ×", "ae": [2.0, 2.5]},
            {"arm": "s", "scale": "2 ×", "ae": [1.0, 1.25]},
        ],
    )
    src = Source("sweep", "ae", "s", "s", match_a={"scale": "2 ×"}, match_b={"scale": "1 ×"})
    f = Finding("cut", "c", "m", paired_difference([1.0, 1.25], [2.0, 2.5]), source=src)
    doc = {
        "arms": [{"name": k, "label": v} for k, v in arms.items()],
        "seeds": [0, 1],
        "reference": "r",
        "tables": [sweep.to_json()],
        "findings": [f.to_json(lambda s: source_record(s, [sweep], arms))],
    }
    assert doc["findings"][0]["source"]["rows"] == [
        {"arm": "s", "scale": "2 ×"},
        {"arm": "s", "scale": "1 ×"},
    ]
    assert audit(doc) == []
    doc["findings"][0]["source"]["rows"][1] = {"arm": "s"}  # two rows hold it
    assert "2 rows of 'sweep'" in audit(doc)[0]


# ------------------------------------------------------------------ --seeds auto

MU = 1.0
NOISE = [1.5, -1.2, -0.9, 0.8, 0.3, -0.6, 0.5, -0.2, 0.4, -0.3, 0.1, 0.2] * 3
"""The planted effect's noise per seed: the effect of seed s is MU + NOISE[s]."""
BASE = [0.25 * s for s in range(len(NOISE))]


class PlantedStudy(Study):
    """Two arms; the runs are stubbed and the analysis plants per-seed values: the
    reference's value at seed s is BASE[s], the other arm's BASE[s] + mu + NOISE[s]."""

    name = "planted"
    title = "Planted"
    reference = "ref"
    claims = ("alt_higher",)

    def __init__(self, mu: float = MU) -> None:
        self.mu = mu

    def common(self, scale):
        return dict(
            preset="tiny",
            model=dict(TINY_MODEL),
            steps=2,
            batch_size=2,
            seq_len=16,
            vocab_size=300,
            device="cpu",
            threads=1,
        )

    def arms(self, scale, options):
        return [Arm("ref", "reference"), Arm("alt", "alternative", {"top_k": 1})]

    def analyse(self, ctx):
        ref = [BASE[s] for s in ctx.seeds]
        alt = [BASE[s] + self.mu + NOISE[s] for s in ctx.seeds]
        table = StudyTable(
            "main",
            "Planted",
            [("arm", "arm", "s"), ("x", "x", ".3f")],
            [{"arm": "reference", "x": ref}, {"arm": "alternative", "x": alt}],
        )
        f = Finding(
            "alt_higher",
            "alt is higher",
            "Δ x, alt − ref",
            paired_difference(alt, ref),
            source=Source("main", "x", "alt", "ref"),
        )
        return [findings_section([f]), Section("Main", "", [table])]


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    """Runs that train nothing: a trained run advances a fake clock by 60 s and records
    60 s; one that exists is reused. Returns (corpus, trained runs, clock)."""
    clock = {"t": 0.0}
    trained: list[tuple[str, str]] = []

    def train_one(config, progress, donor=None):
        from pathlib import Path

        run = Path(config.out)
        if run.is_dir():
            return "reused", 60.0
        run.mkdir(parents=True)
        trained.append((run.parent.name, run.name))
        clock["t"] += 60.0
        return "trained", 60.0

    monkeypatch.setattr(driver, "_train_one", train_one)
    monkeypatch.setattr(auto, "_clock", lambda: clock["t"])
    corpus = make_corpus(tmp_path / "corpus", n_docs=4, sentences=2)
    return corpus, trained, clock


def _needed(d: list[float]) -> int:
    """By hand with scipy: the fewest m with t_{0.975, m-1} sd / sqrt(m) < mean."""
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    m = 2
    while sps.t.ppf(0.975, m - 1) * sd / math.sqrt(m) >= mean:
        m += 1
    return m


def _holds(d: list[float]) -> bool:
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    return mean - sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n) > 0


def test_auto_adds_seeds_until_the_claim_is_resolved(stubbed, tmp_path):
    corpus, trained, _ = stubbed
    out = tmp_path / "out"
    doc = run_study_auto(
        PlantedStudy(), out, scale="quick", budget_minutes=1000, data=str(corpus), progress=False
    )
    # the rounds by hand: start at 3, then min(seeds needed, twice the seeds)
    want, n = [], 3
    while True:
        want.append(n)
        d = [MU + e for e in NOISE[:n]]
        if _holds(d):
            break
        n = min(_needed(d), 2 * n)
    summary = doc["seeds_auto"]
    assert [r["seeds"] for r in summary["rounds"]] == want and len(want) >= 2
    assert summary["stopped"] == "every claim is resolved" and summary["unresolved"] == []
    assert doc["findings"][0]["verdict"] == "holds" and doc["seeds"] == list(range(want[-1]))
    assert len(trained) == 2 * want[-1]  # every run trained once, the rounds reuse them
    saved = json.loads((out / "results.json").read_text())
    assert saved["seeds_auto"]["seeds"] == want[-1] and audit(saved) == []
    assert "## Seeds chosen by --seeds auto" in (out / "report.md").read_text()


def test_auto_stops_at_the_budget_and_resumes(stubbed, tmp_path):
    corpus, trained, clock = stubbed
    out = tmp_path / "out"
    study = PlantedStudy()
    # 3 seeds × 2 arms × 1 min = 6 min; 3 min left pay for one seed (2 min); then 1 min left
    doc = run_study_auto(
        study, out, scale="quick", budget_minutes=9, data=str(corpus), progress=False
    )
    summary = doc["seeds_auto"]
    assert [r["seeds"] for r in summary["rounds"]] == [3, 4]
    assert summary["stopped"].startswith("the budget ends: 9 min, 8.0 spent")
    (left,) = summary["unresolved"]
    assert left["key"] == "alt_higher" and left["verdict"] == "not resolved"
    d = [MU + e for e in NOISE[:4]]
    assert left["seeds_needed"] == _needed(d)
    assert str(left["seeds_needed"]) in left["why"]
    report = (out / "report.md").read_text()
    assert "stopped because the budget ends" in report and "`alt_higher`" in report
    # again with more time: starts at the 4 seeds reached, trains only the new seeds
    clock["t"] = 0.0
    before = list(trained)
    again = run_study_auto(
        study, out, scale="quick", budget_minutes=5, data=str(corpus), progress=False
    )
    rounds = [r["seeds"] for r in again["seeds_auto"]["rounds"]]
    assert rounds == [3, 4, 4, 6]  # the earlier rounds kept; 4 (reused), then 2 more seeds
    assert trained[len(before) :] == [(a, f"seed{s}") for a in ("ref", "alt") for s in (4, 5)]
    assert again["seeds_auto"]["stopped"].startswith("the budget ends")


def test_auto_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="budget must be"):
        run_study_auto(PlantedStudy(), tmp_path, scale="quick", budget_minutes=0)
    with pytest.raises(ValueError, match="quick or cpu"):
        run_study_auto(PlantedStudy(), tmp_path, scale="paper")
    with pytest.raises(ValueError, match="2 seeds or more"):
        run_study_auto(PlantedStudy(), tmp_path, scale="quick", start=1)


def test_finding_seeds_needed_against_its_tolerance():
    """An "= 0 (± tol)" claim whose mean lies inside the band needs the interval inside
    it: half-width < tol − |mean|; one outside needs half-width < |mean| − tol."""
    d = [0.01, 0.03, -0.02, 0.02]
    f = Finding("z", "c", "m", paired_difference(d, [0.0] * 4), expect="zero", tolerance=0.05)
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    m = 2
    while sps.t.ppf(0.975, m - 1) * sd / math.sqrt(m) >= 0.05 - abs(mean):
        m += 1
    assert f.seeds_needed == m
    exact = Finding("e", "c", "m", paired_difference([1, -1], [0, 0]), exact=True)
    assert exact.seeds_needed is None and "more seeds cannot" in exact.why_unresolved()
    edge = copy.copy(f)
    edge.effect = paired_difference([0.04, 0.06], [0.0, 0.0])  # mean on the boundary
    assert edge.verdict == "not resolved" and edge.seeds_needed is None


def test_cli_seeds_and_budget_are_checked_with_one_line(capsys):
    from moelab.cli import main

    assert main(["study", "gate-norm", "--seeds", "3", "--budget", "5"]) != 0
    assert capsys.readouterr().err.strip() == (
        "moelab study: error: --budget applies to --seeds auto only"
    )
    for argv, said in (
        (["--seeds", "0"], "expected a whole number >= 1 or 'auto', got '0'"),
        (["--seeds", "auto", "--budget", "-1"], "expected minutes > 0, got '-1'"),
    ):
        with pytest.raises(SystemExit):
            main(["study", "gate-norm", *argv])
        assert said in capsys.readouterr().err


def test_cli_prints_what_seeds_auto_left_open():
    from moelab.cli.study import format_study

    doc = {
        "tables": [],
        "report": "OUT/report.md",
        "seconds": 60.0,
        "seeds_auto": {
            "seeds": 6,
            "stopped": "the budget ends",
            "unresolved": [{"key": "k", "why": "needs about 9 seeds: the budget ends"}],
        },
    }
    assert format_study(doc).splitlines() == [
        "--seeds auto: 6 seeds; stopped because the budget ends",
        "  unresolved: k: needs about 9 seeds: the budget ends",
        "report: OUT/report.md (1.0 min)",
    ]


def test_auto_stops_when_the_claims_need_more_than_it_may_train(stubbed, tmp_path):
    corpus, trained, _ = stubbed
    doc = run_study_auto(
        PlantedStudy(mu=0.4),  # at 3 seeds: mean 0.2, sd 1.5
        tmp_path / "out",
        scale="quick",
        budget_minutes=1000,
        max_seeds=12,
        data=str(corpus),
        progress=False,
    )
    summary = doc["seeds_auto"]
    assert [r["seeds"] for r in summary["rounds"]] == [3] and len(trained) == 6
    assert summary["stopped"] == "every unresolved claim needs more than the 12 seeds it may train"
    (left,) = summary["unresolved"]
    assert left["seeds_needed"] > 64  # by hand: t_{0.975, m-1} 1.48 / sqrt(m) < 0.2
    assert left["why"].endswith("beyond the 12 that --seeds auto trains")
