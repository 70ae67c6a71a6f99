"""The study driver: arms × seeds trained and reused, mean ± sd cells against a hand
computation on the saved per-seed values, the report files, the paper scale."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from moelab.studies import Arm, Section, Study, StudyTable, cell_text, run_study, summarize
from moelab.studies.core import arm_config, train_command
from tests.train import TINY_MODEL, make_corpus


class ToyStudy(Study):
    name = "toy"
    title = "Toy"
    paper = "A toy paper"

    def common(self, scale):
        return dict(
            preset="tiny",
            model={**TINY_MODEL, "router": {"lapsum_k": 2.0}},
            steps=4 if scale != "paper" else 1000,
            batch_size=4,
            seq_len=32,
            warmup_steps=1,
            eval_every=0,
            eval_batches=1,
            checkpoint_every=0,
            log_every=1,
            vocab_size=300,
            device="cpu",
            threads=1,
        )

    def arms(self, scale, options):
        return [
            Arm(
                "soft",
                "softmax top-2",
                {"map": "softmax", "top_k": 2, "model": {"router": {"lapsum_k": None}}},
            ),
            Arm("sparse", "sparsemax top-2", {"top_k": 2}, sets=("router.map=sparsemax",)),
        ]

    def paper_sources(self):
        return {"lr": "stated: Section 1", "soft:top_k": "stated: Table 1", "steps": "moelab's"}

    def analyse(self, ctx):
        def loss(run):
            return json.loads((run / "summary.json").read_text())["val_loss"]

        rows = [
            {"arm": a.label, "val_loss": ctx.per_seed(a.name, loss), "fixed": 1.5} for a in ctx.arms
        ]
        table = StudyTable(
            "main", "Validation loss", [("arm", "arm", "s"), ("loss", "val_loss", ".4f")], rows
        )
        return [Section("Loss", "text", [table])]


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    corpus = make_corpus(root / "corpus", n_docs=20, sentences=6)
    out = root / "out"
    doc = run_study(ToyStudy(), out, scale="quick", seeds=2, data=str(corpus), progress=False)
    return out, corpus, doc


def test_summary_is_mean_and_sample_sd():
    s = summarize([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3)
    assert s["sd"] == pytest.approx(
        math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    )
    assert summarize([3.0])["sd"] is None
    assert summarize([None, float("nan")])["mean"] is None
    assert cell_text(summarize([1.0, 3.0]), ".2f") == "2.00 ± 1.41"
    assert cell_text(summarize([1.0]), ".2f") == "1.00"


def test_study_trains_every_arm_and_seed_and_summarises(toy_study):
    out, _, doc = toy_study
    assert doc["seeds"] == [0, 1]
    for arm in ("soft", "sparse"):
        for s in (0, 1):
            summary = json.loads((out / "runs" / arm / f"seed{s}" / "summary.json").read_text())
            assert summary["steps"] == 4
    (table,) = doc["tables"]
    for row, arm in zip(table["rows"], ("soft", "sparse"), strict=True):
        per_seed = [
            json.loads((out / "runs" / arm / f"seed{s}" / "summary.json").read_text())["val_loss"]
            for s in (0, 1)
        ]
        cell = row["val_loss"]
        assert cell["values"] == per_seed
        assert cell["mean"] == pytest.approx((per_seed[0] + per_seed[1]) / 2)
        assert cell["sd"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / math.sqrt(2))
        assert row["fixed"] == 1.5
    # seeds differ, so the sd is not zero
    assert table["rows"][0]["val_loss"]["sd"] > 0
    report = (out / "report.md").read_text()
    assert "±" in report and "mean ± sd" in report
    assert r"$\pm$" in (out / "tables.tex").read_text()
    assert json.loads((out / "results.json").read_text())["tables"][0]["key"] == "main"


def test_study_reuses_finished_runs(toy_study):
    out, corpus, doc = toy_study
    before = (out / "runs" / "soft" / "seed0" / "summary.json").stat().st_mtime_ns
    again = run_study(ToyStudy(), out, scale="quick", seeds=2, data=str(corpus), progress=False)
    assert again["arm_states"] == {"soft": ["reused", "reused"], "sparse": ["reused", "reused"]}
    assert (out / "runs" / "soft" / "seed0" / "summary.json").stat().st_mtime_ns == before
    assert again["tables"] == doc["tables"]
    # the training time shown is the one recorded when the runs were trained
    assert again["arm_seconds"] == doc["arm_seconds"]
    assert all(t > 0 for ts in again["arm_seconds"].values() for t in ts)


def test_study_resumes_an_interrupted_arm(tmp_path):
    from moelab.train import train

    corpus = make_corpus(tmp_path / "corpus", n_docs=20, sentences=6)
    study = ToyStudy()
    arm = study.arms("quick", {})[0]
    common = {**study.common("quick"), "data": str(corpus), "progress": False}
    config = arm_config(common, arm, 0, tmp_path / "out" / "runs" / arm.name / "seed0")
    train(config, stop_after=2)  # as if Ctrl-C had stopped it at step 2
    doc = run_study(study, tmp_path / "out", scale="quick", data=str(corpus), progress=False)
    assert doc["arm_states"] == {"soft": ["resumed"], "sparse": ["trained"]}
    summary = json.loads(
        (tmp_path / "out" / "runs" / "soft" / "seed0" / "summary.json").read_text()
    )
    assert summary["steps"] == 4


def test_bad_scale_and_seeds(tmp_path):
    with pytest.raises(ValueError, match="unknown scale"):
        run_study(ToyStudy(), tmp_path, scale="huge")
    with pytest.raises(ValueError, match="seeds"):
        run_study(ToyStudy(), tmp_path, scale="quick", seeds=0)

    class NoPaper(ToyStudy):
        paper_refusal = "toy has no paper-scale experiment"

    with pytest.raises(ValueError, match="no paper-scale"):
        run_study(NoPaper(), tmp_path, scale="paper")


def test_paper_scale_writes_configs_and_commands_without_training(tmp_path):
    doc = run_study(ToyStudy(), tmp_path, scale="paper", seeds=2, progress=False, threads=3)
    assert doc["trained"] is False
    assert not (tmp_path / "runs").exists()
    soft = json.loads((tmp_path / "paper" / "soft.json").read_text())
    assert soft["config"]["steps"] == 1000
    assert soft["sources"] == {
        "lr": "stated: Section 1",
        "top_k": "stated: Table 1",
        "steps": "moelab's",
    }
    assert soft["params"]["total"] > soft["params"]["active"] > 0
    commands = (tmp_path / "paper" / "commands.sh").read_text().splitlines()
    assert sum(c.startswith("torchrun") for c in commands) == 4
    # this machine's threads and progress bar are not part of the paper's commands
    assert not any("threads=" in c or "progress=" in c for c in commands)


def test_train_command_parses_back_to_the_same_config(tmp_path):
    """The command a paper-scale study prints trains exactly the arm's config."""
    from moelab.cli import build_parser
    from moelab.train import apply_overrides

    study = ToyStudy()
    common = study.common("paper")
    for arm in study.arms("paper", {}):
        cmd = train_command(common, arm, 3, str(tmp_path / arm.name))
        args = build_parser().parse_args(shlex.split(cmd)[1:])
        base = {k: getattr(args, k) for k in ("preset", "map", "alpha", "top_k", "steps", "out")}
        base = {k: v for k, v in base.items() if v is not None}
        got = apply_overrides(base, args.set)
        want = arm_config(common, arm, 3, tmp_path / arm.name)
        assert got.to_dict() == want.to_dict()
        # an explicit None in the arm overrides the common value in the command too
        want_k = None if arm.name == "soft" else 2.0
        assert got.model_config().router_config().lapsum_k == want_k


def test_arms_of_one_seed_share_the_prepared_data_and_train_as_alone(toy_study, tmp_path):
    """The second arm of a seed gets the first arm's tokenizer and shards (what it would
    prepare itself: same corpus, vocabulary, split and seed) and trains exactly as a run
    that prepared its own."""
    from moelab.train import train

    out, corpus, _ = toy_study
    soft, sparse = out / "runs" / "soft" / "seed1", out / "runs" / "sparse" / "seed1"
    assert (soft / "tokenizer.json").stat().st_ino == (sparse / "tokenizer.json").stat().st_ino
    assert (soft / "data" / "train.bin").read_bytes() == (
        sparse / "data" / "train.bin"
    ).read_bytes()
    study = ToyStudy()
    arm = study.arms("quick", {})[1]
    common = {**study.common("quick"), "data": str(corpus), "progress": False}
    alone = train(arm_config(common, arm, 1, tmp_path / "alone"))
    shared = json.loads((sparse / "summary.json").read_text())
    assert (tmp_path / "alone" / "tokenizer.json").read_bytes() == (
        sparse / "tokenizer.json"
    ).read_bytes()
    assert alone["val_loss"] == shared["val_loss"]
    assert alone["train_loss"] == shared["train_loss"]


def test_a_missing_corpus_fails_before_any_run_folder(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="does not exist"):
        run_study(ToyStudy(), tmp_path / "out", scale="quick", data=str(tmp_path / "none"))
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("command", [["study", "temperature"], ["demo"]])
def test_an_interrupted_study_says_how_to_resume(monkeypatch, capsys, tmp_path, command):
    import signal

    import moelab.studies as studies
    from moelab.cli import main
    from moelab.train import TrainingInterrupted

    def stopped(*args, **kwargs):
        raise TrainingInterrupted(7, tmp_path / "ckpt", signal.SIGINT, "moelab train ...")

    monkeypatch.setattr(studies, "run_study", stopped)
    code = main([*command, "--out", str(tmp_path / "out"), "--json"])
    assert code == 130
    out, err = capsys.readouterr()
    assert json.loads(out) == {"interrupted": "SIGINT", "step": 7}
    assert f"moelab {command[0]}: SIGINT: arm interrupted at step 7" in err
    assert "run the same command again to resume" in err


# ------------------------------------------------------------------- paired seeds


def _weights(run):
    from safetensors.torch import load_file

    step = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / step / "model.safetensors")


def test_every_run_of_a_study_reads_one_corpus_and_seeds_differ_in_weights(toy_study):
    """Paired seeds: every arm and seed reads the same tokenizer and split (the recorded
    corpus identity, and the bytes themselves), while two seeds of one arm start from
    different weights."""
    from moelab.data import corpus_identity
    from moelab.runs import corpus_id

    out, _, doc = toy_study
    runs = [out / "runs" / a / f"seed{s}" for a in ("soft", "sparse") for s in (0, 1)]
    first = runs[0]
    for run in runs:
        saved = json.loads((run / "config.json").read_text())
        assert saved["data_seed"] == 0 and saved["seed"] in (0, 1)
        assert saved["run_info"]["corpus"]["id"] == corpus_id(run) == doc["corpus"]
        assert (run / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
        for name in ("train.bin", "val.bin"):
            assert (run / "data" / name).read_bytes() == (first / "data" / name).read_bytes()
    # the identity is of the files: worked out again it agrees with the record
    assert corpus_identity(first / "tokenizer.json", first / "data")["id"] == doc["corpus"]
    w0, w1 = _weights(out / "runs" / "soft" / "seed0"), _weights(out / "runs" / "soft" / "seed1")
    assert w0.keys() == w1.keys()
    assert any(not (w0[k] == w1[k]).all() for k in w0)
    assert f"every run read corpus `{doc['corpus']}`" in (out / "report.md").read_text()


def test_a_seed_without_data_seed_splits_its_data_by_its_seed(tmp_path):
    """Outside a study, data_seed None keeps the old rule (the split follows seed), and
    data_seed gives two seeds one split."""
    from moelab.train import TrainConfig

    assert TrainConfig(seed=3).split_seed == 3
    assert TrainConfig(seed=3, data_seed=0).split_seed == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="data_seed must be a whole number"):
            TrainConfig(data_seed=bad)


def _copy_study(src, dst):
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_a_study_folder_from_before_paired_seeds_is_refused(toy_study, tmp_path):
    out, corpus, _ = toy_study
    copy = _copy_study(out, tmp_path / "old")
    path = copy / "runs" / "sparse" / "seed1" / "config.json"
    saved = json.loads(path.read_text())
    del saved["data_seed"]  # as a run written before data_seed existed
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"before paired seeds.*new --out"):
        run_study(ToyStudy(), copy, scale="quick", seeds=2, data=str(corpus), progress=False)


def test_runs_of_two_corpora_are_refused(toy_study, tmp_path):
    out, corpus, _ = toy_study
    copy = _copy_study(out, tmp_path / "mixed")
    path = copy / "runs" / "soft" / "seed1" / "config.json"
    saved = json.loads(path.read_text())
    saved["run_info"]["corpus"]["id"] = "0" * 16
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="read different data"):
        run_study(ToyStudy(), copy, scale="quick", seeds=2, data=str(corpus), progress=False)


class PairedToy(ToyStudy):
    reference = "soft"
    claims = ("sparse_lower",)

    def analyse(self, ctx):
        from moelab.studies.paired import Finding, findings_section, paired_difference

        sections = super().analyse(ctx)
        loss = sections[0].tables[0].rows
        effect = paired_difference(loss[0]["val_loss"], loss[1]["val_loss"])
        finding = Finding("sparse_lower", "sparsemax has the lower loss", "soft − sparse", effect)
        return [*sections, findings_section([finding], ["the mechanism acted"])]


def test_findings_open_the_report_and_paired_differences_close_it(toy_study, tmp_path):
    from moelab.studies.paired import t_quantile

    out, corpus, _ = toy_study
    copy = _copy_study(out, tmp_path / "paired")
    doc = run_study(PairedToy(), copy, scale="quick", seeds=2, data=str(corpus), progress=False)
    assert doc["arm_states"] == {"soft": ["reused", "reused"], "sparse": ["reused", "reused"]}
    loss = {
        arm: [
            json.loads((copy / "runs" / arm / f"seed{s}" / "summary.json").read_text())["val_loss"]
            for s in (0, 1)
        ]
        for arm in ("soft", "sparse")
    }
    # by hand: sparse − soft, seed by seed, with the t-interval of one degree of freedom
    d = [loss["sparse"][s] - loss["soft"][s] for s in (0, 1)]
    mean, sd = (d[0] + d[1]) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = 12.706204736 * sd / math.sqrt(2)
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736, abs=1e-8)
    paired = next(t for t in doc["tables"] if t["key"] == "paired_main")
    (row,) = paired["rows"]
    assert row["row"] == "sparsemax top-2" and row["column"] == "loss"
    got = row["paired"]
    assert got["values"] == pytest.approx(d)
    assert got["mean"] == pytest.approx(mean) and got["sd"] == pytest.approx(sd)
    assert got["low"] == pytest.approx(mean - half) and got["high"] == pytest.approx(mean + half)
    assert got["verdict"] == ("resolved" if abs(mean) > half else "not resolved")
    (finding,) = doc["findings"]
    assert finding["key"] == "sparse_lower"
    assert finding["effect"]["mean"] == pytest.approx(-mean)
    report = (copy / "report.md").read_text()
    titles = [line for line in report.splitlines() if line.startswith("## ")]
    assert titles[0] == "## Findings" and titles[-1] == "## Paired differences from softmax top-2"
    assert "- the mechanism acted" in report


def test_a_study_whose_findings_miss_a_claim_is_refused(toy_study, tmp_path):
    out, corpus, _ = toy_study

    class Missing(PairedToy):
        claims = ("sparse_lower", "another")

    copy = _copy_study(out, tmp_path / "missing")
    with pytest.raises(ValueError, match=r"missing \['another'\]"):
        run_study(Missing(), copy, scale="quick", seeds=2, data=str(corpus), progress=False)


def test_resuming_a_run_from_before_data_seed_with_another_split_is_refused(toy_study, tmp_path):
    """A run written before data_seed split its data with its seed: resuming it with a
    data_seed that differs would train on data it was not split for."""
    from moelab.train import train

    out, corpus, _ = toy_study
    copy = _copy_study(out / "runs" / "sparse" / "seed1", tmp_path / "run")
    path = copy / "config.json"
    saved = json.loads(path.read_text())
    del saved["data_seed"]
    path.write_text(json.dumps(saved))
    study = ToyStudy()
    arm = study.arms("quick", {})[1]
    common = {**study.common("quick"), "data": str(corpus), "progress": False}
    with pytest.raises(ValueError, match="predates data_seed"):
        train(arm_config(common, arm, 1, copy), resume=True)
    # seed 0's split is the same either way: that run resumes (here: is finished)
    copy0 = _copy_study(out / "runs" / "sparse" / "seed0", tmp_path / "run0")
    saved = json.loads((copy0 / "config.json").read_text())
    del saved["data_seed"]
    (copy0 / "config.json").write_text(json.dumps(saved))
    assert train(arm_config(common, arm, 0, copy0), resume=True)["steps"] == 4
