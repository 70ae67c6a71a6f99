"""The lm-evaluation-harness model of a moelab run, registered as ``"moelab"``.

    import lm_eval
    from moelab.integrations.lm_eval import MoelabLM
    lm = MoelabLM(run="runs/softmax", top_k=2, batch_size=16)
    lm_eval.simple_evaluate(model=lm, tasks=["moelab_cloze"], task_manager=...)
    # or, once this module is imported: simple_evaluate(model="moelab",
    #     model_args="run=runs/softmax,top_k=2,batch_size=16,device=cpu", ...)

``hf=DIR`` instead of ``run=`` wraps a local Hugging Face MoE model
(:mod:`moelab.integrations.hf`) the same way. The model reads with the run's own
tokenizer (no special tokens; EOS is the harness's end-of-text and the prefix of an empty
context).

Requests:

``loglikelihood``
    The model reads the whole request, context and continuation (the continuation's
    last token too, so that routing covers every token of the request), left-truncated
    to the model's ``max_length`` (``max_seq_len`` of the run) when longer: the earliest
    context tokens go, as in the harness's own models (which keep ``max_length + 1``
    tokens because they do not feed the last one; here one context token fewer is kept).
    The score is the sum of the log-probabilities of the continuation tokens (those that
    still have a token before them in the window) and ``is_greedy`` says whether each is
    the argmax. Requests are sorted by length (longest first), padded on the right to
    the longest of their batch and run ``batch_size`` at a time, one forward pass per
    batch; right padding changes nothing before it under causal attention, and the
    padding is neither scored nor counted in the routing statistics.
``loglikelihood_rolling``
    The harness's rolling windows (:func:`lm_eval.utils.get_rolling_token_windows`,
    ``context_len=1``, EOS as the first token's context) of at most ``max_length``
    tokens each, scored as above and summed: every token of the text is predicted once;
    for a text shorter than ``max_length`` it is the model's summed NLL on EOS + text.
``generate_until``
    Greedy decoding (``do_sample`` is ignored), batched, without a KV cache (each new
    token runs the window again): it stops at EOS, at the first of the ``until`` strings
    in the decoded continuation (which is cut there) or after ``max_gen_toks`` tokens
    (default 256). The context keeps its last ``max_length`` - 1 tokens.

Routing rules that read the whole batch (expert-choice selection, a per-expert capacity
``capacity_factor``) route a token differently depending on the other tokens of the call,
so requests are evaluated one at a time with them (batch size 1; :attr:`MoelabLM.notes`
says so). For every other rule the results do not depend on the batching (up to float
rounding) and are deterministic.

Shape suffixes: B, S, T, V, K (moelab.shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from moelab.integrations.lm_eval.routing import TaskRouting
from moelab.routing.output import RouterOutput

__all__ = ["BATCH_RULES", "MoelabLM"]

BATCH_RULES = ("expert_choice",)
"""Selection rules that read the whole batch at inference (a token's experts depend on
the other tokens of the call). Sinkhorn reads it in training only."""

_UNKNOWN_TASK = "(no task)"


class _RunBackend:
    """A moelab run: its Transformer and tokenizer."""

    def __init__(self, loaded: Any, device: str) -> None:
        self.loaded = loaded
        self.model = loaded.model.to(device).eval()
        self.tokenizer = loaded.tokenizer
        self.eos_id = int(self.tokenizer.eos_id)
        self.max_length = int(self.model.config.max_seq_len)
        self.name = str(loaded.run_dir)
        self.routers = [layer.router for layer in self.model.moe_layers]
        rc = self.model.config.router_config()
        self.map_name, self.alpha = rc.map, rc.alpha
        # NOTE: under router_layers the layers' rules may differ: each layer's counts
        layers = [r.config for r in self.routers]
        self.sweeps_k = all(c.selection_rule.sweep == "top_k" for c in layers)
        self.n_experts = int(self.model.config.n_experts) if self.routers else 0
        reasons = []
        batch = sorted({c.selection for c in layers if c.selection in BATCH_RULES})
        if batch:
            reasons.append(f"selection {batch[0]!r} (each expert picks tokens of the call)")
        capped = [c.capacity_factor for c in layers if c.capacity_factor is not None]
        if capped:
            reasons.append(f"capacity_factor = {capped[0]} (drops by expert load)")
        self.batch_reason = " and ".join(reasons) or None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def get_top_k(self) -> int | None:
        return int(self.routers[0].top_k) if self.routers else None

    def set_top_k(self, k: int) -> None:
        for r in self.routers:
            r.top_k = k

    @torch.no_grad()
    def forward(self, ids_BS: torch.Tensor) -> tuple[torch.Tensor, list[RouterOutput]]:
        out = self.model(ids_BS, collect=bool(self.routers))
        return out.logits_BSV, out.router_outputs


PROBE_TOKENS = 8
"""Tokens of the forward pass that checks a K set on a Hugging Face model was applied."""


class _HFBackend:
    """A local Hugging Face MoE model (:mod:`moelab.integrations.hf`); its routing is read
    with forward hooks on the routers."""

    def __init__(self, model_dir: str | Path, device: str, trust_remote_code: bool) -> None:
        from moelab.integrations.hf.families import moe_routers
        from moelab.integrations.hf.stats import load_hf, router_output

        model, tokenizer = load_hf(model_dir, trust_remote_code=trust_remote_code)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"--hf {model_dir}: the tokenizer has no EOS token")
        self.eos_id = int(eos)
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_length = int(min(limit, 4096))
        self.name = str(model_dir)
        self.sites = moe_routers(self.model)
        self.own_k = int(self.sites[0].top_k)  # the model's own K, which needs no probe
        self.map_name, self.alpha = self.sites[0].family.map, None
        self.sweeps_k = True
        self.n_experts = int(self.sites[0].n_experts)
        self.batch_reason = None
        self._seen: list[list[RouterOutput]] = [[] for _ in self.sites]
        for i, site in enumerate(self.sites):

            def hook(module: Any, args: Any, output: Any, i: int = i, site: Any = site) -> None:
                self._seen[i].append(router_output(site, *site.read(output)))

            site.router.register_forward_hook(hook)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def get_top_k(self) -> int | None:
        return int(self.sites[0].top_k)

    def set_top_k(self, k: int) -> None:
        """Route with K = ``k``; UnsupportedModelError (naming the family and the layers)
        when a short probe shows some MoE layer did not choose ``k`` distinct experts per
        token (a router that ignores top_k, as PhiMoE's): no score is labelled with a K
        the model did not use."""
        from moelab.integrations.hf.families import top_k
        from moelab.integrations.hf.stats import Seen

        with top_k(self.model, k):  # checks k for the family
            pass
        old = self.get_top_k()
        self._route_with(k)
        if k == self.own_k:
            return
        probe = torch.full((1, PROBE_TOKENS), self.eos_id, device=self.model.device)
        _, outs = self.forward(probe)
        seen = Seen(self.model)
        for i, out in enumerate(outs):
            seen.add(i, out.ids_TK)
        try:
            seen.check_k(k, self.own_k)
        except ValueError:
            self._route_with(old if old is not None else self.own_k)
            raise

    def _route_with(self, k: int) -> None:
        for s in self.sites:
            s.router.top_k = k
            s.top_k = k

    @torch.no_grad()
    def forward(self, ids_BS: torch.Tensor) -> tuple[torch.Tensor, list[RouterOutput]]:
        for seen in self._seen:
            seen.clear()
        logits = self.model(input_ids=ids_BS, use_cache=False).logits
        outs = []
        for seen in self._seen:
            if len(seen) != 1:
                raise ValueError(f"a router ran {len(seen)} times in one forward pass")
            outs.append(seen[0])
        return logits, outs


@register_model("moelab")
class MoelabLM(TemplateLM):
    """lm-evaluation-harness model of a moelab run (``run=DIR``) or a local Hugging Face
    MoE model (``hf=DIR``); see the module docstring for how each request is computed.

    Args:
        run: the run folder (its newest checkpoint; :func:`moelab.diagnostics.load_run`).
        top_k: experts per token at inference (None: as trained).
        batch_size: requests per forward pass.
        device: torch device of the model.
        hf: a local Hugging Face model folder instead of ``run``.
        max_length: the longest window fed (None: the run's ``max_seq_len``; a Hugging
            Face model's ``max_position_embeddings``, at most 4096).
        progress: show a progress bar over requests (stderr).
        loaded: an already loaded run (:class:`moelab.diagnostics.LoadedRun`) instead of
            ``run``.
        trust_remote_code: let the ``hf`` folder run the code its config names
            (``auto_map``; :func:`moelab.integrations.hf.stats.load_hf`), which runs
            that Python with your permissions; refused otherwise.

    ``routing`` (a :class:`TaskRouting`, None for a dense model) collects the routing
    statistics of every request's tokens per task; ``notes`` says how requests were
    computed where that departs from the plain rule (one at a time); ``truncated`` of
    the ``scored`` token sequences (loglikelihood requests and rolling windows,
    generation contexts) were left-truncated."""

    def __init__(
        self,
        run: str | Path | None = None,
        top_k: int | str | None = None,
        batch_size: int | str = 8,
        device: str = "cpu",
        hf: str | Path | None = None,
        max_length: int | str | None = None,
        progress: bool | str = False,
        loaded: Any = None,
        trust_remote_code: bool | str = False,
        **unused: Any,
    ) -> None:
        super().__init__()
        sources = [x for x in (run, hf, loaded) if x is not None]
        if len(sources) != 1:
            raise ValueError("the moelab model needs exactly one of run=DIR, hf=DIR or loaded=")
        if loaded is None and run is not None:
            from moelab.diagnostics.evaluate import load_run

            loaded = load_run(run)
        self.backend: _RunBackend | _HFBackend = (
            _RunBackend(loaded, device)
            if loaded is not None
            else _HFBackend(hf, device, str(trust_remote_code).lower() in ("1", "true", "yes"))
        )
        self._device = torch.device(device)
        self.batch_size_per_gpu = int(batch_size) if str(batch_size) != "auto" else 8
        if self.batch_size_per_gpu < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._max_length = self.backend.max_length if max_length is None else int(max_length)
        if not 2 <= self._max_length <= self.backend.max_length:
            raise ValueError(
                f"max_length must lie in [2, {self.backend.max_length}], got {max_length}"
            )
        self.progress = str(progress).lower() in ("1", "true", "yes")
        self.notes: list[str] = []
        self.truncated = 0
        self.scored = 0
        n_moe = len(getattr(self.backend, "routers", None) or getattr(self.backend, "sites", []))
        self.routing = (
            TaskRouting(n_moe, self.backend.map_name, self.backend.alpha) if n_moe else None
        )
        if self.backend.batch_reason is not None:
            self.notes.append(
                f"{self.backend.name}: the routers read the whole batch "
                f"({self.backend.batch_reason}), so every request was evaluated alone "
                "(batch size 1)"
            )
        if top_k is not None:
            self.set_top_k(int(top_k))

    # -- the model's settings -----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.backend.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        """Requests per forward pass (1 for routers that read the whole batch)."""
        return 1 if self.backend.batch_reason is not None else self.batch_size_per_gpu

    @property
    def tokenizer_name(self) -> str:
        return f"moelab:{self.backend.name}"

    @property
    def top_k(self) -> int | None:
        """The routers' current K (None: a dense model)."""
        return self.backend.get_top_k()

    def set_top_k(self, k: int) -> None:
        """Route with ``k`` experts per token from now on (ValueError outside [1, E] or
        for a rule whose budget is not K)."""
        if self.routing is None:
            raise ValueError(f"{self.backend.name} is a dense model: top_k does not apply")
        if not self.backend.sweeps_k:
            raise ValueError(
                f"{self.backend.name}: the routers do not select a fixed K (a truncating "
                "rule); evaluate it without top_k"
            )
        if not 1 <= k <= self.backend.n_experts:
            raise ValueError(
                f"top_k = {k} is outside [1, {self.backend.n_experts}]: the model has "
                f"{self.backend.n_experts} experts per MoE layer"
            )
        self.backend.set_top_k(k)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kw: Any
    ) -> list[int]:
        return self.backend.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kw: Any) -> str:
        return self.backend.decode(tokens)

    # -- the core: score token sequences in sorted, padded batches ------------------------

    def _batches(self, lengths: Sequence[int]) -> Iterator[list[int]]:
        """Indices in batches of ``batch_size``, longest first (ties in input order)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        b = self.batch_size
        for i in range(0, len(order), b):
            yield order[i : i + b]

    def _pad(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        x = torch.full((len(seqs), width), self.eot_token_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        return x.to(self._device)

    def _bar(self, total: int, desc: str, disable: bool) -> Any:
        import sys

        return tqdm(
            total=total, desc=desc, unit="req", file=sys.stderr, leave=False,
            disable=disable or not self.progress,
        )  # fmt: skip

    def score_tokens(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        tasks: Sequence[str | None] | None = None,
        disable_tqdm: bool = False,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, is_greedy)`` of each ``(context ids, continuation ids)``
        (see the module docstring); the routing of each request's tokens goes to its
        task in ``tasks`` (None: not counted)."""
        L = self.max_length
        seqs, n_scored = [], []
        self.scored += len(pairs)
        for ctx, cont in pairs:
            full = [*ctx, *cont]
            if len(full) > L:
                self.truncated += 1
                full = full[-L:]
            seqs.append(full)
            n_scored.append(min(len(cont), len(full) - 1))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        with self._bar(len(pairs), "loglikelihood", disable_tqdm) as bar:
            for idx in self._batches([len(s) for s in seqs]):
                x = self._pad([seqs[i] for i in idx])
                logits, outs = self.backend.forward(x)
                for b, i in enumerate(idx):
                    n, m = len(seqs[i]), n_scored[i]
                    if m <= 0:
                        continue
                    logp = F.log_softmax(logits[b, n - 1 - m : n - 1].float(), dim=-1)
                    target = x[b, n - m : n]
                    ll = logp.gather(-1, target[:, None]).squeeze(-1).double().sum()
                    greedy = bool((logp.argmax(-1) == target).all())
                    results[i] = (float(ll), greedy)
                if self.routing is not None and tasks is not None and outs:
                    spans = [
                        (tasks[i] or _UNKNOWN_TASK, b, 0, len(seqs[i])) for b, i in enumerate(idx)
                    ]
                    self.routing.add(outs, x.shape[1], spans)
                bar.update(len(idx))
        return results

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        return self.score_tokens(
            [(ctx, cont) for _, ctx, cont in requests],
            None,
            disable_tqdm=bool(kwargs.get("disable_tqdm")),
        )

    # -- the three request types ---------------------------------------------------------

    def _encode_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The harness's encoding (TemplateLM.loglikelihood): an empty context is EOS."""
        if context == "":
            cont = self.tok_encode(continuation)
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        return self._encode_pair(context, continuation)

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        pairs = [self._encode_request(*req.args) for req in requests]
        results = self.score_tokens(pairs, [r.task_name for r in requests], disable_tqdm)
        for req, res in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        windows, owner, tasks = [], [], []
        for r, req in enumerate(requests):
            ids = self.tok_encode(req.args[0])
            # NOTE: max_seq_len = L - 1: a disjoint window's context + continuation is
            # then at most L tokens, what score_tokens feeds whole
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(ids, self.prefix_token_id, self.max_length - 1, 1),
            ):
                windows.append((ctx, cont))
                owner.append(r)
                tasks.append(req.task_name)
        scores = self.score_tokens(windows, tasks, disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (ll, _) in zip(owner, scores, strict=True):
            totals[r] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        L = self.max_length
        contexts, stops, limits = [], [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            ids = self.tok_encode(context) if context else [self.eot_token_id]
            if len(ids) > L - 1:
                self.truncated += 1
                ids = ids[-(L - 1) :]
            self.scored += 1
            contexts.append(ids)
            stops.append([s for s in until if s])
            limits.append(int(kwargs.get("max_gen_toks", 256)))
        out = [""] * len(requests)
        with self._bar(len(requests), "generate_until", disable_tqdm) as bar:
            for idx in self._batches([len(c) for c in contexts]):
                texts = self._generate(
                    [contexts[i] for i in idx],
                    [stops[i] for i in idx],
                    [limits[i] for i in idx],
                    [requests[i].task_name for i in idx],
                )
                for i, text in zip(idx, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(idx))
        return out

    @torch.no_grad()
    def _generate(
        self,
        contexts: list[list[int]],
        stops: list[list[str]],
        limits: list[int],
        tasks: list[str | None],
    ) -> list[str]:
        """Greedy continuations of one batch of contexts."""
        L = self.max_length
        gen: list[list[int]] = [[] for _ in contexts]
        texts = [""] * len(contexts)
        done = [lim <= 0 for lim in limits]
        counted = [0] * len(contexts)  # tokens of each sequence counted in the routing
        first = True
        while not all(done):
            live = [b for b in range(len(contexts)) if not done[b]]
            seqs = [([*contexts[b], *gen[b]])[-L:] for b in live]
            x = self._pad(seqs)
            logits, outs = self.backend.forward(x)
            if self.routing is not None and outs:
                spans = []
                for row, b in enumerate(live):
                    n = len(seqs[row])
                    total = len(contexts[b]) + len(gen[b])
                    new = total - counted[b]  # positions not yet counted: the last ones
                    spans.append((tasks[b] or _UNKNOWN_TASK, row, n - min(new, n), n))
                    counted[b] = total
                self.routing.add(outs, x.shape[1], spans, new_requests=first)
            first = False
            for row, b in enumerate(live):
                tok = int(logits[row, len(seqs[row]) - 1].argmax())
                if tok == self.eot_token_id:
                    done[b] = True
                    continue
                gen[b].append(tok)
                text = self.tok_decode(gen[b])
                cut = [text.index(s) for s in stops[b] if s in text]
                if cut:
                    text, done[b] = text[: min(cut)], True
                texts[b] = text
                if len(gen[b]) >= limits[b]:
                    done[b] = True
        return texts

    # -- bookkeeping ---------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the routing statistics and the request counts (a new evaluation)."""
        if self.routing is not None:
            self.routing.reset()
        self.truncated = self.scored = 0

    @contextlib.contextmanager
    def using_top_k(self, k: int | None) -> Iterator[None]:
        """Route with ``k`` experts inside the block (None: as it is); restored after."""
        old = self.top_k
        try:
            if k is not None:
                self.set_top_k(k)
            yield
        finally:
            if k is not None and old is not None:
                self.backend.set_top_k(old)
