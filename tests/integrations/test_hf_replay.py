"""Routing replay of Hugging Face models with their own routers
(moelab.integrations.hf.replay): a model's own record (a forward, or a ``generate`` call
of prefill and decode steps) replayed into it reproduces its logits bit for bit and
reaches the gate weights with the normal step's gradient; replayed experts that the
model would not choose are weighed by its live probabilities at them (a float64
reference written here; DeepSeek-V2's group-masked row is not gathered from); a
generate record replays into one training forward and into a moelab swap of the model;
what cannot be replayed is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integrations import tiny_model

pytest.importorskip("transformers")

from moelab.diagnostics import RoutingRecord, record, replay
from moelab.diagnostics.replay import routers_of
from moelab.integrations.hf.families import moe_routers
from moelab.integrations.hf.families import top_k as hf_top_k
from moelab.integrations.hf.replay import (
    NATIVE_REPLAY_FAMILIES,
    record_hf,
    replay_hf,
    sequence_order,
)
from moelab.integrations.hf.swap import swap_routers
from tests._docs import DOCS, page_code


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test of this file on one thread (tests/conftest.py)."""


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 10)) -> torch.Tensor:
    return torch.randint(3, 300, shape, generator=torch.Generator().manual_seed(seed))


def _nll(logits_BSV: torch.Tensor, x_BS: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits_BSV[:, :-1].double(), dim=-1)
    return -logp.gather(-1, x_BS[:, 1:, None]).mean()


def _gate_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [s.weight.grad for s in moe_routers(model)]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)
    return [g.clone() for g in grads if g is not None]


@pytest.mark.parametrize("family", NATIVE_REPLAY_FAMILIES)
def test_own_record_reproduces_the_model(family: str) -> None:
    model = tiny_model(family)
    x = _ids()
    # a training step: recorded, then replayed; same logits, same gradient
    with record_hf(model) as rec:
        ref = model(x).logits
        _nll(ref, x).backward()
    normal = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    gates = _gate_grads(model)
    model.zero_grad()
    assert (rec.n_layers, rec.tokens, rec.top_k, rec.n_experts) == (2, 20, 2, 8)
    with replay_hf(model, rec):
        again = model(x).logits
        _nll(again, x).backward()
    assert rec.consumed == [20, 20]
    assert torch.equal(again, ref)
    replayed = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(replayed) == len(normal)
    for a, b in zip(normal, replayed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    for a, b in zip(gates, _gate_grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    # the routers are themselves again: no instance forward left
    assert all("forward" not in s.router.__dict__ for s in moe_routers(model))
    # generate: the prefill and each decode step, replayed, give the same text and scores
    prompt = x[:1, :6]
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad(), record_hf(model) as rollout:
        gen = model.generate(prompt, **kw)
    assert rollout.tokens == gen.sequences.shape[1] - 1  # the last token is never routed
    with torch.no_grad(), replay_hf(model, rollout):
        regen = model.generate(prompt, **kw)
    assert torch.equal(regen.sequences, gen.sequences)
    assert all(torch.equal(a, b) for a, b in zip(gen.logits, regen.logits, strict=True))


@pytest.mark.parametrize("family", NATIVE_REPLAY_FAMILIES)
def test_bf16_rollout_replays_bit_for_bit_and_into_float32(family: str) -> None:
    """In bfloat16 the family's gate at the replayed experts is its own arithmetic too
    (the dtypes of each step as transformers has them); a bf16 rollout replays into the
    float32 model (the usual RL pair of an inference and a training precision)."""
    model = tiny_model(family)
    half = copy.deepcopy(model).to(torch.bfloat16)
    x = _ids(5)
    with torch.no_grad(), record_hf(half) as rollout:
        ref = half(x).logits
    with torch.no_grad(), replay_hf(half, rollout):
        assert torch.equal(half(x).logits, ref)
    with torch.no_grad(), replay_hf(model, rollout), record_hf(model) as seen:
        model(x)
    assert seen.changed_fraction(rollout) == 0.0


def _float64_gate(family: str, site, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_ED):
    """The family's gate at ``ids_TK`` from the live logits, in float64, written out from
    the families' definitions (docs/huggingface.md): probabilities over all E experts."""
    z_TE = x_TD.double() @ w_ED.t()
    if family == "gpt_oss":
        z_TK = (z_TE + site.bias.detach().double()).gather(-1, ids_TK)
        return torch.softmax(z_TK, dim=-1)
    if family == "deepseek_v3":
        p_TK = torch.sigmoid(z_TE).gather(-1, ids_TK)
        return 2.5 * p_TK / p_TK.sum(-1, keepdim=True)
    p_TK = torch.softmax(z_TE, dim=-1).gather(-1, ids_TK)
    if family in ("mixtral", "qwen3_moe"):  # renorm (qwen3_moe: norm_topk_prob=True)
        return p_TK / p_TK.sum(-1, keepdim=True)
    return 2.5 * p_TK if family == "deepseek_v2" else p_TK


@pytest.mark.parametrize("family", NATIVE_REPLAY_FAMILIES)
def test_replayed_gates_are_the_live_probabilities_at_the_recorded_experts(family: str) -> None:
    model = tiny_model(family)
    site = moe_routers(model)[0]
    with torch.no_grad():
        site.weight.normal_(0.0, 0.5)  # a clear choice, so "not chosen" means something
    x_TD = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        live_TK = site.read(site.router(x_TD)).ids_TK
    if family == "deepseek_v2":  # group-limited: experts of the groups it does not keep
        with torch.no_grad():
            p_TE = torch.softmax(x_TD @ site.weight.t(), dim=-1)
        kept_TG = torch.zeros(12, 4, dtype=torch.bool)
        kept_TG.scatter_(1, p_TE.view(12, 4, 2).amax(-1).topk(2, dim=-1).indices, True)
        dropped_TE = ~kept_TG.repeat_interleave(2, dim=1)
        ids_TK = torch.stack([row.nonzero()[:2, 0] for row in dropped_TE])
    else:  # two experts the router did not choose
        others = [[e for e in range(8) if e not in row][:2] for row in live_TK.tolist()]
        ids_TK = torch.tensor(others)
    assert not bool((ids_TK.unsqueeze(-1) == live_TK.unsqueeze(1)).any())
    blank = [torch.zeros(12, 2, dtype=torch.long), torch.zeros(12, 2, dtype=torch.long)]
    rec = RoutingRecord([ids_TK, *blank[1:]], [torch.ones(12, 2, dtype=torch.bool)] * 2, 8)
    coef_TK = torch.randn(12, 2, generator=torch.Generator().manual_seed(2))
    with replay_hf(model, rec):
        _, weights_TK, got_TK = site.router(x_TD)
    assert torch.equal(got_TK, ids_TK) and rec.consumed == [12, 0]
    (weights_TK * coef_TK).sum().backward()
    w = site.weight.detach().double().requires_grad_(True)
    ref_TK = _float64_gate(family, site.router, x_TD, ids_TK, w)
    (ref_TK * coef_TK.double()).sum().backward()
    # the zeroed gather would give 0 here: every replayed expert is one the router (or,
    # for DeepSeek-V2, its group mask) zeroed
    assert bool((weights_TK > 0).all())
    torch.testing.assert_close(weights_TK.double(), ref_TK.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(site.weight.grad.double(), w.grad, atol=1e-6, rtol=1e-4)
    rows_E = site.weight.grad.abs().sum(-1)
    assert bool((rows_E[ids_TK.unique()] > 0).all())  # the replayed experts' rows learn


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_generate_record_replays_into_one_training_forward(family: str) -> None:
    model = tiny_model(family)
    prompt = _ids(3, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    prompt[0, :2], mask[0, :2] = 0, 0  # the first prompt is 2 tokens shorter: left padding
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)  # fmt: skip
    with torch.no_grad(), record_hf(model) as rollout:
        gen = model.generate(prompt, attention_mask=mask, **kw)
    seq = gen.sequences
    assert rollout.tokens == 2 * 6 + 2 * 4  # prefill B x S, then 4 decode calls of B rows
    # the token each row routed, in generate's call order: prefill rows, then one
    # decode call per new token (B rows each)
    calls = [prompt.reshape(-1)] + [seq[:, 6 + i] for i in range(4)]
    rollout.token_ids = torch.cat(calls)
    ordered = sequence_order(rollout, batch=2, prompt_len=6)
    assert torch.equal(ordered.token_ids, seq[:, :-1].reshape(-1))  # reordered with the rows
    assert ordered.seq_len == 10
    # the training forward: the sequences less their last token, replaying the rollout
    full_mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
    with replay_hf(model, ordered), record_hf(model) as seen:
        logits = model(seq[:, :-1], attention_mask=full_mask).logits
        _nll(logits, seq[:, :-1]).backward()
    assert ordered.consumed == [20, 20]
    for a, b in zip(seen.ids_TK, ordered.ids_TK, strict=True):
        assert torch.equal(a, b)
    # the logits that chose each generated token are the generate call's own
    steps = torch.stack(gen.logits, dim=1)  # (B, new tokens, V)
    torch.testing.assert_close(logits[:, 5:], steps, atol=1e-5, rtol=1e-5)
    _gate_grads(model)
    # the model's own routing of that forward is the rollout's (no near-tie flipped here)
    with torch.no_grad(), record_hf(model) as own:
        model(seq[:, :-1], attention_mask=full_mask)
    assert own.changed_fraction(ordered) == 0.0
    with pytest.raises(ValueError, match=r"holds 20 rows") as err:
        sequence_order(rollout, batch=3, prompt_len=6)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_a_native_record_replays_in_a_moelab_swap(family: str) -> None:
    model = tiny_model(family)
    prompt = _ids(4, (1, 8))
    with torch.no_grad(), record_hf(model) as rollout:
        seq = model.generate(prompt, max_new_tokens=6, do_sample=False)
    x = seq[:, :-1]
    with torch.no_grad():
        native = model(x).logits
    swapped = copy.deepcopy(model)
    swap_routers(swapped)  # the family's own routing, in moelab Routers
    with torch.no_grad(), record(swapped) as own:
        swapped(x)
    assert rollout.changed_fraction(own) == 0.0
    with torch.no_grad(), replay(swapped, rollout):
        replayed = swapped(x).logits
    torch.testing.assert_close(replayed, native, atol=1e-5, rtol=0)
    # on a swapped model record_hf and replay_hf are record and replay; a training step
    # under replay reaches the moelab Routers with the normal step's gradient
    with record_hf(swapped) as again:
        _nll(swapped(x).logits, x).backward()
    normal = [r.weight.grad.clone() for r in routers_of(swapped)]
    swapped.zero_grad()
    with replay_hf(swapped, rollout):
        _nll(swapped(x).logits, x).backward()
    assert again.changed_fraction(rollout) == 0.0 and rollout.consumed == [x.shape[1]] * 2
    for a, r in zip(normal, routers_of(swapped), strict=True):
        assert bool(a.abs().sum() > 0) and torch.equal(a, r.weight.grad)
    # another router in the swap routes otherwise; replayed, it takes the rollout's experts
    other = copy.deepcopy(model)
    swap_routers(other, map="entmax", alpha=1.5, temperature=0.05)
    with torch.no_grad(), record(other) as its_own:
        other(x)
    with torch.no_grad(), replay(other, rollout), record(other) as seen:
        other(x)
    assert its_own.changed_fraction(rollout) > 0 and seen.changed_fraction(rollout) == 0.0
    # and the record of a swap replays in the native model
    with torch.no_grad(), replay_hf(model, own):
        back = model(x).logits
    assert torch.equal(back, native)


def test_records_that_cannot_be_replayed_are_refused() -> None:
    from tests.integrations.tiny_families import tiny_family_model

    model = tiny_model("mixtral")
    x = _ids()
    with torch.no_grad(), record_hf(model) as rec:
        model(x)
    ernie = tiny_family_model("ernie4_5_moe")
    with torch.no_grad(), record_hf(ernie) as its:  # recording reads any family
        ernie(x)
    cases = [
        (ernie, its, r"cannot replay the native routers of model type 'ernie4_5_moe' "
                     r"\(moelab family generic"),
        (tiny_model("mixtral", num_hidden_layers=3), rec, r"record has 2 MoE layers, the model 3"),
        (tiny_model("mixtral", num_local_experts=4), rec, r"8 experts \(\+0 null\) per layer, "
                                                          r"the model's layer 0 4"),
    ]  # fmt: skip
    for other, record_, match in cases:
        with pytest.raises(ValueError, match=match) as err, replay_hf(other, record_):
            pass
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"T=20 tokens from row 20, past the end"):
        with torch.no_grad(), replay_hf(model, rec):
            model(x)
            model(x)
    assert all("forward" not in s.router.__dict__ for s in moe_routers(model))
    with pytest.raises(
        ValueError, match=r"record has K=2 experts per token, the model's router K=3"
    ):
        with torch.no_grad(), hf_top_k(model, 3), replay_hf(model, rec):
            model(x)
    with pytest.raises(ValueError, match=r"layer 0 chose K = \[2, 3\] experts per token"):
        with torch.no_grad(), record_hf(model):
            model(x)
            with hf_top_k(model, 3):
                model(x)
    with pytest.raises(ValueError, match="replaying a routing record already"):
        with replay_hf(model, rec), replay_hf(model, rec):
            pass


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = page_code("replay.md", "# a generate record replayed in a moelab swap")
    exec(compile(code, "docs/replay.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    page = (DOCS / "replay.md").read_text(encoding="utf-8")
    assert len(lines) == 4 and all(line in page for line in lines)  # the figures printed there
    assert lines[1].startswith("native replay: max |logits - native| 0.0e+00")
    assert lines[2].startswith("swap: changed 0.00%")
