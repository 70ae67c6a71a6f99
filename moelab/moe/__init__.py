"""The MoE layer: SwiGLU experts, sort-based dispatch/combine, `MoEConfig` and `MoE`."""

from __future__ import annotations

from .dispatch import dispatch_combine
from .experts import SwiGLUExperts
from .layer import MoE, MoEConfig

__all__ = ["MoE", "MoEConfig", "SwiGLUExperts", "dispatch_combine"]
