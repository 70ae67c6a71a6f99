"""Routing rules of Hugging Face MoE routers, written out, and checked against the router.

The seven named families of :mod:`moelab.integrations.hf.families` have their routing
written from the installed transformers' code. Every other MoE family whose router moelab
can reach is read the same way, but its rule is not assumed: :func:`infer_rule` runs the
router on probe inputs and keeps the rule, among those moelab can write out, that
reproduces the router's chosen experts and gate weights (to 1e-5 in float32); a router
that none reproduces is refused (:class:`UnresolvedRuleError`), so no statistic is
computed on a distribution the model does not use. A router that chooses by token id
(DeepSeek-V4's hash layers) has only its gate weights read (:func:`infer_hash_rule`, on
probe states and :func:`probe_token_ids`): the rule's values at the experts it chose.

A :class:`Rule`, from the logits z_TE (what the router returns first; ``first="probs"``:
it returns probabilities p, and z = log p):

=================  ========================================================================
``scores``         choice and gate weights
=================  ========================================================================
"softmax"          p = softmax(z); choice = top-k of p (+ b, ``choice_bias``), within the
                   ``groups`` (``group_score``: a group ranked by its best or by the sum of
                   its two best); w = p of the chosen
"sigmoid"          a = sigmoid(z); as "softmax" with a for p (DeepSeek-V3's rule)
"softmax_over_k"   choice = top-k of z (+ b); w = softmax over the k chosen logits (GPT-OSS)
"sparsemixer"      PhiMoE's sparse mixer, evaluation mode, k = 2: e1 = argmax z; its weight
                   is the softmax of z over the experts j with (z_e1 - z_j) / max(|z_j|,
                   z_e1) <= 2 eps (eps = ``router_jitter_noise``); e2 = argmax of z without
                   e1, its weight the same softmax relative to z_e2 with e1 removed
=================  ========================================================================

then w = w / (sum_k w + ``renorm_eps``) when ``renorm``, times ``scale``
(``routed_scaling_factor``), times the chosen experts' learned ``expert_scale`` when the
router has one (Gemma 4). The statistics' distribution over all E (:func:`rule_probs`) is
the softmax of z for every rule but "sigmoid", for which it is a / sum(a).

Shape suffixes: T, E, K, G (moelab.shapes).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from moelab.maps.softmax import rows_softmax

__all__ = [
    "Adapter",
    "RouterReading",
    "Rule",
    "UnresolvedRuleError",
    "adapter_of",
    "apply_rule",
    "infer_hash_rule",
    "infer_rule",
    "probe_token_ids",
    "rule_probs",
]


class UnresolvedRuleError(ValueError):
    """No rule moelab can write out reproduces the router's routing."""


@dataclass(frozen=True)
class Rule:
    """One written-out routing rule (module docstring)."""

    scores: str
    renorm: bool = False
    renorm_eps: float = 0.0
    scale: float = 1.0
    choice_bias: bool = False
    groups: tuple[int, int] | None = None
    group_score: str = "top2sum"
    expert_scale: bool = False
    first: str = "logits"
    jitter_eps: float = 0.0
    choice_on: str = "scores"  # or "logits": the choice is top-k of z + b (Kolibri)

    @property
    def map(self) -> str:
        """The map of the statistics' distribution: "sigmoid" or "softmax"."""
        return "sigmoid" if self.scores in ("sigmoid", "sqrtsoftplus") else "softmax"

    def describe(self) -> str:
        """One line, as in docs/huggingface.md's family table."""
        parts = {
            "softmax": "softmax",
            "sigmoid": "sigmoid",
            "sqrtsoftplus": "sqrt(softplus)",
            "softmax_over_k": "top-k on logits, softmax over the k",
            "sparsemixer": "sparse mixer (PhiMoE)",
        }[self.scores]
        bits = [parts]
        if self.choice_bias:
            bits.append("choice: logits + bias" if self.choice_on == "logits" else "choice + bias")
        if self.groups:
            bits.append(f"{self.groups[1]} of {self.groups[0]} groups")
        if self.renorm:
            bits.append("renormalised")
        if self.scale != 1.0:
            bits.append(f"x {self.scale:g}")
        if self.expert_scale:
            bits.append("x per-expert scale")
        return ", ".join(bits)


def rule_probs(rule: Rule, logits_TE: torch.Tensor) -> torch.Tensor:
    """The distribution over all E that the statistics use (float32)."""
    z = logits_TE.float()
    if rule.scores in ("sigmoid", "sqrtsoftplus"):
        a = _positive(rule.scores, z)
        return a / a.sum(-1, keepdim=True)
    return rows_softmax(z)  # torch.softmax, faster on narrow CPU rows


def _positive(scores: str, z: torch.Tensor) -> torch.Tensor:
    if scores == "sigmoid":
        return torch.sigmoid(z)
    return torch.nn.functional.softplus(z).sqrt()


def _group_mask(v_TE: torch.Tensor, n_group: int, topk_group: int, how: str) -> torch.Tensor:
    T, E = v_TE.shape
    g = v_TE.view(T, n_group, E // n_group)
    score_TG = g.max(-1).values if how == "max" else g.topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(score_TG, dtype=torch.bool)
    keep_TG.scatter_(1, score_TG.topk(topk_group, dim=-1).indices, True)
    return keep_TG.repeat_interleave(E // n_group, dim=1)


def _sparsemixer(z_TE: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    def one(z: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = z.max(-1, keepdim=True)
        factor = ref.abs().clamp(min=top)
        masked = z.masked_fill((top - ref) / factor > 2 * eps, float("-inf"))
        return idx, torch.softmax(masked, -1).gather(-1, idx)

    e1, w1 = one(z_TE, z_TE)
    e2, w2 = one(z_TE.scatter(-1, e1, float("-inf")), z_TE)
    return torch.cat([e1, e2], -1), torch.cat([w1, w2], -1)


def apply_rule(
    rule: Rule,
    logits_TE: torch.Tensor,
    k: int,
    bias_E: torch.Tensor | None = None,
    expert_scale_E: torch.Tensor | None = None,
    chosen_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids_TK, weights_TK)`` of ``rule`` on the logits (float32). ``chosen_TK``: the
    experts chosen elsewhere (a token-id table, DeepSeek-V4's hash layers), which the
    rule then only weighs (its scores at them, renormalised, scaled)."""
    z = logits_TE.float()
    if rule.first == "probs":
        z = z.clamp_min(torch.finfo(torch.float32).tiny).log()
    b = None if bias_E is None or not rule.choice_bias else bias_E.float()
    if chosen_TK is not None:
        if rule.scores not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"rule {rule.scores!r} does not weigh experts chosen elsewhere")
        s = torch.softmax(z, dim=-1) if rule.scores == "softmax" else _positive(rule.scores, z)
        ids = chosen_TK.long()
        w = s.gather(1, ids)
    elif rule.scores == "sparsemixer":
        if k != 2:
            raise ValueError(f"the sparse mixer chooses 2 experts per token, not {k}")
        ids, w = _sparsemixer(z, rule.jitter_eps)
    elif rule.scores == "softmax_over_k":
        choice = z if b is None else z + b
        ids = choice.topk(k, dim=-1).indices
        w = torch.softmax(z.gather(1, ids), dim=-1)
    else:
        s = torch.softmax(z, dim=-1) if rule.scores == "softmax" else _positive(rule.scores, z)
        choice = z if rule.choice_on == "logits" else s
        choice = choice if b is None else choice + b
        if rule.groups is not None:
            keep = _group_mask(choice, *rule.groups, rule.group_score)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        w = s.gather(1, ids)
    if rule.renorm:
        w = w / (w.sum(-1, keepdim=True) + rule.renorm_eps)
    w = w * rule.scale
    if rule.expert_scale and expert_scale_E is not None:
        w = w * expert_scale_E.float()[ids]
    return ids, w


# -- reaching a router: what it returns and where its gate weight is ------------------------


class RouterReading(NamedTuple):
    """A Hugging Face router's output read in moelab's terms (:attr:`Adapter.read`)."""

    logits_TE: torch.Tensor
    """The router's logits over the E experts."""
    weights_TK: torch.Tensor
    """The gate weights of the K chosen experts."""
    ids_TK: torch.Tensor
    """The ids of the K chosen experts."""


@dataclass
class Adapter:
    """How moelab reads one kind of router module: ``weight(router)`` the gate weight
    (E, D); ``read(output, k)`` the router's output as ``(logits_TE, weights_TK,
    ids_TK)``; ``call(router, block, x_TD)`` one forward on hidden states (the probe);
    ``extra`` the arguments the block passes beside the hidden states (AFMoE's bias)."""

    name: str
    weight: Callable[[torch.nn.Module], torch.Tensor]
    read: Callable[[Any, int], RouterReading]
    call: Callable[[torch.nn.Module, torch.nn.Module, torch.Tensor], Any]
    bias: Callable[[torch.nn.Module, torch.nn.Module], torch.Tensor | None]
    first: str = "logits"
    note: str = ""


def _triple(output: Any, k: int) -> RouterReading:
    # (logits, weights, ids) and, in some families, what else the block uses (Inkling's
    # shared-expert gammas)
    ok = isinstance(output, tuple) and len(output) >= 3
    if ok and len(output) > 3:
        ok = isinstance(output[2], torch.Tensor) and not output[2].is_floating_point()
    if not ok:
        raise UnresolvedRuleError(
            f"the router returned {type(output).__name__}, not (logits, weights, indices)"
        )
    return RouterReading(output[0], output[1], output[2])


def _llama4(output: Any, k: int) -> RouterReading:
    # (scores_TE: sigmoid of the chosen logits, 0 elsewhere; logits_TE)
    scores_TE, logits_TE = output
    w, ids = scores_TE.float().topk(k, dim=-1)
    return RouterReading(logits_TE, w, ids)


def _own_weight(router: torch.nn.Module) -> torch.Tensor:
    return router.weight


def _child_weight(name: str) -> Callable[[torch.nn.Module], torch.Tensor]:
    return lambda router: getattr(router, name).weight


def _plain_call(router: torch.nn.Module, block: torch.nn.Module, x: torch.Tensor) -> Any:
    return router(x)


def _attr_bias(router: torch.nn.Module, block: torch.nn.Module) -> torch.Tensor | None:
    b = getattr(router, "e_score_correction_bias", None)
    return b if isinstance(b, torch.Tensor) else None


_BIAS_ARGS = ("e_score_correction_bias", "expert_bias")
"""Names of a router forward's second argument: the block's choice bias, passed in."""


def _bias_arg(router: torch.nn.Module) -> str | None:
    try:
        params = list(inspect.signature(router.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return None
    return params[1] if len(params) > 1 and params[1] in _BIAS_ARGS else None


def _block_bias_attr(router: torch.nn.Module, block: torch.nn.Module) -> torch.Tensor | None:
    name = _bias_arg(router)
    b = getattr(block, name, None) if name else None
    return b if isinstance(b, torch.Tensor) else None


def _bias_arg_call(router: torch.nn.Module, block: torch.nn.Module, x: torch.Tensor) -> Any:
    return router(x, _block_bias_attr(router, block))


def _block_bias(router: torch.nn.Module, block: torch.nn.Module) -> torch.Tensor | None:
    b = getattr(block, "expert_bias", None)
    return b if isinstance(b, torch.Tensor) else None


ADAPTERS: dict[str, Adapter] = {
    "triple": Adapter("triple", _own_weight, _triple, _plain_call, _attr_bias),
    "llama4": Adapter(
        "llama4", _own_weight, _llama4, _plain_call, _attr_bias,
        note="the block scales each expert's input by its gate weight",
    ),
    "classifier": Adapter(
        "classifier", _child_weight("classifier"), _triple, _plain_call, _attr_bias
    ),
    "wg": Adapter("wg", _child_weight("wg"), _triple, _plain_call, _attr_bias),
    "proj": Adapter("proj", _child_weight("proj"), _triple, _plain_call, _attr_bias, first="probs"),
    "bias_arg": Adapter("bias_arg", _own_weight, _triple, _bias_arg_call, _block_bias_attr),
    "afmoe": Adapter(
        "afmoe", _child_weight("gate"), _triple,
        lambda r, blk, x: r(x.unsqueeze(0), blk.expert_bias), _block_bias,
    ),
}  # fmt: skip
"""Router kinds by the adapter's name; :func:`adapter_of` picks one for a module."""


def adapter_of(router: torch.nn.Module) -> Adapter | None:
    """The :class:`Adapter` for a router module, or None when moelab cannot reach its
    gate weight (or does not know what it returns)."""
    cls = type(router).__name__
    if cls == "Llama4Router":
        return ADAPTERS["llama4"]
    if cls.startswith("Afmoe") and isinstance(getattr(router, "gate", None), torch.nn.Linear):
        return ADAPTERS["afmoe"]
    if cls.startswith("Gemma4") and isinstance(getattr(router, "proj", None), torch.nn.Linear):
        return ADAPTERS["proj"]
    w = getattr(router, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        if _bias_arg(router) is not None:
            return ADAPTERS["bias_arg"]
        return ADAPTERS["triple"]
    for name in ("classifier", "wg"):
        child = getattr(router, name, None)
        if isinstance(child, torch.nn.Linear):
            return ADAPTERS[name]
    return None


# -- finding the rule ---------------------------------------------------------------------


def _attr(router: torch.nn.Module, config: Any, *names: str) -> Any:
    for obj in (router, config):
        for n in names:
            v = getattr(obj, n, None)
            if v is not None:
                return v
    return None


def _candidates(
    router: torch.nn.Module, config: Any, adapter: Adapter, has_bias: bool
) -> list[Rule]:
    scale = float(
        _attr(router, config, "routed_scaling_factor", "route_scale", "router_scaling_factor")
        or 1.0
    )
    n_group = int(_attr(router, config, "num_group", "n_group") or 1)
    topk_group = int(_attr(router, config, "topk_group") or n_group)
    groups = (n_group, topk_group) if n_group > 1 and topk_group < n_group else None
    jitter = float(getattr(router, "router_jitter_noise", 0.0) or 0.0)
    expert_scale = isinstance(getattr(router, "per_expert_scale", None), torch.Tensor)
    base = Rule(scores="softmax", first=adapter.first, expert_scale=expert_scale)
    scales = [scale, 1.0] if scale != 1.0 else [1.0]
    group_options: list[tuple[tuple[int, int] | None, str]] = [(None, "top2sum")]
    if groups is not None:
        group_options = [(groups, "top2sum"), (groups, "max"), *group_options]
    out: list[Rule] = []
    choices = ("scores", "logits") if has_bias else ("scores",)
    for scores in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_over_k"):
        for renorm, s, (g, how), on in itertools.product(
            (False, True), scales, group_options, choices
        ):
            if scores == "softmax_over_k" and (renorm or g is not None or on == "logits"):
                continue
            out.append(
                replace(base, scores=scores, renorm=renorm, scale=s, choice_bias=has_bias,
                        groups=g, group_score=how, choice_on=on)
            )  # fmt: skip
    if jitter > 0 or type(router).__name__.startswith("Phimoe"):
        out.append(replace(base, scores="sparsemixer", jitter_eps=jitter))
    return out


def same_routing(ids_a: torch.Tensor, w_a: torch.Tensor, ids_b: torch.Tensor, w_b: torch.Tensor,
          tol: float) -> bool:  # fmt: skip
    if ids_a.shape != ids_b.shape:
        return False
    sa, ia = ids_a.long().sort(-1)
    sb, ib = ids_b.long().sort(-1)
    if not torch.equal(sa, sb):
        return False
    wa, wb = w_a.float().gather(-1, ia), w_b.float().gather(-1, ib)
    return bool(torch.allclose(wa, wb, atol=tol, rtol=tol))


def float32_copy(router: torch.nn.Module) -> torch.nn.Module:
    """``router`` itself when its parameters are float32, else a float32 copy of it (a
    router is small: E x D), so that the rules are told apart at float32 precision
    whatever the checkpoint's dtype."""
    if all(p.dtype == torch.float32 for p in router.parameters()):
        return router
    import copy

    return copy.deepcopy(router).float()


def probe_states(router_weight: torch.Tensor, n: int = 97, seed: int = 0) -> torch.Tensor:
    """``x_TD``: hidden states whose logits spread over about one unit (fixed seed), in
    the gate weight's dtype and device."""
    gen = torch.Generator().manual_seed(seed)
    d = router_weight.shape[1]
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = router_weight.detach().double().cpu()
    spread = float((x @ w.T).std())
    if spread > 0:
        x = x / spread
    return x.to(device=router_weight.device, dtype=router_weight.dtype)


def probe_token_ids(vocab_size: int, n: int = 97, seed: int = 0) -> torch.Tensor:
    """``ids_T``: n token ids drawn uniformly from [0, ``vocab_size``) (fixed seed), int64
    on the CPU: the ids that go with :func:`probe_states` to a router that chooses by
    token id."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen)


@torch.no_grad()
def infer_hash_rule(router: torch.nn.Module, config: Any, vocab_size: int) -> Rule:
    """The :class:`Rule` of the gate weights of a router that chooses by token id
    (DeepSeek-V4's ``DeepseekV4HashRouter``: ``router(x, input_ids)``, its experts a
    fixed table's row): on probe states and probe ids, the rule among softmax / sigmoid /
    sqrt-softplus scores (renormalised or not, scaled or not; no choice bias, no groups:
    nothing is chosen) whose values at the router's own experts are its weights (float32,
    1e-5). UnresolvedRuleError when none or rules of two maps do."""
    router = float32_copy(router)
    x = probe_states(router.weight)
    ids_T = probe_token_ids(vocab_size).to(x.device)
    was_training = router.training
    router.eval()
    try:
        z, w, ids = _triple(router(x, ids_T), 0)
    finally:
        router.train(was_training)
    found = []
    for rule in _candidates(router, config, ADAPTERS["triple"], False):
        if rule.scores not in ("softmax", "sigmoid", "sqrtsoftplus") or rule.groups:
            continue
        ref_ids, ref_w = apply_rule(rule, z, ids.shape[-1], chosen_TK=ids)
        if same_routing(ref_ids, ref_w, ids, w, 1e-5):
            found.append(rule)
    scores = sorted({r.scores for r in found})
    if len(scores) != 1:
        matched = "none" if not found else f"the rules of {' and '.join(scores)} alike"
        raise UnresolvedRuleError(
            f"{type(router).__name__} chooses by token id and weighs its experts by a rule "
            f"moelab cannot tell: on probe inputs its gate weights match {matched} of "
            "softmax / sigmoid / sqrt-softplus scores (renormalised or not, scaled or not)"
        )
    return found[0]


@torch.no_grad()
def infer_rule(
    router: torch.nn.Module,
    block: torch.nn.Module,
    config: Any,
    adapter: Adapter,
    k: int,
) -> Rule:
    """The :class:`Rule` that reproduces ``router``'s output on probe states (with its
    own ``k``; with k = 2 as well where it honours ``top_k`` and its k is 1, so that the
    map is told apart). Raises UnresolvedRuleError saying so when none does."""
    router = float32_copy(router)
    weight = adapter.weight(router)
    x = probe_states(weight)
    bias = adapter.bias(router, block)
    expert_scale = getattr(router, "per_expert_scale", None)
    tol = 1e-5
    was_training = router.training
    router.eval()
    try:
        probes = [(k, adapter.read(adapter.call(router, block, x), k))]
        if k == 1 and hasattr(router, "top_k") and weight.shape[0] > 2:
            router.top_k = 2
            try:
                out2 = adapter.read(adapter.call(router, block, x), 2)
                if out2[2].shape[-1] == 2:
                    probes.append((2, out2))
            finally:
                router.top_k = k
    finally:
        router.train(was_training)
    found = []
    for rule in _candidates(router, config, adapter, bias is not None):
        ok = True
        for kk, (z, w, ids) in probes:
            try:
                ref_ids, ref_w = apply_rule(rule, z, kk, bias, expert_scale)
            except ValueError:
                ok = False
                break
            if not same_routing(ref_ids, ref_w, ids, w, tol):
                ok = False
                break
        if ok:
            found.append(rule)
    if not found:
        raise UnresolvedRuleError(
            f"{type(router).__name__} routes by a rule moelab cannot write out: on probe "
            "inputs its experts and gate weights match none of softmax / sigmoid / "
            "top-k-on-logits / sparse-mixer top-k (with or without choice bias, groups, "
            "renormalisation and scaling)"
        )
    maps = {r.map for r in found}
    if len(maps) > 1:
        raise UnresolvedRuleError(
            f"{type(router).__name__}'s routing is matched by a softmax and by a sigmoid "
            "rule alike (it chooses one expert, weight 1, and ignores top_k), so its "
            "distribution over the experts is unknown"
        )
    return found[0]
