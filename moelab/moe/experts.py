"""The experts of an MoE layer: E SwiGLU feed-forward networks with stacked weights.

Shape suffixes: D, F, E, J, N (moelab.shapes).

Expert e maps a row x (D,) to

    expert_e(x) = W_down_e (silu(W_gate_e x) ⊙ (W_up_e x))

(SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202).

Two implementations compute the same function (`SwiGLUExperts.impl`, see
`resolve_impl` for the rule that picks one): a loop over experts (the reference) and
grouped GEMM, ``torch._grouped_mm`` over the E row blocks at once. Under
``torch.compile`` the layer calls `SwiGLUExperts.forward_offsets` instead, with the
block ends on the device (custom op ``moelab::grouped_mm``, no host read).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IMPLS = ("auto", "loop", "grouped")
"""Values of `SwiGLUExperts.impl`: "loop" (one GEMM per expert, the reference),
"grouped" (``torch._grouped_mm``), "auto" (the rule of `resolve_impl`)."""

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes ``torch._grouped_mm`` has kernels for (on CPU in torch 2.13; CUDA: bf16)."""

_PROBED: dict[tuple[str, int | None], bool] = {}
"""Per CUDA device: did a tiny bf16 ``torch._grouped_mm`` forward and backward run?"""


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (absent before torch 2.8)."""
    return hasattr(torch, "_grouped_mm")


def _is_compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _probe_cuda(device: torch.device) -> bool:
    """Run a tiny bf16 grouped GEMM forward and backward once per device (older GPUs or
    torch builds raise "grouped gemm is only supported on SM90" and the like)."""
    key = (device.type, device.index)
    if key not in _PROBED:
        if _is_compiling():  # NOTE: no probe inside a traced graph; assume the rule holds
            return True
        try:
            a = torch.randn(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            b = torch.randn(2, 16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
            torch._grouped_mm(a, b, offs=offs).square().sum().backward()
            _PROBED[key] = True
        except RuntimeError:
            _PROBED[key] = False
    return _PROBED[key]


def grouped_alignment_problem(dtype: torch.dtype, d_model: int, d_ff: int) -> str | None:
    """Why ``torch._grouped_mm`` cannot take rows of width d_model and d_ff in ``dtype``
    (None: it can). Its operands need row strides that are multiples of 16 bytes, so
    d_model and d_ff must be multiples of 16 / itemsize (8 for bf16, 4 for float32), and
    it has no float64 kernel."""
    if dtype not in _GROUPED_DTYPES:
        return f"torch._grouped_mm has no {dtype} kernel (it takes bf16, float16, float32)"
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    if d_model % align or d_ff % align:
        return (
            f"torch._grouped_mm needs row strides of whole 16 bytes: d_model = {d_model} and "
            f"d_ff = {d_ff} must be multiples of {align} in {dtype}"
        )
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: autocast's dtype when autocast is on for
    ``x``'s device, else ``x``'s dtype."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except (TypeError, AttributeError):  # NOTE: torch < 2.4: CUDA only, no device argument
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return x.dtype


def resolve_impl(
    impl: str, device: torch.device, dtype: torch.dtype, d_model: int, d_ff: int
) -> str:
    """ "loop" or "grouped": the implementation that runs for ``impl`` on this device,
    compute dtype and shape.

    "auto" takes grouped GEMM when all hold, else the loop:
      - this torch has ``torch._grouped_mm`` (torch >= 2.8);
      - the device is CUDA and the compute dtype bf16 (the case its kernels are built
        for; ``moelab bench gpu`` measures it against the loop). The CPU keeps the loop:
        there ``torch._grouped_mm`` took 1.03-1.33x the loop's time in float32 (one
        thread, the shapes of ``moelab bench moe``, forward and forward+backward,
        medians of interleaved pairs) and 1.2-3.0x in bf16;
      - d_model and d_ff are multiples of 8 (16-byte strides, `grouped_alignment_problem`);
      - a tiny bf16 grouped GEMM forward and backward ran once on this device.
    "loop" is always the loop. "grouped" forces grouped GEMM and raises ValueError where
    it cannot run (no ``torch._grouped_mm``, float64, misaligned widths).
    The answer depends only on these arguments (the device probe is cached), so a model
    takes one path for a whole run.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "loop":
        return "loop"
    if impl == "grouped":
        if not grouped_mm_available():
            raise ValueError(
                f"impl='grouped' needs torch._grouped_mm (torch >= 2.8), this is torch "
                f"{torch.__version__}; use impl='loop' or 'auto'"
            )
        problem = grouped_alignment_problem(dtype, d_model, d_ff)
        if problem is not None:
            raise ValueError(f"impl='grouped': {problem}; use impl='loop' or 'auto'")
        return "grouped"
    if (
        grouped_mm_available()
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and grouped_alignment_problem(dtype, d_model, d_ff) is None
        and _probe_cuda(device)
    ):
        return "grouped"
    return "loop"


if grouped_mm_available():
    # NOTE: torch._grouped_mm's fake (meta) kernel accepts bf16 only, so torch.compile
    # cannot trace the float32 CPU kernel; these two custom ops hide it behind fakes
    # of their own (the output shapes follow from the input shapes alone).

    @torch.library.custom_op("moelab::grouped_mm", mutates_args=())
    def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """(J, A) rows times (E, A, B) weights per block -> (J, B); rows from offs[-1]
        on hold garbage (the caller masks them)."""
        return torch._grouped_mm(x.contiguous(), w, offs=offs)

    @_grouped_mm_op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[-1])

    @torch.library.custom_op("moelab::grouped_mm_wgrad", mutates_args=())
    def _grouped_mm_wgrad(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Weight gradient of `_grouped_mm_op`: (E, A, B), block e = x_e^T g_e."""
        return torch._grouped_mm(x.contiguous().t(), g.contiguous(), offs=offs)

    @_grouped_mm_wgrad.register_fake
    def _(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return x.new_empty(offs.shape[0], x.shape[1], g.shape[1])

    def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
        ctx.save_for_backward(*inputs)

    def _backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, w, offs = ctx.saved_tensors
        grad_x = _grouped_mm_op(grad, w.transpose(-2, -1), offs)
        return grad_x, _grouped_mm_wgrad(x, grad, offs), None

    _grouped_mm_op.register_autograd(_backward, setup_context=_setup)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous:
    ``torch._grouped_mm``'s backward refuses a broadcast (stride-0) gradient, the one
    ``out.sum().backward()`` sends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts whose weights are stacked along a leading expert axis.

    Parameters:
        w_gate_EFD: (E, F, D) gate projections.
        w_up_EFD: (E, F, D) up projections.
        w_down_EDF: (E, D, F) down projections.

    Stacked parameters keep the state dict one tensor per projection (whatever E is) and
    are the layout that grouped-GEMM kernels and expert parallelism (sharding dim 0) want.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, impl: str = "auto") -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        """"auto", "loop" or "grouped" (`resolve_impl`); an attribute, so tests and
        benchmarks can switch a built layer: ``moe.experts.impl = "loop"``."""
        if n_experts <= 0 or d_model <= 0 or d_ff <= 0:
            raise ValueError(
                f"n_experts, d_model and d_ff must be positive, got {n_experts}, {d_model}, {d_ff}"
            )
        self.n_experts = n_experts
        self.d_model = d_model
        self.d_ff = d_ff
        self.w_gate_EFD = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_up_EFD = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_down_EDF = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) for the input projections; 0.02/sqrt(2) for the down projection.

        NOTE: the down projection writes into the residual stream; a smaller std there is the
        usual residual-branch scaling (GPT-2 style) so that adding the layer output does not
        inflate the residual at initialisation.
        """
        nn.init.normal_(self.w_gate_EFD, std=0.02)
        nn.init.normal_(self.w_up_EFD, std=0.02)
        nn.init.normal_(self.w_down_EDF, std=0.02 / math.sqrt(2))

    def forward_expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """One expert on rows x_ND: (silu(x W_gate_e^T) * (x W_up_e^T)) W_down_e^T -> (N, D).

        The plain per-expert form; tests use it as the reference for `forward`.
        """
        h_NF = F.silu(F.linear(x_ND, self.w_gate_EFD[e])) * F.linear(x_ND, self.w_up_EFD[e])
        return F.linear(h_NF, self.w_down_EDF[e])

    def forward(self, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
        """Run every expert on its contiguous block of rows.

        Args:
            x_ND: rows sorted by expert: the first ``counts_E[0]`` rows go to expert 0,
                the next ``counts_E[1]`` to expert 1, and so on.
            counts_E: rows per expert (a Python list: the block sizes must be known on the
                host to slice, so the caller syncs once to build it).

        Returns:
            out_ND: ``out[n] = expert_{e(n)}(x[n])``, in the same (sorted) row order.

        NOTE: the weights are unbound once per call rather than indexed as ``w_EFD[e]``
        inside the loop. Indexing makes each expert's backward allocate a zero (E, F, D)
        gradient and accumulate E of them (O(E^2 F D) work); the backward of `unbind` stacks
        the E per-expert gradients once. Measured on CPU (T=8192, D=256, F=512, K=2,
        fwd+bwd against a dense SwiGLU on the same T*K rows): at E=8 both are within ~5% of
        the dense time, at E=64 indexing takes 8.6-11x the dense time and unbind 1.15-1.23x.
        The loop runs over experts, never over tokens.
        """
        w_gate_EFD, w_up_EFD, w_down_EDF = self.stacked_weights()
        if len(counts_E) != w_gate_EFD.shape[0]:
            raise ValueError(
                f"counts_E has {len(counts_E)} entries, expected {w_gate_EFD.shape[0]}"
            )
        if x_ND.shape[0] and self.resolved_impl(x_ND) == "grouped":  # NOTE: no rows: the loop
            return self.forward_grouped(x_ND, counts_E)
        w_gate = w_gate_EFD.unbind(0)
        w_up = w_up_EFD.unbind(0)
        w_down = w_down_EDF.unbind(0)
        outs: list[torch.Tensor] = []
        for e, x_e in enumerate(torch.split(x_ND, counts_E)):
            if counts_E[e] == 0:
                # An expert with no rows adds nothing; its weights get a zero gradient.
                continue
            h_e = F.silu(F.linear(x_e, w_gate[e])) * F.linear(x_e, w_up[e])
            outs.append(F.linear(h_e, w_down[e]))
        if not outs:
            # NOTE: no rows: still a function of x and the weights (zero gradients, not
            # None), so that the backward reaches them as on the ranks that had rows:
            # under expert parallelism every rank must take part in the backward's
            # all-to-all and in FSDP's gradient reduction
            h_0F = F.silu(F.linear(x_ND, w_gate[0])) * F.linear(x_ND, w_up[0])
            return F.linear(h_0F, w_down[0])
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate_EFD, w_up_EFD, w_down_EDF) as plain tensors: all E experts, or under
        expert parallelism (DTensors sharded on dim 0, `moelab.moe.expert_parallel`) this
        rank's E / ep, which `forward` then takes ``counts_E`` for."""
        ws = (self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF)
        return tuple(w.to_local() if hasattr(w, "to_local") else w for w in ws)  # type: ignore[return-value]

    def resolved_impl(self, x_ND: torch.Tensor) -> str:
        """ "loop" or "grouped": what `forward` runs on rows like ``x_ND`` (`resolve_impl`
        of ``self.impl`` on their device and compute dtype)."""
        return resolve_impl(self.impl, x_ND.device, compute_dtype(x_ND), self.d_model, self.d_ff)

    def forward_grouped(self, x_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
        """`forward` through three ``torch._grouped_mm`` calls (gate, up, down), each over
        the E row blocks at once; same arguments and result as the loop.

        The rows and weights are cast to the compute dtype (autocast's, if on: autocast
        does not cover ``torch._grouped_mm`` in every torch); the weights enter as
        transposed views (E, D, F) and (E, F, D) of the stacked parameters, no copy.
        ``offs`` holds the cumulative row counts (int32): group e is rows
        offs[e-1]:offs[e], so an expert with no rows is an empty group (zero output rows,
        zero weight gradient).
        """
        n = x_ND.shape[0]
        if sum(counts_E) != n:
            raise ValueError(f"counts_E sums to {sum(counts_E)}, but x_ND has {n} rows")
        if n == 0:
            return x_ND.new_zeros(0, self.d_model)
        dtype = compute_dtype(x_ND)
        ends, total = [], 0
        for c in counts_E:
            total += c
            ends.append(total)
        offs = torch.tensor(ends, dtype=torch.int32).to(x_ND.device, non_blocking=True)
        x = x_ND.to(dtype).contiguous()
        w_gate_EFD, w_up_EFD, w_down_EDF = self.stacked_weights()
        w_gate = w_gate_EFD.to(dtype).transpose(-2, -1)  # (E, D, F)
        w_up = w_up_EFD.to(dtype).transpose(-2, -1)
        w_down = w_down_EDF.to(dtype).transpose(-2, -1)  # (E, F, D)
        g_NF = torch._grouped_mm(x, w_gate, offs=offs)
        u_NF = torch._grouped_mm(x, w_up, offs=offs)
        h_NF = (F.silu(g_NF) * u_NF).contiguous()
        return _ContiguousGrad.apply(torch._grouped_mm(h_NF, w_down, offs=offs))

    def grouped_runs(self, x: torch.Tensor) -> bool:
        """Whether `forward_offsets` takes grouped GEMM for rows like ``x`` (rather than
        every expert on every row): this torch has ``torch._grouped_mm``, the widths are
        aligned for the compute dtype, and the device is the CPU or CUDA with bf16 (the
        only dtype of its CUDA kernels). `moelab.moe.layer.MoE` takes the padded dispatch
        under compile only then: elsewhere the fallback's E-fold work would be slower
        than the loop's graph breaks."""
        if x.device.type not in ("cpu", "cuda"):
            return False
        dtype = compute_dtype(x)
        return (
            (x.device.type == "cpu" or dtype == torch.bfloat16)
            and grouped_mm_available()
            and grouped_alignment_problem(dtype, self.d_model, self.d_ff) is None
        )

    def forward_offsets(
        self, x_JD: torch.Tensor, offs_E: torch.Tensor, expert_J: torch.Tensor
    ) -> torch.Tensor:
        """`forward` with the block ends on the device (`moelab.moe.dispatch.permute_padded`):
        no host read, so it traces into one graph under ``torch.compile``.

        Args:
            x_JD: rows sorted by expert, then rows that belong to no expert.
            offs_E: int32, the end row of each expert's block (``cumsum`` of the counts).
            expert_J: the expert of each row, E for a row of no expert.

        Returns:
            out_JD: ``expert_{e(j)}(x[j])``, exactly 0 (``torch.where``) at the rows of no
            expert; those rows receive no gradient.

        Grouped GEMM (custom op ``moelab::grouped_mm`` over ``torch._grouped_mm``) where it
        can run (`grouped_alignment_problem`), else every expert on every row, kept where
        the row is its own (E times the FLOPs: the float64 reference of the tests).
        """
        w_gate_EFD, w_up_EFD, w_down_EDF = self.stacked_weights()
        E = w_gate_EFD.shape[0]
        own_J1 = (expert_J < E).unsqueeze(-1)
        dtype = compute_dtype(x_JD)
        if (
            grouped_mm_available()
            and grouped_alignment_problem(dtype, self.d_model, self.d_ff) is None
        ):
            # NOTE: both masks matter: rows past offs_E[-1] come out of torch._grouped_mm
            # as garbage, forward and backward (measured on CPU); where() keeps it out of
            # the output and of the gradient of x.
            x = torch.where(own_J1, x_JD, 0.0).to(dtype)
            g_JF = _grouped_mm_op(x, w_gate_EFD.to(dtype).transpose(-2, -1), offs_E)
            u_JF = _grouped_mm_op(x, w_up_EFD.to(dtype).transpose(-2, -1), offs_E)
            h_JF = F.silu(g_JF) * u_JF
            y_JD = _grouped_mm_op(h_JF, w_down_EDF.to(dtype).transpose(-2, -1), offs_E)
            return torch.where(own_J1, y_JD, 0.0)
        out_JD = x_JD.new_zeros(x_JD.shape[0], self.d_model)
        for e in range(E):
            x_e = torch.where((expert_J == e).unsqueeze(-1), x_JD, 0.0)
            h_e = F.silu(F.linear(x_e, w_gate_EFD[e])) * F.linear(x_e, w_up_EFD[e])
            out_JD = torch.where(
                (expert_J == e).unsqueeze(-1), F.linear(h_e, w_down_EDF[e]), out_JD
            )
        return out_JD

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"impl={self.impl}"
        )
