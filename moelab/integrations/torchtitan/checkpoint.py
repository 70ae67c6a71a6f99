"""The engine's Hugging Face state-dict adapters with moelab routers in the model.

A swapped model's state dict keeps the engine's router key ``moe.router.gate.weight``
and adds the moelab Router's own state under ``moe.router.router.`` (selection bias,
temperature, the calibrated cut in ``_extra_state``, null experts' rows) and the
allocator's ``moelab_allocator.eta``. torchtitan's distributed checkpoint saves and
loads them as any other key; its Hugging Face adapters map a fixed key table and raise
``KeyError`` on them. :func:`with_moelab_state` wraps an adapter class so that
``to_hf`` leaves the moelab keys out (the HF folder holds the model with its gate
weights, as the engine's router would read them) and ``from_hf`` gives a state dict
without them (load it with ``strict=False``: the moelab keys keep their values).
"""

from __future__ import annotations

import functools
from typing import Any

from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

__all__ = ["is_moelab_key", "with_moelab_state"]


def is_moelab_key(key: str) -> bool:
    """``key`` holds moelab router state (not the engine's)."""
    return ".router.router." in key or key.startswith("moelab_allocator.")


@functools.cache
def with_moelab_state(adapter: type[BaseStateDictAdapter]) -> type[BaseStateDictAdapter]:
    """``adapter`` whose ``to_hf`` drops the moelab router keys (made once per class;
    an adapter made here is returned as it is)."""
    if getattr(adapter, "drops_moelab_keys", False):
        return adapter

    def to_hf(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in state_dict.items() if not is_moelab_key(k)}
        return adapter.to_hf(self, kept)

    name = f"Moelab{adapter.__name__}"
    body = {"to_hf": to_hf, "drops_moelab_keys": True, "__module__": __name__, "__qualname__": name}
    made = type(name, (adapter,), body)
    globals()[name] = made
    return made
