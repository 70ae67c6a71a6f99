"""What moelab does with each MoE family of the installed transformers, checked on a tiny
random model of it (:mod:`tests.integrations.tiny_families`): statistics, the budget
sweep, the router swap and fine-tuning, each "yes" (with its check passed) or the one-line
refusal moelab gives. The rows make docs/huggingface.md's family table
(:func:`table`; ``python -m tests.integrations.family_matrix`` rewrites it)."""

from __future__ import annotations

import copy
import functools
import re
import sys
from pathlib import Path
from typing import Any

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
COLUMNS = ("stats", "sweep", "swap", "fine-tune")

NOT_BUILT: dict[str, str] = {}
"""Families whose tiny model the tests cannot build, with the reason (none today)."""

_TEXT = "The quick brown fox jumps over the lazy dog. " * 6


def _short(err: BaseException) -> str:
    msg = str(err).split("; supported:")[0]
    return re.sub(r"\s+", " ", msg).strip()


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 300), (2, 16), generator=gen)


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def _nll(model: torch.nn.Module, ids: torch.Tensor) -> float:
    from moelab.integrations.hf.stats import nll_pass

    total, n = nll_pass(model, [ids])
    return total / n


def _check_reference(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Every router's own choice and weights in a forward equal the family's written-out
    routing on the logits it returned (named families: families.route_site; the others:
    their inferred rule)."""
    from moelab.integrations.hf import families, rules

    sites = families.moe_routers(model)
    seen: list[Any] = [None] * len(sites)

    def hook_for(i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            seen[i] = sites[i].read(output)

        return hook

    handles = [s.router.register_forward_hook(hook_for(i)) for i, s in enumerate(sites)]
    try:
        _logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    for site, got in zip(sites, seen, strict=True):
        assert got is not None, f"router {site.name} did not run"
        z, w, ids_tk = got
        if site.by_token_id:
            continue
        z = z.reshape(-1, site.n_experts)
        if site.rule is None:
            ref_ids, ref_w = families.route_site(site, z)
        else:
            ref_ids, ref_w = rules.apply_rule(
                site.rule, z, site.top_k, site.choice_bias,
                getattr(site.router, "per_expert_scale", None),
            )  # fmt: skip
        assert rules.same_routing(ref_ids, ref_w, ids_tk.reshape(ref_ids.shape),
                           w.reshape(ref_w.shape), 1e-5), site.name  # fmt: skip


def _stats(model: torch.nn.Module, tokenizer: Any, tmp: Path) -> str:
    from moelab.integrations.hf.families import UnsupportedModelError
    from moelab.integrations.hf.stats import hf_stats

    data = tmp / "text.txt"
    data.write_text(_TEXT)
    try:
        res = hf_stats("tiny", data, loaded=(model, tokenizer), seq_len=16, batch_size=2)
    except UnsupportedModelError as err:
        return f"refused: {_short(err)}"
    assert res["layers"] and all(lay["states"] > 0 for lay in res["layers"])
    _check_reference(model, _ids(tokenizer.vocab_size))
    return "yes"


def _sweep(model: torch.nn.Module) -> str:
    from moelab.integrations.hf.families import UnsupportedModelError, moe_routers, top_k
    from moelab.integrations.hf.stats import Seen, collect

    sites = moe_routers(model)
    own = sites[0].top_k
    ids = _ids(model.config.vocab_size)
    base = _nll(model, ids)
    with top_k(model, own):
        assert abs(_nll(model, ids) - base) < 1e-6, "the sweep at the model's own K moved NLL"
    other = own + 1  # K = 1 meets a transformers bug in some families (LongCat-Flash)
    try:
        with top_k(model, other):
            pass
    except ValueError:  # more than the family can choose (groups): one fewer
        other = own - 1
    if other < 1:
        return "own K only: the model chooses 1 of 2 experts"
    seen = Seen(model)
    try:
        with top_k(model, other), collect(model, seen=seen):
            _nll(model, ids)
        seen.check_k(other, own)
    except (UnsupportedModelError, ValueError) as err:
        return f"own K only: {_short(err)}"
    return "yes"


def _swap(model: torch.nn.Module) -> tuple[str, Any]:
    from moelab.integrations.hf.swap import swap_routers

    ids = _ids(model.config.vocab_size)
    ref = _logits(model, ids)
    swapped = copy.deepcopy(model)
    try:
        swap_routers(swapped)
    except ValueError as err:
        return f"refused: {_short(err)}", None
    got = _logits(swapped, ids)
    err = float((got - ref).abs().max())
    assert err < 1e-5, f"the default swap moved the logits by {err:.2e}"
    return "yes", swapped


def _finetune(swapped: Any) -> str:
    from moelab.integrations.hf.swap import moelab_aux_loss, step_swapped, swapped_routers

    swapped.train()
    ids = _ids(swapped.config.vocab_size)
    routers = swapped_routers(swapped)
    before = [r.router.weight.detach().clone() for r in routers]
    opt = torch.optim.SGD([p for r in routers for p in r.parameters()], lr=0.1)
    out = swapped(input_ids=ids, labels=ids, use_cache=False)
    loss = out.loss + moelab_aux_loss(swapped)
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    step_swapped(swapped)
    moved = any(not torch.equal(b, r.router.weight) for b, r in zip(before, routers, strict=True))
    assert moved, "one fine-tuning step left every router weight as it was"
    return "yes"


@functools.cache
def family_row(model_type: str, tmp: str) -> tuple[str, ...]:
    """(stats, sweep, swap, fine-tune) of ``model_type``; an AssertionError when a
    family moelab says it supports gives a wrong result."""
    from tests.integrations import tiny_tokenizer
    from tests.integrations.tiny_families import text_type, tiny_family_model

    text = text_type(model_type)
    if text is not None:
        return (f"as {text}",) * 4
    if model_type in NOT_BUILT:
        return (f"not tested: {NOT_BUILT[model_type]}",) * 4
    model = tiny_family_model(model_type)
    stats = _stats(model, tiny_tokenizer(), Path(tmp))
    if stats != "yes":
        return stats, "refused (no statistics)", "refused (no statistics)", "no"
    sweep = _sweep(model)
    swap, swapped = _swap(model)
    tune = _finetune(swapped) if swapped is not None else "no"
    return stats, sweep, swap, tune


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= 160 else text[:157] + "..."


def table(rows: dict[str, tuple[str, ...]]) -> str:
    """The Markdown family table of docs/huggingface.md."""
    lines = ["| model_type | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for mt in sorted(rows):
        lines.append(f"| `{mt}` | " + " | ".join(_cell(c) for c in rows[mt]) + " |")
    return "\n".join(lines)


def docs_table() -> str | None:
    """The table between the markers of docs/huggingface.md, or None."""
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write_docs(rows: dict[str, tuple[str, ...]]) -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}")


def all_rows(tmp: str) -> dict[str, tuple[str, ...]]:
    from moelab.integrations.hf.families import moe_model_types

    return {mt: family_row(mt, tmp) for mt in moe_model_types()}


if __name__ == "__main__":  # pragma: no cover - regenerates the docs table
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as d:
        rows = {}
        for mt in (sys.argv[1:] or None) or __import__(
            "moelab.integrations.hf.families", fromlist=["x"]
        ).moe_model_types():
            try:
                rows[mt] = family_row(mt, d)
            except Exception as err:
                rows[mt] = (f"ERROR {type(err).__name__}: {err}",) * 4
            print(mt, "|", " | ".join(rows[mt]), flush=True)
        if not sys.argv[1:]:
            write_docs(rows)
