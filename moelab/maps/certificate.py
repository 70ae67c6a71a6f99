"""A convergence certificate for the maps' fixed-count solvers (the path a GPU runs).

Under ``torch.compile`` (and so on a GPU, where the maps take their PyTorch path) a
solver cannot stop on the data: LapSum runs :data:`~moelab.maps.lapsum.FIXED_ROUNDS`
rounds of its split iteration, the general-alpha maps
:data:`~moelab.maps._core.COMPILED_NEWTON_STEPS` Newton steps and two frames of
:data:`~moelab.maps._core.COMPILED_FRAME_STEPS`. Those counts were measured to suffice
on test batteries; :func:`certificate` says whether they suffice on *your* scores:

    p, ok = maps.certificate("entmax", scores, alpha=1.3)
    if not bool(ok.all()): ...   # the rows where a fixed count fell short

It computes the map as the compiled code does (the PyTorch path, every loop its fixed
count, on any device) and returns, per row, whether every iteration met its own
stopping rule within its count: Newton's threshold within rounding of the root, the
frame's iteration stopped inside its segment (no third frame needed), LapSum's split
repeated. Rows of maps solved in closed form (softmax, sparsemax, 1.5-entmax,
2-normmax, the elementwise gates) are certified by construction, and a row whose
output is not finite (invalid scores: the checks are off on this path) is not. The
result is a tensor: no host read, so a training loop can collect it and look later.

Shape suffixes: T (moelab.shapes).
"""

from __future__ import annotations

from typing import Any

import torch

from ._core import all_converged, collect_converged, fixed_counts
from ._kernels import use_backend
from ._registry import info

__all__ = ["certificate"]


def certificate(
    name: str, z: torch.Tensor, dim: int = -1, **params: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The map ``name`` of ``z`` along ``dim`` as ``torch.compile`` computes it, and
    per row (the scores' shape without ``dim``) whether its fixed-count solvers
    converged: ``(p, ok)``. ``params`` are the map's (``alpha``, ``k``,
    ``temperature``). Runs without autograd."""
    fn = info(name).fn  # unknown names raise
    with torch.no_grad(), use_backend("torch"), fixed_counts(), collect_converged() as flags:
        p = fn(z, dim=dim, **params)
    moved = p.movedim(dim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    ok_T = all_converged(flags, flat) & torch.isfinite(flat).all(-1)
    return p, ok_T.reshape(moved.shape[:-1])
