"""The registry of maps: one :class:`MapInfo` record per map.

A record holds everything the rest of moelab needs to know about a map: the
function, its parameters with their defaults and checks, the singleton
threshold law, whether the outputs lie on the simplex, and a one-line
description. Config validation, the router, :func:`moelab.maps.threshold`, the
demo and the benchmarks read the record; none of them compares a map's name.
Adding a map is one file with its function plus one :func:`register` call
(see docs/maps.md, "Adding a map").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ._core import check_alpha
from .lapsum import check_k, check_temperature


class _Required:
    """The default of a parameter that has none: the caller must give it."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

# (value, map name, key in messages, number of experts or None) -> checked value
Check = Callable[[Any, str, str, "int | None"], Any]


@dataclass(frozen=True)
class Param:
    """One parameter of a map: its default (:data:`REQUIRED` if it has none), the
    check of a plain-number value, and what it means (for messages and docs)."""

    default: Any = REQUIRED
    check: Check | None = None
    doc: str = ""


@dataclass(frozen=True)
class MapInfo:
    """What moelab knows about one map.

    ``fn(z, **params, dim=-1)`` computes it. ``params`` maps each keyword
    parameter to its :class:`Param` (in the order of ``fn``'s signature).
    ``threshold_law(**params)`` gives the singleton threshold (the top-2 score gap
    at and above which the runner-up, and so every other expert, gets exactly 0;
    it receives the checked parameters with their defaults); None: the map has
    none. ``simplex``: every output row sums to 1. ``cpu_kernels``: CPU calls may run
    through moelab's fused kernels (:func:`moelab.maps.backend`), which a caller that
    will compile the map loads beforehand (loading cannot be traced).
    """

    name: str
    fn: Callable[..., Any]
    description: str
    params: Mapping[str, Param] = field(default_factory=dict)
    threshold_law: Callable[..., float] | None = None
    simplex: bool = True
    cpu_kernels: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def needs_k(self) -> bool:
        """Whether the map has a budget ``k`` that must be given (LapSum's soft top-k)."""
        return "k" in self.params and self.params["k"].default is REQUIRED

    @property
    def fixed_total(self) -> bool:
        """Every output row has the same total: 1 on the simplex, k for LapSum. Only then
        is the map's mass on some experts a share of something fixed, so only then do
        moelab's statistics report a discarded mass (sigmoid, ReLU and sqrt-softplus
        gates are independent per expert: their total varies from token to token)."""
        return self.simplex or self.needs_k

    def defaults(self) -> dict[str, Any]:
        """The parameters that have a default, with it."""
        return {p: v.default for p, v in self.params.items() if v.default is not REQUIRED}

    def check_params(
        self,
        n_experts: int | None = None,
        keys: Mapping[str, str] | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """Check plain-number parameters and fill in the defaults.

        Returns every parameter of the map, checked (tensor values are passed
        through: the map checks them when called; None counts as not given).
        Raises ValueError, with a message that says what to change, for a
        parameter the map does not take, a required one that is missing, or a
        value out of range (alpha > 1 and finite; 0 < k < ``n_experts``, or
        k > 0 when ``n_experts`` is None; temperature > 0 and finite). ``keys``
        names a parameter as the caller's user spells it (a config key such as
        ``{"k": "lapsum_k"}``) in messages.
        """
        keys = keys or {}
        for p, value in params.items():
            if value is not None and p not in self.params:
                raise ValueError(_not_taken(self.name, p, keys.get(p, p)))
        out: dict[str, Any] = {}
        for p, spec in self.params.items():
            key = keys.get(p, p)
            if p not in params or params[p] is None:
                if spec.default is REQUIRED:
                    raise ValueError(
                        f"map={self.name!r} needs {key} ({spec.doc}); set {key} to a number"
                    )
                out[p] = spec.default
                continue
            value = params[p]
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            out[p] = (
                spec.check(value, self.name, key, n_experts) if spec.check and is_number else value
            )
        return out

    def threshold(self, **params: Any) -> float | None:
        """The singleton threshold for these parameters (None: the map has none).
        The parameters are checked as in :meth:`check_params`."""
        if self.threshold_law is None:
            return None
        return float(self.threshold_law(**self.check_params(**params)))

    def bind(self, **params: Any) -> Callable[..., Any]:
        """``fn`` with these parameters (checked, defaults filled in): ``f(z, dim=-1)``."""
        return functools.partial(self.fn, **self.check_params(**params))


def _not_taken(name: str, param: str, key: str) -> str:
    takers = [m for m, info in _REGISTRY.items() if param in info.params]
    if takers:
        return f"{key} only applies to {_and(takers)}, not {name}"
    own = ", ".join(_REGISTRY[name].params) if name in _REGISTRY else ""
    return f"{name} takes no parameter {key!r}" + (f"; its parameters: {own}" if own else "")


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_REGISTRY: dict[str, MapInfo] = {}


def register(info: MapInfo) -> MapInfo:
    """Add a map to the registry (its name must be new, and every parameter of the
    record a keyword of its function); returns the record."""
    if info.name in _REGISTRY:
        raise ValueError(f"a map named {info.name!r} is registered already; pick another name")
    keywords = inspect.signature(info.fn).parameters
    missing = [p for p in info.params if p not in keywords]
    if missing and not any(k.kind is inspect.Parameter.VAR_KEYWORD for k in keywords.values()):
        raise ValueError(
            f"map {info.name!r}: its function takes no parameter {', '.join(missing)}; "
            "make the record's params the function's keywords"
        )
    _REGISTRY[info.name] = info
    return info


def registry() -> Mapping[str, MapInfo]:
    """Every registered map's record, by name, in registration order (read-only)."""
    return MappingProxyType(_REGISTRY)


def info(name: str) -> MapInfo:
    """The record of the map called ``name``; unknown names raise ValueError with
    the list of available maps."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown map {name!r}; available maps: {', '.join(_REGISTRY)}") from None


def _check_alpha(value: float, name: str, key: str, n_experts: int | None) -> float:
    return check_alpha(value, name, key)


def _check_k(value: float, name: str, key: str, n_experts: int | None) -> float:
    return check_k(value, n_experts, name=name, key=key)


def _check_temperature(value: float, name: str, key: str, n_experts: int | None) -> float:
    return check_temperature(value, name=name, key=key)


def alpha_param(default: float) -> Param:
    """The alpha of the entmax and normmax families: > 1 and finite."""
    return Param(default, _check_alpha, "alpha > 1 of the family")


def register_builtin_maps() -> None:
    """Register moelab's own maps (called once, on import of :mod:`moelab.maps`)."""
    from .entmax import entmax
    from .lapsum import lapsum
    from .normmax import normmax
    from .relu import relu
    from .sigmoid import sigmoid
    from .softmax import softmax
    from .sparsemax import sparsemax
    from .sqrtsoftplus import sqrtsoftplus

    register(MapInfo("softmax", softmax, "dense; max <p, z> + Shannon entropy over the simplex"))
    register(
        MapInfo("sigmoid", sigmoid, "elementwise 1 / (1 + e^-z), each in (0, 1)", simplex=False)
    )
    register(MapInfo("relu", relu, "elementwise max(z, 0), sparse and unnormalised", simplex=False))
    register(
        MapInfo(
            "sqrtsoftplus",
            sqrtsoftplus,
            "elementwise sqrt(log(1 + e^z)) (DeepSeek-V4), each in [0, inf)",
            simplex=False,
        )
    )
    register(
        MapInfo(
            "sparsemax",
            sparsemax,
            "sparse; Euclidean projection onto the simplex",
            threshold_law=lambda: 1.0,
            cpu_kernels=True,
        )
    )
    register(
        MapInfo(
            "entmax",
            entmax,
            "sparse; max <p, z> + Tsallis entropy H_alpha over the simplex",
            {"alpha": alpha_param(1.5)},
            threshold_law=lambda alpha: 1.0 / (alpha - 1.0),
            cpu_kernels=True,
        )
    )
    register(
        MapInfo(
            "normmax",
            normmax,
            "sparse; max <p, z> - ||p||_alpha over the simplex",
            {"alpha": alpha_param(2.0)},
            threshold_law=lambda alpha: 1.0,
            cpu_kernels=True,
        )
    )
    register(
        MapInfo(
            "lapsum",
            lapsum,
            "soft top-k; each value in [0, 1], summing to k",
            {
                "k": Param(REQUIRED, _check_k, "the soft top-k budget: the sum of the weights"),
                "temperature": Param(1.0, _check_temperature, "Laplace scale; small: hard top-k"),
            },
            simplex=False,
            cpu_kernels=True,
        )
    )


__all__ = ["REQUIRED", "MapInfo", "Param", "info", "register", "registry"]
