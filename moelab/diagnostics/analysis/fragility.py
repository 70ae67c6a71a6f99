"""Fragility: which routing decisions change under a small change of numerics or input.

The same text is routed twice, under a reference setting and a changed one:

``bf16``
    the whole forward in float32, then under bfloat16 autocast (moelab's routers still
    score in float32; a Hugging Face model's gate then runs in bfloat16 too);
``kernels``
    the fused CPU kernels of the maps, then PyTorch's own path (moelab runs only);
``perturb``
    at each MoE layer, the router's own input ``x`` and ``x + delta`` with
    ``||delta|| = eps ||x||`` per token: ``direction="random"`` (a Gaussian direction)
    or ``"adversarial"`` (against the gap between the two largest logits:
    ``delta = -eps ||x|| (w_a - w_b) / ||w_a - w_b||``, a and b the two top experts). The
    model goes on with the reference routing, so each layer sees the same input in both
    calls but for delta.

Per MoE layer, with ``delta`` the difference of the router inputs of the two calls
(``bf16`` and ``kernels`` measure it; it grows with depth):

``set_changed``
    the share of tokens whose used experts (selected, non-zero weight) differ;
``argmax_changed``
    the share whose largest logit moved to another expert (the top-1 that the
    certificate is about);
``by_gap``
    both, per bin of the reference top-2 logit gap ``z(1) - z(2)`` (edges
    :data:`GAP_EDGES`);
``by_threshold``
    for a sparse map, per bin of ``gap - threshold`` (:data:`THRESHOLD_EDGES`): a token
    near its map's singleton threshold can gain or lose an expert;
``by_radius``
    per bin of ``r / ||delta||`` (:data:`RADIUS_EDGES`), r the certified top-1 radius
    ``sqrt(2) tau m / ||W||_2`` of the reference call (m the top-2 gap of
    ``softmax(z)``; :mod:`moelab.routing.certification`);
``certified``
    the claim: no token with ``r > ||delta||`` changes its top-1 (``tokens``: how many
    had ``r > ||delta||``; ``argmax_changed``: how many of those changed; ``holds``).
    It is a theorem when the changed call differs from the reference in the router's
    input only, as in ``perturb`` and, for moelab's float32 routers, in ``bf16`` and
    ``kernels``. A Hugging Face gate under bf16 computes its logits in bfloat16, so the
    claim does not apply there (``certified`` is then ``null``, with the reason).

Shape suffixes: B, S, T, D, E (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from moelab.diagnostics.analysis.source import RoutingSource, capture, used_mask
from moelab.routing.certification import margin_radius, spectral_norm
from moelab.routing.measures import top2_gap
from moelab.routing.output import RouterOutput

__all__ = [
    "GAP_EDGES",
    "RADIUS_EDGES",
    "SETTINGS",
    "THRESHOLD_EDGES",
    "FragilityCounts",
    "fragility",
]

SETTINGS = ("bf16", "kernels", "perturb")
GAP_EDGES = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, math.inf)
"""Bins of the top-2 logit gap: [0, 0.01), [0.01, 0.03), ..., [3, inf)."""
THRESHOLD_EDGES = (-math.inf, -1.0, -0.3, -0.1, -0.03, 0.0, 0.03, 0.1, 0.3, 1.0, math.inf)
"""Bins of gap - threshold."""
RADIUS_EDGES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
"""Bins of r / ||delta|| (a token with delta = 0 has ratio inf)."""


class _Binned:
    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = torch.tensor(edges[1:-1], dtype=torch.float64)
        self.bounds = list(edges)
        n = len(edges) - 1
        self.tokens = torch.zeros(n, dtype=torch.long)
        self.set_changed = torch.zeros(n, dtype=torch.long)
        self.argmax_changed = torch.zeros(n, dtype=torch.long)

    def add(self, value_T: torch.Tensor, set_T: torch.Tensor, arg_T: torch.Tensor) -> None:
        b = torch.bucketize(value_T.double(), self.edges, right=True)
        n = self.tokens.shape[0]
        self.tokens += torch.bincount(b, minlength=n)
        self.set_changed += torch.bincount(b, weights=set_T.double(), minlength=n).long()
        self.argmax_changed += torch.bincount(b, weights=arg_T.double(), minlength=n).long()

    def result(self) -> list[dict[str, Any]]:
        return [
            {
                "lo": self.bounds[i],
                "hi": self.bounds[i + 1],
                "tokens": int(self.tokens[i]),
                "set_changed": int(self.set_changed[i]),
                "argmax_changed": int(self.argmax_changed[i]),
            }
            for i in range(self.tokens.shape[0])
        ]


class FragilityCounts:
    """Exact counts of one MoE layer: the reference call against the changed one."""

    def __init__(
        self, threshold: float | None, weight_norm: float, tau: float, radius_scale: float = 1.0
    ) -> None:
        self.threshold = threshold
        self.weight_norm, self.tau = weight_norm, tau
        self.radius_scale = radius_scale  # 1; another value only to test the check itself
        self.tokens = 0
        self.set_changed = 0
        self.argmax_changed = 0
        self.delta_rel_sum = 0.0
        self.certified_tokens = 0
        self.certified_changed = 0
        self.by_gap = _Binned(GAP_EDGES)
        self.by_threshold = None if threshold is None else _Binned(THRESHOLD_EDGES)
        self.by_radius = _Binned(RADIUS_EDGES)

    def update(
        self, ref: RouterOutput, new: RouterOutput, x_TD: torch.Tensor, delta_TD: torch.Tensor
    ) -> None:
        z = ref.logits_TE.detach().double()
        z_new = new.logits_TE.detach().double()
        set_T = (used_mask(ref) != used_mask(new)).any(dim=1)
        arg_T = z.argmax(dim=1) != z_new.argmax(dim=1)
        gap = top2_gap(z)
        margin = top2_gap(torch.softmax(z, dim=1))
        radius = margin_radius(margin, self.tau, self.weight_norm) * self.radius_scale
        d = delta_TD.double().norm(dim=1)
        ratio = torch.where(d > 0, radius / d.clamp_min(1e-300), torch.full_like(d, math.inf))
        certified = radius > d
        self.tokens += int(z.shape[0])
        self.set_changed += int(set_T.sum())
        self.argmax_changed += int(arg_T.sum())
        xn = x_TD.double().norm(dim=1)
        self.delta_rel_sum += float(torch.where(xn > 0, d / xn.clamp_min(1e-300), 0 * d).sum())
        self.certified_tokens += int(certified.sum())
        self.certified_changed += int((certified & arg_T).sum())
        self.by_gap.add(gap, set_T, arg_T)
        if self.by_threshold is not None:
            self.by_threshold.add(gap - self.threshold, set_T, arg_T)
        self.by_radius.add(ratio, set_T, arg_T)

    def result(self, certifies: bool, why: str | None) -> dict[str, Any]:
        n = self.tokens
        cert: dict[str, Any] | None = None
        if certifies:
            cert = {
                "tokens": self.certified_tokens,
                "argmax_changed": self.certified_changed,
                "holds": self.certified_changed == 0,
            }
        return {
            "tokens": n,
            "set_changed": self.set_changed / n if n else None,
            "argmax_changed": self.argmax_changed / n if n else None,
            "set_changed_tokens": self.set_changed,
            "argmax_changed_tokens": self.argmax_changed,
            "delta_rel_mean": self.delta_rel_sum / n if n else None,
            "weight_norm": self.weight_norm,
            "tau": self.tau,
            "by_gap": self.by_gap.result(),
            "by_threshold": None if self.by_threshold is None else self.by_threshold.result(),
            "by_radius": self.by_radius.result(),
            "certified": cert,
            "certified_reason": why,
        }


def _direction(
    source: RoutingSource, layer: int, x_TD: torch.Tensor, out: RouterOutput, how: str, gen: Any
) -> torch.Tensor:
    """Unit directions (T, D) of the perturbation of each token."""
    if how == "random":
        u = torch.randn(x_TD.shape, generator=gen, dtype=torch.float64)
    else:
        weight, _ = source.gate(layer)
        w = weight.double()
        top = out.logits_TE.detach().double().topk(2, dim=1).indices
        u = -(w[top[:, 0]] - w[top[:, 1]])
    norm = u.norm(dim=1, keepdim=True)
    return torch.where(norm > 0, u / norm.clamp_min(1e-300), torch.zeros_like(u))


@contextlib.contextmanager
def _setting(source: RoutingSource, setting: str) -> Iterator[None]:
    if setting == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif setting == "kernels":
        from moelab import maps

        with maps.use_backend("torch"):
            yield
    else:
        yield


def _summary(
    eps: float, row: list[FragilityCounts], setting: str, certifies: bool, why: str | None
) -> dict[str, Any]:
    """One result row: the layers' counts of one ``eps`` and their totals."""
    layers = [{"layer": i, **c.result(certifies, why)} for i, c in enumerate(row)]
    n = sum(c.tokens for c in row)
    cert = None
    if certifies:
        cert = {
            "tokens": sum(c.certified_tokens for c in row),
            "argmax_changed": sum(c.certified_changed for c in row),
        }
        cert["holds"] = cert["argmax_changed"] == 0
    return {
        "eps": None if setting != "perturb" else eps,
        "set_changed": sum(c.set_changed for c in row) / n,
        "argmax_changed": sum(c.argmax_changed for c in row) / n,
        "certified": cert,
        "layers": layers,
    }


def fragility(
    source: RoutingSource,
    setting: str = "perturb",
    data: Any = None,
    eps: Sequence[float] = (0.01,),
    direction: str = "random",
    seed: int = 0,
    radius_scale: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Fragility of every MoE layer of ``source`` on ``data`` under ``setting`` (one of
    :data:`SETTINGS`; ``eps`` and ``direction`` for ``perturb``, one result per eps);
    see the module docstring. ``radius_scale`` multiplies the certified radii: 1, or
    another value to check that the check catches a wrong radius."""
    if setting not in SETTINGS:
        raise ValueError(f"--setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if direction not in ("random", "adversarial"):
        raise ValueError(f"--direction must be random or adversarial, got {direction!r}")
    if setting == "perturb":
        if not eps or any(not (e >= 0 and math.isfinite(e)) for e in eps):
            raise ValueError(f"--eps must be finite and >= 0, got {list(eps)}")
    else:
        eps = (math.nan,)
    if setting == "kernels":
        from moelab import maps

        if source.kind != "run":
            raise ValueError("--setting kernels compares moelab's map kernels: a moelab run only")
        if maps.backend() != "cpu-kernels":
            raise ValueError(
                "--setting kernels: the fused CPU kernels are not in use here "
                "(MOELAB_KERNELS=0, or they did not build), so there is nothing to compare"
            )
    certifies, why = True, None
    if setting == "bf16" and source.kind != "run":
        certifies = False
        why = "under bf16 autocast this model's gate computes its logits in bfloat16"
    gates = [source.gate(i) for i in range(source.n_layers)]
    norms = [float(spectral_norm(w)) for w, _ in gates]
    taus = [float(t) for _, t in gates]
    counts = [
        [
            FragilityCounts(source.threshold, norms[i], taus[i], radius_scale)
            for i in range(source.n_layers)
        ]
        for _ in eps
    ]
    gen = torch.Generator().manual_seed(seed)

    def perturbed(layer: int, module: Any, args: tuple, kwargs: dict, x_TD: Any, out: Any) -> None:
        u = _direction(source, layer, x_TD, out, direction, gen)
        xn = x_TD.double().norm(dim=1, keepdim=True)
        x0 = args[0]
        for e, row in zip(eps, counts, strict=True):
            delta = (e * xn * u).to(x_TD.dtype)
            x2 = (x_TD + delta).to(x0.dtype).reshape(x0.shape)
            new = source.as_output(layer, module(x2, *args[1:], **kwargs))
            row[layer].update(out, new, x_TD, delta)

    n_batches = 0
    with torch.no_grad():
        for x_BS in source.batches(data):
            n_batches += 1
            if setting == "perturb":
                with capture(source, also=perturbed) as take:
                    source.forward(x_BS)
                    take().check()
            else:
                with capture(source, inputs=True) as take:
                    source.forward(x_BS)
                    ref = take()
                    with _setting(source, setting):
                        source.forward(x_BS)
                    new = take()
                for i, (a, b) in enumerate(zip(ref.check(), new.check(), strict=True)):
                    xa, xb = ref.inputs[i], new.inputs[i]
                    assert xa is not None and xb is not None
                    counts[0][i].update(a, b, xa, xb - xa)
            if progress is not None:
                progress(int(x_BS.numel()))
    if not n_batches:
        raise ValueError("the text holds no batch to route")
    results = [
        _summary(e, row, setting, certifies, why) for e, row in zip(eps, counts, strict=True)
    ]
    doc = source.describe()
    doc.update(
        analysis="fragility",
        setting=setting,
        direction=direction if setting == "perturb" else None,
        seed=seed if setting == "perturb" and direction == "random" else None,
        data=None if data is None else str(data),
        tokens=results[0]["layers"][0]["tokens"],
        threshold=source.threshold,
        certified_reason=why,
        results=results,
    )
    return doc
