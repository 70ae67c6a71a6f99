"""MoE++ constant null experts (null_expert="constant") and input gating (gate_on="input",
Llama 4): the layer against a loop over tokens and slots written from the papers'
definitions, forward and backward in float64, gradcheck of the new computations,
config refusals, parameter counts against built models, a tiny training run."""

from __future__ import annotations

import pytest
import torch

from moelab.model import ModelConfig, Transformer, param_counts
from moelab.model.memory import param_split
from moelab.moe import ConstantExperts, MoE, MoEConfig
from moelab.moe.null import null_output
from moelab.routing import RouterConfig
from moelab.routing.output import RouterOutput


def _layer(
    kind: str = "constant",
    gate_on: str = "output",
    renorm: bool = False,
    map: str = "softmax",
    top_k: int = 3,
    n_null: int = 2,
    shared: int = 0,
    seed: int = 0,
) -> MoE:
    torch.manual_seed(seed)
    rc = RouterConfig(
        d_model=6,
        n_experts=4,
        top_k=top_k,
        map=map,
        n_null_experts=n_null,
        null_expert=kind if n_null else "zero",
        renorm=renorm,
        aux_weight=0.0,
    )
    moe = MoE(MoEConfig(6, 5, rc, n_shared_experts=shared, gate_on=gate_on)).double()
    with torch.no_grad():  # scores of order 1, so that tokens differ in their null slots
        moe.router.weight.normal_()
        if moe.constants is not None:  # W_m starts at 0; move it so that a1 != a2
            moe.constants.w_MCD.normal_()
            moe.constants.v_MD.normal_()
    return moe


def _constant(moe: MoE, m: int, x: torch.Tensor) -> torch.Tensor:
    """MoE++: E_m(x) = a1 x + a2 v_m, [a1, a2] = softmax(W_m x)."""
    assert moe.constants is not None
    a = torch.softmax(moe.constants.w_MCD[m] @ x, -1)
    return a[0] * x + a[1] * moe.constants.v_MD[m]


def _loop_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token and slot by slot: the map over the E + M scores, top-K, the gate
    (renorm over the slots with output), each expert on w x (input gating) or its
    output times w (output gating), plus the shared experts on x."""
    cfg, gate_on = moe.config.router, moe.config.gate_on
    E, M = cfg.n_experts, cfg.n_null_experts
    rows = []
    for t in range(x_TD.shape[0]):
        x = x_TD[t]
        z = moe.router.weight @ x
        p = torch.softmax(z, -1) if cfg.map == "softmax" else torch.sigmoid(z)
        top = sorted(range(E + M), key=lambda e: -float(z[e].detach()))[: cfg.top_k]
        outputs = [e for e in top if e < E or cfg.null_expert != "zero"]
        total = sum(p[e] for e in outputs) if cfg.renorm else 1.0
        y = torch.zeros_like(x)
        for e in outputs:
            w = p[e] / total

            def expert(v: torch.Tensor, e: int = e) -> torch.Tensor:
                if e < E:
                    return moe.experts.forward_expert(e, v[None])[0]
                if cfg.null_expert == "identity":
                    return v
                return _constant(moe, e - E, v)

            y = y + (expert(w * x) if gate_on == "input" else w * expert(x))
        if moe.shared is not None:
            y = y + sum(
                moe.shared.forward_expert(s, x[None])[0] for s in range(moe.shared.n_experts)
            )
        rows.append(y)
    return torch.stack(rows)


CASES = [
    ("constant", "output", False, "softmax"),
    ("constant", "output", True, "softmax"),
    ("constant", "input", False, "softmax"),
    ("constant", "input", True, "sigmoid"),
    ("identity", "input", False, "sigmoid"),
    ("zero", "input", True, "softmax"),
]


@pytest.mark.parametrize(("kind", "gate_on", "renorm", "map"), CASES)
def test_layer_matches_a_loop_over_tokens_forward_and_backward(
    kind: str, gate_on: str, renorm: bool, map: str
) -> None:
    moe = _layer(kind, gate_on, renorm, map, shared=1)
    x_TD = torch.randn(16, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(16, 6, dtype=torch.float64)
    y, out = moe(x_TD)
    want = _loop_reference(moe, x_TD)
    # NOTE: the router computes in float32 whatever the input dtype
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert out.null_TK is not None and bool(out.null_TK.any()) and not bool(out.null_TK.all())
    params = [x_TD, moe.router.weight, *moe.experts.parameters(), *moe.shared.parameters()]
    if moe.constants is not None:
        params += list(moe.constants.parameters())
    got = torch.autograd.grad((y * target).sum(), params)
    ref = torch.autograd.grad((want * target).sum(), params)
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if moe.constants is not None:  # v and W learn from the tokens that chose them
        assert all(float(g.abs().sum()) > 0 for g in got[-2:])


def test_llama4_routing_is_sigmoid_of_the_chosen_logit_on_the_input() -> None:
    # Llama 4: top-1 on the logits, w = sigmoid(z_chosen), expert(w x) + shared(x)
    moe = _layer("zero", "input", map="sigmoid", top_k=1, n_null=0, shared=1, seed=3)
    x_TD = torch.randn(12, 6, dtype=torch.float64)
    y, out = moe(x_TD)
    z_TE = x_TD @ moe.router.weight.t()
    top = z_TE.argmax(-1)
    assert torch.equal(out.ids_TK[:, 0], top)
    # a float64 router scores in float64 (moelab.routing.scorer.scores)
    torch.testing.assert_close(
        out.weights_TK[:, 0], torch.sigmoid(z_TE.gather(-1, top[:, None]))[:, 0]
    )
    want = torch.stack(
        [
            moe.experts.forward_expert(
                int(top[t]), torch.sigmoid(z_TE[t, top[t]]) * x_TD[t : t + 1]
            )[0]
            + moe.shared(x_TD[t : t + 1])[0]
            for t in range(12)
        ]
    )
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # output gating differs (SwiGLU is not homogeneous of degree 1)
    moe.config.gate_on = "output"
    assert float((moe(x_TD)[0] - y).detach().abs().max()) > 1e-2 * float(y.detach().abs().max())


@pytest.mark.parametrize("gate_on", ["output", "input"])
def test_gradcheck_of_the_constant_experts(gate_on: str) -> None:
    torch.manual_seed(4)
    ce = ConstantExperts(3, 5).double()
    with torch.no_grad():
        ce.w_MCD.normal_()
    T, K = 6, 3
    x = torch.randn(T, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    m = torch.randint(0, 3, (T, K))
    null = torch.rand(T, K) < 0.6
    v = ce.v_MD.detach().clone().requires_grad_()
    W = ce.w_MCD.detach().clone().requires_grad_()

    def f(x, w, v, W):
        return torch.func.functional_call(ce, {"v_MD": v, "w_MCD": W}, (x, m, null, w, gate_on))

    assert torch.autograd.gradcheck(f, (x, w, v, W))
    # against the per-expert form, slot by slot
    y = ce(x, m, null, w, gate_on)
    for t in range(T):
        want = torch.zeros(5, dtype=torch.float64)
        for k in range(K):
            if null[t, k]:
                e = int(m[t, k])
                if gate_on == "input":
                    want = want + ce.forward_expert(e, w[t, k] * x[t : t + 1])[0]
                else:
                    want = want + w[t, k] * ce.forward_expert(e, x[t : t + 1])[0]
        torch.testing.assert_close(y[t], want)


def test_gradcheck_of_the_input_gated_layer() -> None:
    # a float64 router stub (moelab's Router computes in float32): top-2 by the logits,
    # w = sigmoid(z); gradcheck through the dispatch of w x, the experts and the nulls
    moe = _layer("constant", "input", map="sigmoid", top_k=2, n_null=1, seed=5)
    weight = moe.router.weight.detach().clone()

    class Stub(torch.nn.Module):
        def forward(self, x_TD, **_):
            z = x_TD @ weight.t()
            ids = z.detach().topk(2, -1).indices
            null = ids >= 4
            w = torch.sigmoid(z).gather(-1, ids)
            zeros = torch.zeros_like(null)
            return RouterOutput(
                z,
                z,
                torch.sigmoid(z),
                ids,
                w,
                ~null,
                zeros,
                z.new_zeros(()),
                null_TK=null,
                n_null=1,
            )

    moe.router = Stub()
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: moe(x)[0], (x,))


def test_null_output_of_zero_and_identity_ignores_the_gating() -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    ids = torch.tensor([[0, 5], [5, 6], [1, 2], [6, 0]])
    w = torch.rand(4, 2, dtype=torch.float64)
    null = ids >= 5
    assert null_output("zero", x, ids, w, null, 5) is None
    want = (w * null).sum(-1, keepdim=True) * x
    for gate_on in ("output", "input"):
        torch.testing.assert_close(null_output("identity", x, ids, w, null, 5, None, gate_on), want)


def test_constant_experts_start_as_the_mean_of_x_and_v() -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(8, 4, RouterConfig(8, 4, n_null_experts=2, null_expert="constant")))
    ce = moe.constants
    assert ce is not None and tuple(ce.v_MD.shape) == (2, 8) and tuple(ce.w_MCD.shape) == (2, 2, 8)
    assert float(ce.w_MCD.abs().max()) == 0.0
    assert 0.01 < float(ce.v_MD.std()) < 0.04  # Normal(0, 0.02)
    x = torch.randn(3, 8)
    torch.testing.assert_close(ce.forward_expert(1, x), (x + ce.v_MD[1]) / 2)
    # zero and identity null experts have no parameters
    for kind in ("zero", "identity"):
        plain = MoE(MoEConfig(8, 4, RouterConfig(8, 4, n_null_experts=2, null_expert=kind)))
        assert plain.constants is None


def test_config_refusals() -> None:
    rc = RouterConfig(d_model=4, n_experts=4)
    with pytest.raises(ValueError, match="gate_on must be one of"):
        MoEConfig(4, 8, rc, gate_on="both")
    with pytest.raises(ValueError, match="gate_on must be one of"):
        ModelConfig(
            n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=50,
            max_seq_len=8, n_experts=4, gate_on="hidden",
        )  # fmt: skip
    with pytest.raises(ValueError, match="set n_null_experts >= 1"):
        RouterConfig(d_model=4, n_experts=4, null_expert="constant")


def _small(**kw) -> ModelConfig:
    return ModelConfig(
        n_layers=3, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, vocab_size=50,
        max_seq_len=8, n_experts=4, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        {"router": {"n_null_experts": 3, "null_expert": "constant"}},
        {"router": {"n_null_experts": 2, "null_expert": "constant"}, "gate_on": "input",
         "n_shared_experts": 1, "moe_layers": "all"},
        {"router": {"map": "sigmoid", "top_k": 1}, "gate_on": "input", "n_shared_experts": 1},
    ],
)  # fmt: skip
def test_param_counts_match_built_models(kw: dict) -> None:
    config = _small(**kw)
    model = Transformer(config)
    counts, split = param_counts(config), param_split(config)
    assert counts["total"] == split.total == sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    moe_blocks = {n for n, b in zip(blocks, model.blocks, strict=True) if b.is_moe}
    assert moe_blocks == {split.moe_block + split.block_experts}
    rc = config.router_config()
    if rc.null_expert == "constant":  # 3 D per constant expert, in total and active
        plain = param_counts(_small(**{**kw, "router": {**kw["router"], "null_expert": "zero"}}))
        extra = len(config.moe_indices) * 3 * 16 * rc.n_null_experts
        assert counts["total"] - plain["total"] == extra
        assert counts["active"] - plain["active"] == extra
        assert counts["router"] == plain["router"]


def test_a_tiny_model_learns_with_constant_experts_and_input_gating(tmp_path) -> None:
    from tests.train import TINY_MODEL, make_corpus, train_learns

    corpus = make_corpus(tmp_path / "corpus", n_docs=12)
    model = {
        **TINY_MODEL,
        "gate_on": "input",
        "router": {"n_null_experts": 2, "null_expert": "constant"},
    }
    train_learns(corpus, tmp_path / "run", model=model)
