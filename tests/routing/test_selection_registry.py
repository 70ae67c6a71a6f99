"""The selection stage as a registry: the built-in rules' answers, a toy rule registered
from a test (the first-k rule of docs/extending.md, run as written there) that a router
and a tiny model train with and the diagnostics accept, and the scan that keeps rule
names out of the rest of the package."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import moelab
from moelab.model import ModelConfig, param_counts
from moelab.routing import Router, RouterConfig, selection
from moelab.routing.selection.threshold import Threshold
from moelab.routing.selection.topk import TopK

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(moelab.__file__).resolve().parent
STAGE = PACKAGE / "routing" / "selection"


def first_k_rule() -> type[selection.Selection]:
    """The FirstK class of docs/extending.md, executed from the page's code block."""
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if b.startswith("# moelab/routing/selection/first_k.py"))
    namespace: dict = {"__name__": "first_k_from_docs"}
    exec(compile(code, "docs/extending.md", "exec"), namespace)
    return namespace["FirstK"]


@pytest.fixture
def first_k() -> Iterator[type[selection.Selection]]:
    rule = first_k_rule()
    selection.register(rule)
    try:
        yield rule
    finally:
        selection.unregister(rule.name)


def test_registry_holds_the_built_in_rules_and_refuses_unknown_names() -> None:
    assert selection.available()[:2] == ("topk", "threshold")
    assert selection.get("topk") is TopK and selection.get("threshold") is Threshold
    with pytest.raises(ValueError, match=r"selection must be one of \('topk', 'threshold'"):
        RouterConfig(d_model=4, n_experts=4, selection="first_k")

    class Impostor(TopK):
        pass

    with pytest.raises(ValueError, match="already registered"):
        selection.register(Impostor)
    selection.register(TopK)  # the same class again is a no-op

    class Nameless(selection.Selection):
        pass

    with pytest.raises(ValueError, match="needs a class attribute name"):
        selection.register(Nameless)

    class BadSweep(selection.Selection):
        name = "bad_sweep"
        sweep = "top_p"

    with pytest.raises(ValueError, match="sweep must be one of"):
        selection.register(BadSweep)
    assert "bad_sweep" not in selection.available()


def test_built_in_rules_answer_from_the_config() -> None:
    topk = RouterConfig(d_model=4, n_experts=8, top_k=3)
    assert (topk.selection_rule, topk.slots, topk.expected_experts) == (TopK, 3, 3.0)
    assert (TopK.truncates, TopK.sweep, TopK.calibrates) == (False, "top_k", False)
    base = dict(d_model=4, n_experts=8, map="lapsum", lapsum_k=2.5, selection="threshold")
    capped = RouterConfig(**base, token_cap_factor=1.5)
    assert (Threshold.truncates, Threshold.sweep, Threshold.calibrates) == (
        True,
        "threshold_scale",
        True,
    )
    assert capped.slots == 4  # ceil(2.5 * 1.5)
    assert capped.expected_experts == 2.5  # the nominal k, not the cap
    assert RouterConfig(**base).slots == 8  # no cap: every expert
    assert RouterConfig(**{**base, "lapsum_k": None, "map": "softmax"}).expected_experts == 2.0
    # a learned k of a call moves the cap: ceil(3.1 * 1.5) = 5
    assert Threshold.slots(capped.selection_config, torch.tensor(3.1)) == 5
    assert Threshold.slots(capped.selection_config, 9.0) == 8  # at most E


def test_a_rule_without_a_cut_refuses_calibration() -> None:
    from moelab.routing.allocation import ThresholdCalibrator

    router = Router(RouterConfig(d_model=4, n_experts=4))
    assert router.effective_truncation() is None
    calibrator = ThresholdCalibrator()
    calibrator.observe(torch.rand(16, 4))
    with pytest.raises(ValueError, match="no cut on p to calibrate"):
        router.calibrate(calibrator, 2.0)


def test_a_registered_toy_rule_routes_and_its_router_trains(first_k) -> None:
    rc = RouterConfig(d_model=16, n_experts=8, top_k=2, selection="first_k", init_std=0.5)
    assert (rc.selection_rule, rc.slots, rc.expected_experts) == (first_k, 2, 2.0)
    torch.manual_seed(0)
    router = Router(rc)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    out = router(x)
    assert torch.equal(out.ids_TK, torch.tensor([[0, 1]]).expand(32, 2))
    assert out.selected_TK.all() and not out.dropped_TK.any()
    torch.testing.assert_close(out.weights_TK, torch.softmax(x @ router.weight.t(), -1)[:, :2])
    assert router(x, top_k=3).ids_TK.shape == (32, 3)  # K at inference
    # one optimiser step through the gate moves the router weight
    before = router.weight.detach().clone()
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    target = torch.randn(32, 2, generator=torch.Generator().manual_seed(2))
    (out.weights_TK * target).sum().backward()
    opt.step()
    router.step(out)
    assert not torch.equal(router.weight.detach(), before)
    # parameter counts ask the rule: top_k experts per MoE layer, as for top-K
    model = dict(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=50)
    counts = param_counts(ModelConfig(max_seq_len=8, **model, router={"selection": "first_k"}))
    assert counts == param_counts(ModelConfig(max_seq_len=8, **model))


def test_a_registered_toy_rule_trains_a_model_that_the_diagnostics_accept(
    first_k, tmp_path: Path
) -> None:
    from moelab.diagnostics import evaluate, evaluate_truncation, stats
    from moelab.train import train
    from tests.train import TINY_MODEL, make_corpus, tiny_config

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    run = tmp_path / "run"
    model = {**TINY_MODEL, "router": {"selection": "first_k"}}
    summary = train(tiny_config(corpus, run, steps=2, model=model))
    assert math.isfinite(summary["train_loss"])
    st = stats(run, max_batches=1)
    assert (st["selection"], st["truncating"], st["top_k"]) == ("first_k", False, 2)
    for layer in st["layers"]:
        assert layer["active_experts"] == pytest.approx(2.0)  # softmax: both weights > 0
        assert layer["truncation"] is None  # the rule has no cut on p
        assert layer["nominal_cv"] == pytest.approx(1.0)  # loads (n, n, 0, 0) over E = 4
    sweep = evaluate(run, [1, 2], max_batches=1)
    assert [r["top_k"] for r in sweep["results"]] == [1, 2]
    assert [r["contributors"] for r in sweep["results"]] == pytest.approx([1.0, 2.0])
    with pytest.raises(ValueError, match="not by a threshold"):
        evaluate_truncation(run, [1.0], max_batches=1)


# --------------------------------------------------- no rule names outside the stage


def _selection_value(node: ast.AST) -> bool:
    """``x.selection``, ``x["selection"]`` or ``x.get("selection", ...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "selection"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "selection"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        first = node.args[0] if node.args else None
        return (
            node.func.attr == "get"
            and isinstance(first, ast.Constant)
            and first.value == "selection"
        )
    return False


def _strings(node: ast.AST) -> set[str]:
    """The string constants of a constant or a literal tuple / list / set."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def name_branches(source: str, names: set[str]) -> list[int]:
    """Lines that branch on a selection rule's name: a comparison (==, !=, in, not in)
    with a registered name or of a selection value with a string, a ``match`` on a
    selection value, or a lookup keyed by one (``table[rc.selection]``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = set().union(*(_strings(o) for o in operands))
            if literals & names or (literals and any(_selection_value(o) for o in operands)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _selection_value(node.subject):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _selection_value(node.slice):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_scan_finds_name_branches() -> None:
    names = {"topk", "threshold"}
    bad = [
        'if rc.selection != "topk": pass',
        'x = r["selection"] == "top_p"',
        'ok = name in ("topk", "other")',
        'ok = cfg.get("selection") not in ["expert_choice"]',
        'f = {"a": 1}[config.selection]',
        'match rc.selection:\n    case "topk":\n        pass',
        'if mode == "threshold": pass',
    ]
    assert [name_branches(src, names) for src in bad] == [[1]] * len(bad)
    fine = [
        'v = mean["threshold"]',
        "if rc.selection_rule.truncates: pass",
        'if rule.sweep == "top_k": pass',
        'd = {"threshold": 1.0}',
        "t = selection.get(rc.selection)",
    ]
    assert [name_branches(src, names) for src in fine] == [[]] * len(fine)


def test_no_selection_name_is_branched_on_outside_the_selection_stage() -> None:
    names = set(selection.available())
    found = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if STAGE not in path.parents
        for lines in [name_branches(path.read_text(encoding="utf-8"), names)]
        if lines
    }
    assert found == {}, (
        "ask the selection rule (truncates, sweep, calibrates, slots, expected_experts) "
        f"instead of comparing its name: {found}"
    )
