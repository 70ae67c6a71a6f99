"""moelab.integrations.lm_eval: the lm-evaluation-harness model of a run, checked
against the moelab model computed directly (log-likelihoods, rolling NLL, greedy
generation, routing statistics per task), the ready cloze task, ``moelab downstream``
and the report's downstream section."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

from moelab.cli import main
from moelab.diagnostics import FIELDS, ModelRoutingStats, load_run
from moelab.diagnostics.evaluate import _top_k
from moelab.integrations.lm_eval import (
    MoelabLM,
    import_lm_eval,
    run_downstream,
    write_cloze_task,
)
from moelab.integrations.lm_eval.cloze import run_documents
from moelab.integrations.lm_eval.run import _quiet_harness
from moelab.train import train
from tests.train import TINY_MODEL, make_corpus, tiny_config

L = TINY_MODEL["max_seq_len"]  # 32: contexts longer than this are left-truncated


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A softmax top-2 run, 10 steps, one MoE layer of 4 experts."""
    out = tmp_path_factory.mktemp("runs") / "soft"
    train(tiny_config(corpus, out, map="softmax", steps=10, eval_batches=1))
    return out


@pytest.fixture(scope="module")
def lm(run: Path) -> MoelabLM:
    return MoelabLM(loaded=load_run(run), batch_size=3)


def _req(kind: str, args: tuple, task: str = "t", i: int = 0) -> Instance:
    return Instance(kind, {}, args, i, metadata=(task, i, 1))


@torch.no_grad()
def _direct(model: torch.nn.Module, seq: list[int], n_ctx: int) -> tuple[float, bool]:
    """Summed log-probabilities of seq[n_ctx:] given what precedes them, the model run
    on the last L tokens; and whether each is the argmax."""
    drop = max(0, len(seq) - L)
    seq, n_ctx = seq[drop:], max(1, n_ctx - drop)
    logp = F.log_softmax(model(torch.tensor([seq])).logits_BSV[0].float(), -1)
    tgt = torch.tensor(seq[n_ctx:])
    rows = logp[n_ctx - 1 : len(seq) - 1]
    ll = float(rows.gather(-1, tgt[:, None]).double().sum())
    return ll, bool((rows.argmax(-1) == tgt).all())


PAIRS = [
    ("The cat sees the book in the", " morning"),
    ("A dog", " likes the garden again."),
    ("My friend reads", " a red ball"),
    ("", "The teacher builds a new house."),
    # longer than max_seq_len = 32 tokens: the earliest context tokens are dropped
    (" ".join(["The old man follows the river at night."] * 6), " with care"),
]


def test_loglikelihood_is_summed_logprobs_and_batching_is_exact(run: Path, lm: MoelabLM) -> None:
    tok, model = lm.backend.tokenizer, lm.backend.model
    requests = [_req("loglikelihood", p, i=i) for i, p in enumerate(PAIRS)]
    got = lm.loglikelihood(requests)
    for (ctx, cont), (ll, greedy) in zip(PAIRS, got, strict=True):
        ctx_ids = tok.encode(ctx) if ctx else [tok.eos_id]
        seq = ctx_ids + tok.encode(cont) if ctx == "" else tok.encode(ctx + cont)
        ref_ll, ref_greedy = _direct(model, seq, len(ctx_ids))
        assert ll == pytest.approx(ref_ll, abs=1e-5)
        assert greedy == ref_greedy
    assert lm.truncated >= 1  # the long request
    # one at a time, and a second time: the same numbers
    alone = MoelabLM(loaded=lm.backend.loaded, batch_size=1).loglikelihood(requests)
    for (a, ga), (b, gb) in zip(got, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb
    assert lm.loglikelihood(requests) == got


def test_rolling_is_the_model_nll(lm: MoelabLM) -> None:
    tok, model = lm.backend.tokenizer, lm.backend.model
    text = "The cat sees the book in the morning."
    ids = tok.encode(text)
    assert len(ids) < L
    (rolled,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    with torch.no_grad():
        x = torch.tensor([[tok.eos_id, *ids[:-1]]])
        nll = float(model(x, torch.tensor([ids])).loss) * len(ids)
    assert rolled == pytest.approx(-nll, rel=1e-5)
    # a text of several windows: every token predicted once, each window <= L tokens
    long = " ".join([text] * 5)
    n_long = len(tok.encode(long))
    assert n_long > 2 * L
    (r_long,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (long,))])
    assert r_long < rolled < 0


@torch.no_grad()
def _greedy(lm: MoelabLM, context: str, stop: list[str], limit: int) -> str:
    tok, model = lm.backend.tokenizer, lm.backend.model
    seq, gen, text = tok.encode(context), [], ""
    for _ in range(limit):
        nxt = int(model(torch.tensor([seq[-L:]])).logits_BSV[0, -1].argmax())
        if nxt == tok.eos_id:
            break
        seq.append(nxt)
        gen.append(nxt)
        text = tok.decode(gen)
        hits = [text.index(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)]
    return text


def test_generate_until_stops_and_respects_max_gen_toks(lm: MoelabLM) -> None:
    contexts = ["The cat sees", "A small bird carries the", "My friend"]
    free = [_greedy(lm, c, [], 12) for c in contexts]
    assert all(free)
    # a stop string from the middle of each free continuation
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in free]
    reqs = [
        _req("generate_until", (c, {"until": [s], "max_gen_toks": 12}), i=i)
        for i, (c, s) in enumerate(zip(contexts, stops, strict=True))
    ]
    got = lm.generate_until(reqs)
    for t, s, g in zip(free, stops, got, strict=True):
        assert g == t[: t.index(s)]
        assert s not in g
    short = lm.generate_until(
        [_req("generate_until", (c, {"until": [], "max_gen_toks": 3})) for c in contexts]
    )
    for c, g in zip(contexts, short, strict=True):
        assert g == _greedy(lm, c, [], 3)
        assert len(lm.backend.tokenizer.encode(g)) <= 3


MC_DOCS = [
    ("The cat sees the book in the", ["morning", "river", "bread"], 0),
    ("A dog likes a red ball at", ["night", "garden", "house"], 0),
    ("My friend builds a new", ["house", "morning", "again"], 0),
    ("The teacher reads the book with", ["care", "bird", "town"], 1),
    ("A small bird follows the river near the", ["town", "ball", "cat"], 2),
    ("The old man carries some bread every", ["day", "book", "friend"], 0),
]


def _mc_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny_mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in MC_DOCS
        ),
        encoding="utf-8",
    )
    (folder / "tiny_mc.yaml").write_text(
        f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(folder / "cache"))}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
        encoding="utf-8",
    )
    return folder


def _reference_mc(run: Path, k: int) -> tuple[float, float, dict[str, Any]]:
    """acc and acc_norm from per-choice log-likelihoods computed directly, and the
    routing statistics of every request's tokens (question + " " + choice)."""
    loaded = load_run(run)
    model, tok = loaded.model, loaded.tokenizer
    rc = model.config.router_config()
    acc = ModelRoutingStats(len(model.moe_layers), rc.map, rc.alpha)
    hits = hits_norm = 0
    with _top_k(model, k), torch.no_grad():
        for q, choices, y in MC_DOCS:
            lls = []
            for c in choices:
                seq = tok.encode(q + " " + c)
                lls.append(_direct(model, seq, len(tok.encode(q)))[0])
                acc.update(model(torch.tensor([seq])).router_outputs)
            hits += max(range(len(lls)), key=lls.__getitem__) == y
            norm = [ll / len(c) for ll, c in zip(lls, choices, strict=True)]
            hits_norm += max(range(len(norm)), key=norm.__getitem__) == y
    n = len(MC_DOCS)
    return hits / n, hits_norm / n, acc.result()


def test_multiple_choice_accuracy_and_routing_match_the_model(
    run: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tasks = _mc_task(tmp_path_factory.mktemp("tasks") / "mc")
    result = run_downstream(
        [run], ["tiny_mc"], include_path=tasks, top_ks=[1, 2], batch_size=4, progress=False
    )
    assert [(r["task"], r["top_k"]) for r in result["rows"]] == [("tiny_mc", 1), ("tiny_mc", 2)]
    tok = load_run(run).tokenizer
    for row, rout in zip(result["rows"], result["routing"], strict=True):
        acc, acc_norm, ref = _reference_mc(run, row["top_k"])
        assert row["acc"] == pytest.approx(acc) and row["acc_norm"] == pytest.approx(acc_norm)
        assert row["samples"] == len(MC_DOCS)
        # every token of every request, no padding: 3 choices per question
        n_tokens = sum(len(tok.encode(q + " " + c)) for q, cs, _ in MC_DOCS for c in cs)
        assert rout["tokens"] == n_tokens == ref["mean"]["states"] // len(ref["layers"])
        assert rout["requests"] == 3 * len(MC_DOCS)
        for f in ("active_experts", "discarded_mass", "contributors", "load_cv"):
            assert rout[f] == pytest.approx(ref["mean"][f], rel=1e-9, abs=1e-12)
            for lay, rlay in zip(rout["layers"], ref["layers"], strict=True):
                assert lay[f] == pytest.approx(rlay[f], rel=1e-9, abs=1e-12)
        for f in FIELDS:
            want = ref["mean"][f]
            # a gap percentile is one token's float32 top-2 gap, not a float64 sum: the
            # harness's padded batches may round that gap differently in the last bit
            # (seen: 1.5e-7 relative on one CPU), so it is compared at float32 precision.
            # score_rms too: it averages the float32 scores, which the padded batches
            # round differently in the last bit (a batch-shape effect of the float32
            # matmuls and attention, not of the statistic); measured 3.4e-10 and, with
            # other trained weights, 2.3e-9 relative, so 1e-9 held by chance
            rel = 1e-6 if f.startswith("gap_p") or f == "score_rms" else 1e-9
            assert rout["full"][f] == (None if want is None else pytest.approx(want, rel=rel)), f
    saved = json.loads((run / "downstream.json").read_text())
    assert {(r["task"], r["top_k"]) for r in saved["rows"]} >= {("tiny_mc", 1), ("tiny_mc", 2)}

    # the registered name, from Python, as the harness's users call it
    import lm_eval
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    with _quiet_harness(evaluator):
        res = lm_eval.simple_evaluate(
            model="moelab",
            model_args=f"run={run},top_k=2,batch_size=5",
            tasks=["tiny_mc"],
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            log_samples=False,
        )
    assert res is not None
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(_reference_mc(run, 2)[0])

    # the report shows the downstream table, and accuracy against K
    from moelab.report import build_report

    doc = build_report([run], tmp_path_factory.mktemp("rep") / "r", top_ks=[2], max_batches=1)
    md = Path(doc["report"]).read_text()
    assert "## Downstream tasks" in md and "tiny_mc acc_norm" in md
    assert any(f.endswith("downstream_vs_k.png") for f in doc["files"])
    rows = doc["tables"]["downstream"]
    assert {r["K"] for r in rows} >= {1, 2}
    assert [r["tiny_mc acc"] for r in rows if r["K"] in (1, 2)] == [
        x["acc"] for x in result["rows"]
    ]


def test_each_run_is_scored_at_its_own_newest_checkpoint(
    run: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Without --step, every run is loaded at its own newest checkpoint (the second run
    was once loaded at the step of the first)."""
    short = tmp_path_factory.mktemp("runs") / "short"
    train(tiny_config(corpus, short, map="softmax", steps=4, eval_batches=1))
    tasks = _mc_task(tmp_path_factory.mktemp("tasks") / "mc")
    result = run_downstream(
        [run, short], ["tiny_mc"], include_path=tasks, batch_size=4, progress=False, save=False
    )
    assert [(r["label"], r["checkpoint_step"]) for r in result["runs"]] == [
        ("soft", 10),
        ("short", 4),
    ]
    assert [r["checkpoint_step"] for r in result["rows"]] == [10, 4]


def test_whole_batch_rules_run_one_request_at_a_time(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("runs") / "ec"
    cfg = tiny_config(corpus, out, steps=2, eval_batches=1)
    model = {**cfg.model, "router": {"selection": "expert_choice"}}
    train(tiny_config(corpus, out, steps=2, eval_batches=1, model=model))
    lm = MoelabLM(run=str(out), batch_size=4)
    assert lm.batch_size == 1
    assert any("evaluated alone" in n and "expert_choice" in n for n in lm.notes)
    tok, net = lm.backend.tokenizer, lm.backend.model
    pairs = PAIRS[:3]
    got = lm.loglikelihood([_req("loglikelihood", p, i=i) for i, p in enumerate(pairs)])
    for (ctx, cont), (ll, _) in zip(pairs, got, strict=True):
        ref, _ = _direct(net, tok.encode(ctx + cont), len(tok.encode(ctx)))
        assert ll == pytest.approx(ref, abs=1e-5)


def test_cloze_task_is_deterministic_and_lambada_like(run: Path, tmp_path: Path) -> None:
    a = write_cloze_task(run, tmp_path / "a", n=5)
    b = write_cloze_task(run, tmp_path / "b", n=5)
    ta, tb = Path(a["data"]).read_text(), Path(b["data"]).read_text()
    assert ta == tb and a["items"] == 5
    docs = run_documents(run)
    for line in ta.splitlines():
        item = json.loads(line)
        word = item["target"]
        assert word.startswith(" ") and word[1:].isalpha()
        assert word[1:] in item["context"]  # the word occurs earlier in the passage
        assert any(item["context"] + word + "." in d for d in docs)
    assert "dataset_path: json" in Path(a["yaml"]).read_text()
    with pytest.raises(ValueError, match="out="):
        write_cloze_task(None, None)


def _cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_downstream(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(run), "--tasks", "moelab_cloze", "--limit", "4", "--threads", "1"]
    rc, out, _ = _cli(capsys, ["downstream", *base, "--top-k", "1", "2"])
    assert rc == 0
    assert "moelab_cloze acc" in out and "routing per task" in out
    table = out.splitlines()
    assert any(line.split()[:2] == [run.name, "1"] for line in table)
    assert any(line.split()[:2] == [run.name, "2"] for line in table)
    rc, out, _ = _cli(capsys, ["downstream", *base, "--json"])
    doc = json.loads(out)
    (row,) = doc["rows"]
    assert row["task"] == "moelab_cloze" and row["top_k"] == 2 and row["samples"] == 4
    assert 0.0 <= row["acc"] <= 1.0
    (rout,) = doc["routing"]
    assert rout["tokens"] > 0 and len(rout["layers"]) == 1
    # offline: the Hugging Face switches are on, the task's datasets cache is run-local
    assert all(os.environ[k] == "1" for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    assert any((run / "downstream" / "moelab_cloze" / "cache").iterdir())
    for argv, needle in (
        ([*base, "--top-k", "9"], "outside [1, 4]"),
        ([*base, "--include-path", str(run / "nothing")], "no such folder"),
        ([str(run / "nothing"), "--tasks", "moelab_cloze"], "not a moelab run"),
    ):
        rc, out, err = _cli(capsys, ["downstream", *argv])
        assert rc == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moelab downstream: error: ")
        assert needle in lines[0]


def test_missing_harness_names_the_extra(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ImportError, match=r"moelab\[eval\]"):
        import_lm_eval()
    rc, _, err = _cli(capsys, ["downstream", str(run), "--tasks", "moelab_cloze"])
    assert rc == 2 and "moelab downstream: error:" in err and "moelab[eval]" in err


def test_bench_downstream_times_the_same_tokens(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "downstream", "--run", str(run), "--repeats", "1", "--warmup", "0"]
    rc, out, _ = _cli(capsys, [*argv, "--json"])
    assert rc == 0
    doc = json.loads(out)
    items = [
        json.loads(line)
        for line in Path(write_cloze_task(run, run / "tmp_cloze")["data"]).read_text().splitlines()
    ]
    tok = load_run(run).tokenizer
    assert doc["requests"] == len(items)
    assert doc["tokens"] == sum(min(L, len(tok.encode(i["context"] + i["target"]))) for i in items)
    assert set(doc["ms"]) == {"bare", "loglikelihood", "no_routing"}
    assert doc["ratio"] == pytest.approx(doc["ms"]["bare"] / doc["ms"]["loglikelihood"])
    rc, _, err = _cli(capsys, ["bench", "downstream"])
    assert rc == 2 and "moelab bench: error: bench downstream needs a trained run" in err


def test_hf_model_scores_and_routing(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.integrations import save_tiny

    model_dir = save_tiny("mixtral", tmp_path / "mixtral")
    lm = MoelabLM(hf=str(model_dir), batch_size=3)
    model, tok = lm.backend.model, lm.backend.tokenizer
    pairs = [("The cat sees", " the book"), ("A dog", " likes the garden"), ("My", " friend")]
    got = lm.loglikelihood([_req("loglikelihood", p, i=i) for i, p in enumerate(pairs)])
    n_tokens = 0
    for (ctx, cont), (ll, _) in zip(pairs, got, strict=True):
        seq = tok(ctx + cont, add_special_tokens=False).input_ids
        n_ctx = len(tok(ctx, add_special_tokens=False).input_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq], device=model.device)).logits[0]
        logp = F.log_softmax(logits.float(), -1)[n_ctx - 1 : len(seq) - 1]
        ref = float(logp.gather(-1, torch.tensor(seq[n_ctx:], device=logp.device)[:, None]).sum())
        assert ll == pytest.approx(ref, abs=1e-4)
        n_tokens += len(seq)
    (task,) = lm.routing.result().values()
    assert task["tokens"] == n_tokens and task["requests"] == 3
    assert task["contributors"] == pytest.approx(2.0)  # Mixtral top-2, every token
    with lm.using_top_k(1):
        lm.reset()
        lm.loglikelihood([_req("loglikelihood", pairs[0])])
        (task,) = lm.routing.result().values()
        assert task["contributors"] == pytest.approx(1.0)
    assert lm.top_k == 2
