"""The sparse-maps study at the quick scale: its tables hold the arms and the paper's
columns, and every mean ± sd cell equals a hand computation on per-seed values measured
again, independently, from the run folders."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from moelab import cli
from moelab.data import batches
from moelab.diagnostics import evaluate, load_run, stats
from moelab.model.config import param_counts
from moelab.studies import get_study, run_study
from moelab.studies.core import arm_config
from moelab.studies.sparse_maps import (
    DENSE_D_FF,
    TOP_KS,
    SparseMapsStudy,
    downstream_scores,
    headline_rows,
    training_curves,
)
from tests.train import make_corpus

SEEDS = (0, 1)
LABELS = ["dense (larger active budget)", "softmax", "1.5-entmax", "sparsemax", "2-normmax"]
LABELS += [f"{m} (softmax-balanced)" for m in ("1.5-entmax", "sparsemax", "2-normmax")]
MOE = {
    "softmax": "softmax",
    "1.5-entmax": "entmax15",
    "sparsemax": "sparsemax",
    "2-normmax": "normmax2",
    "1.5-entmax (softmax-balanced)": "entmax15-sb",
    "sparsemax (softmax-balanced)": "sparsemax-sb",
    "2-normmax (softmax-balanced)": "normmax2-sb",
}
BATCHES = 2  # the quick scale's analysis batches
PAIRED_TABLES = ("main", "routing", "gap_fractions", "score_spread", "budget_nll")
PAIRED_TABLES += ("budget_retention", "routing_ood", "gap_fractions_ood", "score_spread_ood")
PAIRED_TABLES += ("contributor_trajectory",)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sparse_maps")
    corpus = make_corpus(root / "corpus", n_docs=20, sentences=6)
    ood = make_corpus(root / "ood", n_docs=6, sentences=6, seed=7)
    out = root / "out"
    doc = run_study(
        "sparse-maps",
        out,
        scale="quick",
        seeds=len(SEEDS),
        data=str(corpus),
        eval_data=str(ood),
        options={"dense": True},
        progress=False,
    )
    return out, corpus, ood, doc


def _tables(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["key"]: t for t in doc["tables"]}


def _row(table: dict[str, Any], label: str, **match: str) -> dict[str, Any]:
    rows = [
        r for r in table["rows"] if r["arm"] == label and all(r[k] == v for k, v in match.items())
    ]
    assert len(rows) == 1, (label, match)
    return rows[0]


def _check_cell(cell: dict[str, Any], per_seed: list[float], rel: float = 1e-6) -> None:
    """The cell holds the per-seed values and their mean and sample sd."""
    assert cell["values"] == pytest.approx(per_seed, rel=rel, abs=1e-9)
    assert cell["mean"] == pytest.approx(statistics.mean(per_seed), rel=rel, abs=1e-9)
    assert cell["sd"] == pytest.approx(statistics.stdev(per_seed), rel=1e-4, abs=1e-9)


def _runs(out: Path, arm: str) -> list[Path]:
    return [out / "runs" / arm / f"seed{s}" for s in SEEDS]


def test_tables_hold_the_arms_and_the_papers_columns(study) -> None:
    out, _, _, doc = study
    tables = _tables(doc)
    assert set(tables) == {
        "main",
        "routing",
        "gap_fractions",
        "score_spread",
        "per_layer_routing",
        "per_layer_scores",
        "routing_ood",
        "gap_fractions_ood",
        "score_spread_ood",
        "per_layer_routing_ood",
        "per_layer_scores_ood",
        "budget_nll",
        "budget_retention",
        "spread_ratio",
        "contributor_trajectory",
        "saturation",
        "per_layer_saturation",
        "paper_beside_moelab",
    } | {"findings"} | {  # the paired differences from softmax, for tables with its row
        f"paired_{key}" for key in PAIRED_TABLES
    }

    def headers(key: str) -> list[str]:
        return [c["header"] for c in tables[key]["columns"]]

    assert [r["arm"] for r in tables["main"]["rows"]] == LABELS
    assert headers("main") == ["model", "active params", "total params", "val loss", "perplexity"]
    for key in ("routing", "gap_fractions", "score_spread", "budget_nll", "budget_retention"):
        assert [r["arm"] for r in tables[key]["rows"]] == LABELS[1:], key
    assert headers("routing") == [
        "map",
        "discarded mass",
        "contributors K+",
        "s=1 %",
        "s=2 %",
        "E[delta | s>=3]",
        "nominal CV",
        "contrib CV",
        "contrib SD",
    ]
    assert headers("routing_ood")[:2] == ["map", "NLL"]
    assert headers("gap_fractions") == [
        "map",
        "threshold",
        "g>=1 %",
        "g>=2 %",
        "own threshold %",
        "singleton %",
    ]
    assert headers("score_spread") == [
        "map",
        "threshold",
        "RMS",
        "g50",
        "g90",
        "g99",
        "singletons %",
    ]
    # the quick model has MoE layers in blocks 1 and 3 (counting from 0, as moe_layers)
    assert headers("per_layer_routing") == ["statistic", "map", "block 1", "block 3"]
    assert {r["stat"] for r in tables["per_layer_scores"]["rows"]} == {"RMS", "g50", "g90", "g99"}
    assert len(tables["per_layer_routing"]["rows"]) == 8 * (len(LABELS) - 1)
    assert headers("budget_nll") == ["map", *(f"K={k}" for k in TOP_KS), "Delta K=2 -> K=max"]
    thresholds = {r["arm"]: r["threshold"] for r in tables["gap_fractions"]["rows"]}
    own = {"softmax": "-", "1.5-entmax": "2", "sparsemax": "1", "2-normmax": "1"}
    assert thresholds == own | {f"{m} (softmax-balanced)": own[m] for m in list(own)[1:]}
    report = (out / "report.md").read_text()
    assert "mean ± sd" in report and "Table 1 layout" in report and "Table 9" in report
    for name in ("training_routing", "loss_curves", "loss_vs_k", "gaps"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name}.png)" in report
    # the paper's numbers beside the study's, the scale of each in the headers
    assert headers("paper_beside_moelab")[2].startswith("moelab quick (")
    assert headers("paper_beside_moelab")[3].startswith("paper 300M")
    assert [r["arm"] for r in tables["saturation"]["rows"]] == LABELS[2:]


def test_saturation_and_trajectory_tables_against_the_runs(study) -> None:
    """The saturation cells are saturation.measure of each run again; the trajectory
    cells contributor_return of its metrics.jsonl; the spread ratios the score RMS of the
    per-layer table over softmax's."""
    from moelab.runs import read_metrics
    from moelab.studies.core import metric_curve
    from moelab.studies.sparse_maps import saturation
    from moelab.studies.sparse_maps.findings import contributor_return

    out, _, _, doc = study
    tables = _tables(doc)
    rms = {
        r["arm"]: {b: r[f"b{b}"]["values"] for b in (1, 3)}
        for r in tables["per_layer_scores"]["rows"]
        if r["stat"] == "RMS"
    }
    for label, arm in MOE.items():
        traj = _row(tables["contributor_trajectory"], label)
        for i, run in enumerate(_runs(out, arm)):
            r = contributor_return(*metric_curve(read_metrics(run), "contributors"))
            assert traj["return"]["values"][i] == pytest.approx(r["return"])
        if arm == "softmax":
            continue
        sat = _row(tables["saturation"], label)
        for i, run in enumerate(_runs(out, arm)):
            m = saturation.measure(run, saturation.BATCHES["quick"])
            tokens = sat["tokens"]["values"][i]
            assert tokens == pytest.approx(100 * m["mean"]["token_share_past"], abs=1e-9)
        ratio = _row(tables["spread_ratio"], label)
        for b in (1, 3):
            want = [a / s for a, s in zip(rms[label][b], rms["softmax"][b], strict=True)]
            assert ratio[f"b{b}"]["values"] == pytest.approx(want, rel=1e-4)


def _nll_by_hand(run: Path) -> float:
    """Mean NLL per target token of the first BATCHES validation batches, computed
    directly with the model."""
    loaded = load_run(run)
    cfg = loaded.config
    total, count = 0.0, 0
    data = batches(
        loaded.val_shard(), cfg.batch_size, cfg.seq_len, cfg.seed, shuffle=False, epochs=1
    )
    with torch.no_grad():
        for i, (x, y) in enumerate(data):
            if i == BATCHES:
                break
            logits = loaded.model(x).logits_BSV
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int((y != -100).sum())
    return total / count


def test_main_table_against_the_model_itself(study) -> None:
    out, _, _, doc = study
    main = _tables(doc)["main"]
    for label in LABELS:
        arm = "dense" if label.startswith("dense") else MOE[label]
        per_seed = [_nll_by_hand(run) for run in _runs(out, arm)]
        row = _row(main, label)
        _check_cell(row["val_loss"], per_seed, rel=1e-4)
        _check_cell(row["ppl"], [math.exp(v) for v in per_seed], rel=1e-4)
        summary = json.loads((_runs(out, arm)[0] / "summary.json").read_text())
        assert row["active"] == f"{summary['params']['active']:,}"
    dense = _row(main, LABELS[0])
    soft = _row(main, "softmax")
    total = int(soft["total"].replace(",", ""))
    # the dense reference: about the MoE model's total, every parameter active
    assert abs(int(dense["total"].replace(",", "")) - total) < 0.01 * total
    assert dense["active"] == dense["total"] and soft["active"] != soft["total"]


def test_routing_tables_against_stats_of_each_run(study) -> None:
    out, _, ood, doc = study
    tables = _tables(doc)
    for label, arm in MOE.items():
        val = [stats(run, max_batches=BATCHES) for run in _runs(out, arm)]
        off = [stats(run, data=str(ood), max_batches=BATCHES) for run in _runs(out, arm)]
        for key, docs in (("routing", val), ("routing_ood", off)):
            row = _row(tables[key], label)
            _check_cell(row["discarded_mass"], [d["mean"]["discarded_mass"] for d in docs])
            _check_cell(row["contrib_cv"], [d["mean"]["contrib_cv"] for d in docs])
            if label != "softmax":
                _check_cell(
                    row["pair_rate"], [100 * d["mean"]["pair_rate"] for d in docs], rel=1e-4
                )
        _check_cell(_row(tables["routing_ood"], label)["nll"], [d["nll"] for d in off])
        # per layer: one column per MoE layer's block, the "block" of stats
        for block, i in ((1, 0), (3, 1)):
            assert all(d["layers"][i]["block"] == block for d in val)
            rms = _row(tables["per_layer_scores"], label, stat="RMS")[f"b{block}"]
            _check_cell(rms, [d["layers"][i]["score_rms"] for d in val])
            mass = _row(tables["per_layer_routing_ood"], label, stat="discarded mass")
            _check_cell(mass[f"b{block}"], [d["layers"][i]["discarded_mass"] for d in off])
        g90 = _row(tables["score_spread"], label)["gap_p90"]
        _check_cell(g90, [d["mean"]["gap_p90"] for d in val])


def test_gap_fractions_obey_the_threshold_law(study) -> None:
    _, _, _, doc = study
    for key in ("gap_fractions", "gap_fractions_ood"):
        for row in _tables(doc)[key]["rows"]:
            if row["arm"] == "softmax":
                assert row["frac_gap_ge_threshold"]["mean"] is None
                assert row["singleton_rate"]["values"] == [0.0, 0.0]
            else:  # a sparse map's singletons are exactly its gaps at its threshold
                own = row["frac_gap_ge_threshold"]["values"]
                assert row["singleton_rate"]["values"] == own


def test_budget_tables_against_evaluate_and_each_other(study) -> None:
    out, _, _, doc = study
    tables = _tables(doc)
    for label, arm in MOE.items():
        sweeps = [evaluate(run, TOP_KS, max_batches=BATCHES) for run in _runs(out, arm)]
        by_k = [{r["top_k"]: r for r in s["results"]} for s in sweeps]
        row = _row(tables["budget_nll"], label)
        for k in TOP_KS:
            _check_cell(row[f"nll{k}"], [b[k]["nll"] for b in by_k])
        _check_cell(row["delta"], [b[8]["nll"] - b[2]["nll"] for b in by_k])
        ret = _row(tables["budget_retention"], label)
        _check_cell(ret["con4"], [b[4]["contributors"] for b in by_k])
        # two sources: the sweep at the trained K and the routing statistics
        routing = _row(tables["routing"], label)
        discarded = routing["discarded_mass"]["values"]
        assert ret["ret2"]["values"] == pytest.approx([1 - v for v in discarded], abs=1e-9)
        # the main table's loss is the NLL at the trained K
        assert _row(tables["main"], label)["val_loss"]["values"] == row["nll2"]["values"]


def test_training_curves_average_the_seeds(study) -> None:
    out, _, _, _ = study
    runs = _runs(out, "sparsemax")
    logged = []
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        logged.append({r["tokens"]: r["contributors"] for r in rows if "contributors" in r})
    xs, mean, lo, hi = training_curves(runs, "contributors")
    assert xs == sorted(logged[0]) and len(xs) == 10  # 20 steps, logged every 2
    for t, m, a, b in zip(xs, mean, lo, hi, strict=True):
        values = [seed[t] for seed in logged]
        assert m == pytest.approx(statistics.mean(values))
        assert (a, b) == (min(values), max(values))


def test_rerun_reuses_and_reads_downstream_results(study) -> None:
    out, corpus, ood, doc = study
    written = []
    try:
        for label in LABELS:
            arm = "dense" if label.startswith("dense") else MOE[label]
            for s, run in enumerate(_runs(out, arm)):
                k = None if arm == "dense" else 2
                rows = [
                    {"task": "cloze", "top_k": k, "acc": 0.25 + 0.1 * s, "metrics": {}},
                    {"task": "qa", "top_k": k, "acc": None, "acc_norm": 0.5, "metrics": {}},
                    {"task": "cloze", "top_k": 1, "acc": 0.99, "metrics": {}},  # not trained K
                ]
                (run / "downstream.json").write_text(json.dumps({"rows": rows, "routing": []}))
                written.append(run / "downstream.json")
        assert downstream_scores(_runs(out, "softmax")[1])["cloze"]["acc"] == pytest.approx(0.35)
        again = run_study(
            "sparse-maps",
            out,
            scale="quick",
            seeds=len(SEEDS),
            data=str(corpus),
            eval_data=str(ood),
            options={"dense": True},
            progress=False,
        )
    finally:
        for path in written:
            path.unlink()
    assert set(again["arm_states"]["softmax"]) == {"reused"}
    main = _tables(again)
    headers = [c["header"] for c in main["main"]["columns"]]
    assert headers[-3:] == ["cloze %", "qa %", "avg %"]
    for label in LABELS:
        row = _row(main["main"], label)
        _check_cell(row["acc:cloze"], [25.0, 35.0])
        assert row["acc:qa"]["values"] == [50.0, 50.0]
        _check_cell(row["acc_avg"], [37.5, 42.5])
    # everything measured is read back from RUN/analysis: the same numbers
    old = _tables(doc)
    for key in ("routing", "budget_nll", "per_layer_routing_ood"):
        assert main[key]["rows"] == old[key]["rows"]


def test_dense_reference_matches_the_moe_total(tmp_path: Path) -> None:
    study = SparseMapsStudy()
    for scale in ("quick", "cpu"):
        common = study.common(scale)
        arms = {a.name: a for a in study.arms(scale, {"dense": True})}
        assert next(iter(arms)) == "dense"
        assert "dense" not in [a.name for a in study.arms(scale, {})]
        dense, moe = (
            param_counts(arm_config(common, arms[name], 0, tmp_path / name).model_config())
            for name in ("dense", "softmax")
        )
        assert abs(dense["total"] - moe["total"]) < 0.01 * moe["total"], scale
        assert dense["active"] == dense["total"] > moe["active"]
        assert arms["dense"].config["model"]["d_ff"] == DENSE_D_FF[scale]


def test_headline_rows_merge_the_main_and_routing_tables(study) -> None:
    _, _, _, doc = study
    rows = headline_rows(doc)
    assert [r["label"] for r in rows] == LABELS
    soft = rows[1]
    routing = _row(_tables(doc)["routing"], "softmax")
    assert soft["discarded_mass"] == routing["discarded_mass"]["mean"]
    assert soft["val_loss"] == _row(_tables(doc)["main"], "softmax")["val_loss"]["mean"]
    assert "discarded_mass" not in rows[0]  # dense


def test_study_command_runs_the_quick_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], study
) -> None:
    _, corpus, _, _ = study
    argv = ["study", "sparse-maps", "--scale", "quick", "--data", str(corpus)]
    argv += ["--out", str(tmp_path / "s"), "--threads", "1", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["study"] == "sparse-maps" and doc["seeds"] == [0]
    main = _tables(doc)["main"]
    assert [r["arm"] for r in main["rows"]] == LABELS[1:]  # no dense unless asked
    assert main["rows"][0]["val_loss"]["sd"] is None  # one seed: no sd
    assert (tmp_path / "s" / "report.md").is_file() and (tmp_path / "s" / "tables.tex").is_file()


def test_demo_is_the_study(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    import moelab.studies

    calls = []

    def fake(name: str, out: str, **kw: Any) -> dict[str, Any]:
        calls.append((name, out, kw))
        return {"report": "r.md", "figures": ["gaps.png"], "arms": [], "tables": [], "seconds": 0}

    monkeypatch.setattr(moelab.studies, "run_study", fake)
    out = str(tmp_path / "d")
    assert cli.main(["demo", "--out", out, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == [str(Path(out) / "gaps.png")] and doc["report"] == "r.md"
    assert doc["findings"] == []
    assert cli.main(["demo", "--quick", "--dense", "--out", out, "--threads", "1"]) == 0
    assert "report: r.md" in capsys.readouterr().out
    (name, where, kw), (_, _, quick) = calls
    assert name == "sparse-maps" and where == out
    assert (
        kw["scale"] == "cpu"
        and kw["options"] == {"softmax_balanced": False}
        and kw.get("seeds", 1) == 1
    )
    assert quick["scale"] == "quick" and quick["options"] == {
        "softmax_balanced": False,
        "dense": True,
    }
    assert get_study("sparse-maps").name == "sparse-maps"


def test_downstream_scores_refuse_a_broken_file(tmp_path: Path) -> None:
    assert downstream_scores(tmp_path) == {}
    (tmp_path / "downstream.json").write_text('{"rows": [')
    with pytest.raises(ValueError, match="not a JSON file"):
        downstream_scores(tmp_path)


T_975_DF1 = 12.7062047362  # Student's t, 97.5% quantile, 1 degree of freedom (a t-table)


def test_findings_test_every_claim_from_the_tables_values(study) -> None:
    """The Findings come first and hold each claim once; each effect is the seed-by-seed
    difference of the values the tables hold, its interval the t-interval by hand."""
    out, _, _, doc = study
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.index("## Findings") < report.index("## Predictive quality")
    assert "## Paired differences from softmax" in report
    found = {f["key"]: f for f in doc["findings"]}
    assert list(found) == list(SparseMapsStudy.claims)
    tables = _tables(doc)
    delta = {
        arm: _row(tables["budget_nll"], label)["delta"]["values"] for label, arm in MOE.items()
    }
    dm = {
        arm: _row(tables["routing"], label)["discarded_mass"]["values"]
        for label, arm in MOE.items()
    }
    gaps = {arm: _row(tables["gap_fractions"], label) for label, arm in MOE.items()}

    def check(key: str, per_seed: list[float]) -> None:
        e = found[key]["effect"]
        assert e["values"] == pytest.approx(per_seed, abs=1e-9)
        mean = sum(per_seed) / 2
        half = T_975_DF1 * abs(per_seed[0] - per_seed[1]) / math.sqrt(2) / math.sqrt(2)
        assert e["mean"] == pytest.approx(mean, abs=1e-9)
        assert e["low"] == pytest.approx(mean - half, abs=1e-7)
        assert e["high"] == pytest.approx(mean + half, abs=1e-7)
        expected = (
            "holds" if mean - half > 0 else "contradicted" if mean + half < 0 else "not resolved"
        )
        assert found[key]["verdict"] == expected

    for m in ("entmax15", "sparsemax", "normmax2"):
        check(
            f"k_sensitivity_{m}", [a - b for a, b in zip(delta["softmax"], delta[m], strict=True)]
        )
        f = found[f"singleton_identity_{m}"]
        rate, share = (
            gaps[m]["singleton_rate"]["values"],
            gaps[m]["frac_gap_ge_threshold"]["values"],
        )
        # the tables show percent; the finding is on shares
        assert f["effect"]["values"] == pytest.approx(
            [(r - s) / 100 for r, s in zip(rate, share, strict=True)], abs=1e-9
        )
        # an identity about singletons is tested only where there were singletons
        assert f["exact"] and f["testable"] == any(rate)
        assert f["verdict"] == ("holds" if any(rate) else "not resolved")
    for a, b in [
        ("sparsemax", "softmax"),
        ("sparsemax", "entmax15"),
        ("sparsemax", "normmax2"),
        ("entmax15", "softmax"),
    ]:
        check(f"retained_mass_{a}_vs_{b}", [y - x for x, y in zip(dm[a], dm[b], strict=True)])
    assert "the K sweep applied its K" in report
    # moelab demo prints the findings before the main and routing tables
    from moelab.cli.demo import format_demo

    text = format_demo({**doc, "seconds": 60})
    assert (
        text.index("The paper's claims")
        < text.index("Predictive quality")
        < text.index("Routing statistics")
    )


def test_every_paired_record_matches_the_values_results_json_holds(study) -> None:
    """moelab.studies.audit.audit: every paired difference (tables and findings) names
    its table, column and two arms and equals their per-seed values' difference; every
    arm's per-seed cell of a table with the reference's row has its paired difference."""
    from moelab.studies.audit import audit

    out, doc = study[0], study[-1]
    assert audit(doc) == []
    assert audit(json.loads((out / "results.json").read_text())) == []
