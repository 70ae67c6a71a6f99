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

    softmax, sigmoid, relu              dense / elementwise gates
    sparsemax, entmax(alpha), normmax(alpha)   sparse maps with a singleton threshold
    lapsum(k, temperature)              soft top-k, values in [0, 1] summing to k
"""

from __future__ import annotations

from collections.abc import Callable

from ._core import check_alpha, checks, checks_enabled, set_checks
from ._kernels import backend, set_backend, use_backend
from .entmax import entmax
from .lapsum import lapsum
from .normmax import normmax
from .relu import relu
from .sigmoid import sigmoid
from .softmax import softmax
from .sparsemax import sparsemax

_REGISTRY: dict[str, Callable[..., object]] = {
    "softmax": softmax,
    "sigmoid": sigmoid,
    "relu": relu,
    "sparsemax": sparsemax,
    "entmax": entmax,
    "normmax": normmax,
    "lapsum": lapsum,
}


def available() -> tuple[str, ...]:
    """Names accepted by :func:`get`."""
    return tuple(_REGISTRY)


def get(name: str) -> Callable[..., object]:
    """The map called ``name`` (see :func:`available`)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown map {name!r}; available maps: {', '.join(available())}"
        ) from None


def threshold(name: str, alpha: float | None = None) -> float | None:
    """The singleton threshold of a map: the top-2 score gap at and above which
    the runner-up (and so every other expert) gets exactly zero weight.

    sparsemax: 1; alpha-normmax: 1 for every alpha; alpha-entmax: 1/(alpha - 1)
    (2 for alpha = 1.5; alpha defaults to 1.5). Maps without one (softmax,
    sigmoid, relu, lapsum) give None.
    """
    get(name)  # unknown names raise
    if name in ("sparsemax", "normmax"):
        if alpha is not None:
            check_alpha(alpha, name)
        return 1.0
    if name == "entmax":
        a = check_alpha(1.5 if alpha is None else alpha, "entmax")
        return 1.0 / (a - 1.0)
    return None


__all__ = [
    "available",
    "backend",
    "checks",
    "checks_enabled",
    "entmax",
    "get",
    "lapsum",
    "normmax",
    "relu",
    "set_backend",
    "set_checks",
    "sigmoid",
    "softmax",
    "sparsemax",
    "threshold",
    "use_backend",
]
