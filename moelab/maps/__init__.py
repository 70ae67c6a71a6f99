"""Probability maps for MoE routers: scores in, gate values out.

Every map works along ``dim`` for any leading shape, computes in float32 for
half-precision input and returns the input dtype, accepts -inf scores (masked
experts get exactly 0) while one score per row is finite, raises ValueError on
bad input, and has a closed-form backward that also supports double backward
(create_graph=True).

Input checks: checks that read tensor values on the host (NaN or +inf scores,
fully masked rows, k out of range, a tensor temperature) run in eager mode;
under torch.compile they are skipped, and ``set_checks(False)`` or
``with checks(False):`` turn them off for speed (bad input then gives NaN or
zero rows, not an error). Checks of plain-number arguments always run.

    softmax, sigmoid, relu, sqrtsoftplus   dense / elementwise gates
    sparsemax, entmax(alpha), normmax(alpha)   sparse maps with a singleton threshold
    lapsum(k, temperature)              soft top-k, values in [0, 1] summing to k

Registry: each map has one :class:`MapInfo` record (``maps.info(name)``,
``maps.registry()``): its function, parameters with defaults and checks, the
singleton threshold law, whether it needs k and whether it maps onto the
simplex. ``available``, ``get`` and ``threshold`` read it; ``register`` adds a map.

The fused CPU kernels: ``backend`` / ``use_backend`` (kernels or the PyTorch path),
``kernel_build_info`` (the CPU, the build's ``-march`` target, instruction set, vector
width and each kernel's path per row width) and ``kernel_target`` (build for another
``-march`` in this process, before the kernels load; ``MOELAB_KERNEL_MARCH``).

For the code built on the maps (the router's stages): ``compute_dtype`` (the dtype a
map computes in for an input dtype) and ``host_checks`` (whether the checks that read
tensor values run now: eager mode with checks on).
"""

from __future__ import annotations

from collections.abc import Callable

from ._core import check_alpha, checks, checks_enabled, compute_dtype, host_checks, set_checks
from ._kernels import backend, set_backend, use_backend
from ._kernels import build_info as kernel_build_info
from ._kernels import target as kernel_target
from ._registry import REQUIRED, MapInfo, Param, info, register, register_builtin_maps, registry
from .certificate import certificate
from .entmax import entmax
from .lapsum import lapsum
from .normmax import normmax
from .relu import relu
from .sigmoid import sigmoid
from .softmax import softmax
from .sparsemax import sparsemax
from .sqrtsoftplus import sqrtsoftplus

register_builtin_maps()


def available() -> tuple[str, ...]:
    """Names accepted by :func:`get`: every registered map, in registration order."""
    return tuple(registry())


def get(name: str) -> Callable[..., object]:
    """The map called ``name`` (see :func:`available`); unknown names raise
    ValueError with the list of available maps."""
    return info(name).fn


def threshold(name: str, alpha: float | None = None) -> float | None:
    """The singleton threshold of a map: the top-2 score gap at and above which
    the runner-up (and so every other expert) gets exactly zero weight.

    Read from the map's record (:func:`info`): sparsemax: 1; alpha-normmax: 1
    for every alpha; alpha-entmax: 1/(alpha - 1) (2 for alpha = 1.5; alpha
    defaults to the map's default). Maps without one (softmax, sigmoid, relu,
    lapsum) give None. ``alpha`` is checked (> 1 and finite) for maps with a
    threshold and ignored by maps without one.
    """
    record = info(name)  # unknown names raise
    if record.threshold_law is None:
        return None
    if alpha is None:
        return record.threshold()
    if "alpha" not in record.params:
        # NOTE: sparsemax (2-entmax) takes no alpha; one given is checked and ignored
        check_alpha(alpha, name)
        return record.threshold()
    return record.threshold(alpha=alpha)


__all__ = [
    "REQUIRED",
    "MapInfo",
    "Param",
    "available",
    "backend",
    "certificate",
    "checks",
    "checks_enabled",
    "compute_dtype",
    "entmax",
    "get",
    "host_checks",
    "info",
    "kernel_build_info",
    "kernel_target",
    "lapsum",
    "normmax",
    "register",
    "registry",
    "relu",
    "set_backend",
    "set_checks",
    "sigmoid",
    "softmax",
    "sparsemax",
    "sqrtsoftplus",
    "threshold",
    "use_backend",
]
