"""The MoE layer: a router chooses K experts per token, the token rows are permuted into
one block per expert, the SwiGLU experts compute, and the gate weights combine the rows
back per token (:mod:`moelab.moe.dispatch`).

Shape suffixes: T, D, E, K, J, N (moelab.shapes).

    y_t = sum_{k : computed[t, k]} weights[t, k] * expert_{ids[t, k]}(x_t)
          [+ sum_{k : null[t, k]} weights[t, k] * x_t]        identity null experts
          [+ sum_{k : null[t, k]} weights[t, k] * (a1 x_t + a2 v_m)]   constant ones
          [+ g(x_t) * sum_{s < n_shared} shared_s(x_t)]       shared experts

and with ``gate_on="input"`` (Llama 4) the gate weight scales each expert's input in
place of its output: y_t = sum_k expert_{ids[t, k]}(weights[t, k] * x_t) (+ the null
and shared experts, :mod:`moelab.moe.null`).

Null experts (``RouterConfig.n_null_experts``, AdaMoE / MoE++) are slots whose id is
>= E: they take no dispatch and no FLOPs (the router marks them ``null_TK``, never
``selected_TK``, so ``computed_TK`` holds real experts only); a "zero" null expert adds
nothing, an "identity" one (MoE++'s copy expert) adds its gate weight times x, a
"constant" one (MoE++) its gate weight times a1 x + a2 v_m, [a1, a2] = softmax(W_m x),
with v_m and W_m parameters of the layer (:class:`moelab.moe.null.ConstantExperts`). Shared
experts (``MoEConfig.n_shared_experts``, DeepSeekMoE; with ``shared_gate`` the Qwen2-MoE
sigmoid gate g) run on every token as one wide SwiGLU (:mod:`moelab.moe.shared`).

Usage (the contract of DESIGN.md, section 3)::

    moe = MoE(MoEConfig(d_model=64, d_ff=128, router=rc))
    y_TD, out = moe(x_TD)  # x of shape (T, D) or (B, S, D); out is the RouterOutput
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelab.routing.config import RouterConfig
from moelab.routing.output import RouterOutput

from .dispatch import ExpertDispatch, permute, permute_padded, unpermute
from .experts import SwiGLUExperts
from .null import ConstantExperts, null_output
from .shared import SharedExperts

GATE_ON = ("output", "input")


@dataclass
class MoEConfig:
    """An MoE feed-forward layer: a router over E SwiGLU experts of hidden width d_ff."""

    d_model: int
    """Width of the token representations; must equal router.d_model."""
    d_ff: int
    """Hidden width F of each expert."""
    router: RouterConfig
    """The router (its n_experts is the number of routed experts E)."""
    n_shared_experts: int = 0
    """Shared experts N (DeepSeekMoE): always-on SwiGLU experts of width d_ff whose
    summed output is added to the routed one; 0: none."""
    shared_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w), w a learned (D,) vector
    (Qwen2-MoE); needs n_shared_experts > 0."""
    gate_on: str = "output"
    """Where a routed expert's gate weight applies: "output" (y = sum_k w_k
    expert_k(x), default) or "input" (y = sum_k expert_k(w_k x), Llama 4, whose router
    is top-K on the logits with w = sigmoid(z): router map="sigmoid", renorm=False).
    Null experts see w x too (zero and identity ones give the same either way); shared
    experts always see x."""

    def __post_init__(self) -> None:
        if self.gate_on not in GATE_ON:
            raise ValueError(f"gate_on must be one of {GATE_ON}, got {self.gate_on!r}")
        if self.n_shared_experts < 0:
            raise ValueError(
                f"n_shared_experts must be >= 0 (0: no shared experts), got {self.n_shared_experts}"
            )
        if self.shared_gate and self.n_shared_experts == 0:
            raise ValueError(
                "shared_gate gates the shared experts' output, and there are none: set "
                "n_shared_experts >= 1 or shared_gate=False"
            )
        if self.d_model <= 0:
            raise ValueError(f"d_model must be positive, got {self.d_model}")
        if self.d_ff <= 0:
            raise ValueError(f"d_ff must be positive, got {self.d_ff}")
        if self.d_model != self.router.d_model:
            raise ValueError(
                f"MoEConfig.d_model = {self.d_model} but router.d_model = "
                f"{self.router.d_model}; the router scores the same tokens the experts "
                "compute, so set both to the same width"
            )

    @property
    def n_experts(self) -> int:
        """E, from the router."""
        return self.router.n_experts


class MoE(nn.Module):
    """Router + sort-based dispatch: permute -> experts -> unpermute.

    ``forward(x)`` returns ``(y, out)``: y has x's shape and dtype; out is the router's
    `RouterOutput` (ids, weights, probabilities, auxiliary loss) for diagnostics and the
    training loss.
    """

    def __init__(self, config: MoEConfig, router: nn.Module | None = None) -> None:
        """Args:
        config: the layer's configuration.
        router: any module with ``router(x_TD, top_k=...) -> RouterOutput``; by default
            ``Router(config.router)``. Passing one lets tests and experiments swap it.
        """
        super().__init__()
        self.config = config
        if router is None:
            # NOTE: imported lazily so that moelab.moe imports without the Router module
            # (and so a custom router never pulls it in).
            from moelab.routing.router import Router

            router = Router(config.router)
        self.router = router
        self.experts = SwiGLUExperts(config.n_experts, config.d_model, config.d_ff)
        self.expert_dispatch: ExpertDispatch | None = None
        """What runs the experts between permute and unpermute when they are spread
        over ranks (`moelab.moe.expert_parallel.enable_expert_parallel` sets it); None:
        this process holds every expert and calls ``self.experts`` itself."""
        self.shared: SharedExperts | None = None
        if config.n_shared_experts:
            self.shared = SharedExperts(
                config.n_shared_experts, config.d_model, config.d_ff, config.shared_gate
            )
        rc = config.router
        self.constants: ConstantExperts | None = None
        if rc.n_null_experts and rc.null_expert == "constant":
            self.constants = ConstantExperts(rc.n_null_experts, config.d_model)

    def forward(
        self,
        x: torch.Tensor,
        top_k: int | None = None,
        lapsum_k: float | torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterOutput]:
        """Route and compute.

        Args:
            x: (T, D) or (B, S, D).
            top_k: K for this call (e.g. an inference-time budget); None keeps the
                router's configured K.
            lapsum_k: the LapSum budget k for this call (a learned per-layer k, possibly
                a 0-d tensor that requires grad); None keeps the configured one.
            token_ids: the input token ids of x's tokens, shape (T,) or (B, S) (the
                model passes them, for rules that route by token id); None: unknown.

        Returns:
            (y, out): y of x's shape and dtype, out the router's output on the
            flattened (T, D) tokens.
        """
        if x.dim() not in (2, 3) or x.shape[-1] != self.config.d_model:
            raise ValueError(
                f"x must have shape (T, {self.config.d_model}) or (B, S, "
                f"{self.config.d_model}), got {tuple(x.shape)}"
            )
        x_TD = x.reshape(-1, x.shape[-1])
        kwargs: dict[str, object] = {}
        if top_k is not None:
            kwargs["top_k"] = top_k
        if lapsum_k is not None:
            kwargs["lapsum_k"] = lapsum_k
        # NOTE: passed only when known, so that a custom router without these
        # arguments keeps working
        if token_ids is not None:
            kwargs["token_ids_T"] = token_ids.reshape(-1)
        if x.dim() == 3:
            kwargs["seq_len"] = x.shape[1]
        out: RouterOutput = self.router(x_TD, **kwargs)
        dispatch = self.expert_dispatch
        if dispatch is not None:  # capacity counted over the expert-parallel group
            out = dispatch.drop(out, self.config.router)
        if dispatch is None and torch.compiler.is_compiling() and self.experts.grouped_runs(x_TD):
            y_TD = self._experts_padded(x_TD, out)
        else:
            x_ND, counts_E, plan = permute(
                x_TD, out.ids_TK, out.weights_TK, out.computed_TK, self.config.n_experts
            )
            if self.config.gate_on == "input":  # Llama 4: expert_e(w x), its output unweighed
                x_ND = (x_ND * plan.weight_N.unsqueeze(-1)).to(x_ND.dtype)
                plan = plan._replace(weight_N=torch.ones_like(plan.weight_N))
            # NOTE: the seam: here, or through the all-to-all of expert parallelism
            if dispatch is None:
                y_ND = self.experts(x_ND, counts_E)
            else:
                y_ND = dispatch(self.experts, x_ND, counts_E)
            y_TD = unpermute(y_ND, plan)
        if out.null_TK is not None:  # null experts: no dispatch (moelab.moe.null)
            rc = self.config.router
            extra_TD = null_output(
                rc.null_expert,
                x_TD,
                out.ids_TK,
                out.weights_TK,
                out.null_TK,
                rc.n_experts,
                self.constants,
                self.config.gate_on,
            )
            if extra_TD is not None:
                y_TD = y_TD + extra_TD
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        return y_TD.reshape(x.shape).to(x.dtype), out

    def _experts_padded(self, x_TD: torch.Tensor, out: RouterOutput) -> torch.Tensor:
        """The routed experts' sum through `permute_padded` (no host read: one graph
        under ``torch.compile``, whatever the routing).

        NOTE: taken under torch.compile only. Eager keeps `permute` and the loop over
        experts: a training step of the tiny preset (batch 8 x 128, one thread, CPU
        float32, AdamW) took 1.08-1.20x as long with this path in eager (it computes all
        T * K rows, the loop skips the dropped ones). Expert parallelism needs host
        counts for its all-to-all and keeps `permute` too, and so do the devices and
        dtypes grouped GEMM cannot take (`SwiGLUExperts.grouped_runs`: CUDA float32,
        misaligned widths, float64), where the padded path would run every expert on
        every row.
        """
        p = permute_padded(x_TD, out.ids_TK, out.weights_TK, out.computed_TK, self.config.n_experts)
        x_JD, plan = p.x_JD, p.plan
        if self.config.gate_on == "input":  # Llama 4: expert_e(w x), its output unweighed
            x_JD = (x_JD * plan.weight_N.unsqueeze(-1)).to(x_JD.dtype)
            own_J = (p.expert_J < self.config.n_experts).to(plan.weight_N.dtype)
            plan = plan._replace(weight_N=own_J)
        y_JD = self.experts.forward_offsets(x_JD, p.offs_E, p.expert_J)
        return unpermute(y_JD, plan)
