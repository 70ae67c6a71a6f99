"""The MoE layer: SwiGLU experts, sort-based dispatch (permute -> experts -> unpermute),
`MoEConfig` and `MoE`."""

from __future__ import annotations

from .dispatch import Permuted, Plan, dispatch_combine, permute, unpermute
from .experts import SwiGLUExperts
from .layer import MoE, MoEConfig
from .null import ConstantExperts

__all__ = [
    "ConstantExperts",
    "MoE",
    "MoEConfig",
    "Permuted",
    "Plan",
    "SwiGLUExperts",
    "dispatch_combine",
    "permute",
    "unpermute",
]
