"""A moelab router chosen in torchtitan's own config system.

Two ways in, both acting on the model config before anything is built (so the trainer's
meta-device build, ``verify_module_protocol``, parallelisation and ``init_states`` see
the moelab router from the start):

- :class:`MoelabRouterConverter`, a ``ModelConfigConverter``: in a config_registry
  function, ``model_registry("debugmodel", converters=[MoelabRouterConverter.Config(
  router_keys={"map": "entmax", "alpha": 1.5})])``. It replaces every MoE's
  ``TokenChoiceTopKRouter.Config`` (optionally only the MoEs whose FQN matches
  ``fqns``) with a :class:`~moelab.integrations.torchtitan.router.MoelabRouter.Config`;
  when the router fills more slots per token than the engine's ``top_k`` it raises the
  engine's ``top_k`` (router and token dispatcher) to match.
- :func:`moelab_router`, an ``@override`` factory for the command line:
  ``--override.imports 'moelab.integrations.torchtitan.converter.moelab_router={"map":
  "entmax", "alpha": 1.5}'`` (the JSON object holds the router keys). An override sees
  the router's config only: it keeps the engine's ``top_k`` (a router with more slots
  is refused) and assumes the MoE has ``load_balance_coeff`` (moelab's ``bias_rate`` is
  refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from fnmatch import fnmatch
from typing import Any

import torch
from torchtitan.config import override
from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from moelab.integrations.torchtitan.router import MoelabRouter, check_keys, engine_keys, merge_keys
from moelab.routing.config import RouterConfig

__all__ = ["MoelabRouterConverter", "moelab_config", "moelab_router"]


def moelab_config(
    cfg: TokenChoiceTopKRouter.Config, router_keys: dict[str, Any], load_balance: bool = True
) -> MoelabRouter.Config:
    """The :class:`MoelabRouter` config in place of the engine router's ``cfg``: the
    same fields plus ``router_keys`` (checked here: an unknown key fails now, not at
    build)."""
    check_keys(router_keys)
    if "k_total" in router_keys:
        raise ValueError(
            "k_total (learned allocation across layers) needs the built model: use "
            "swap_routers(model, k_total=...) after building it"
        )
    shared = {f.name: getattr(cfg, f.name) for f in fields(TokenChoiceTopKRouter.Config)}
    new = MoelabRouter.Config(**shared, router_keys=dict(router_keys), load_balance=load_balance)
    with torch.device("cpu"):  # a key the config refuses fails now, in one line
        RouterConfig(**_keys(new))
    return new


def _keys(cfg: MoelabRouter.Config) -> dict[str, Any]:
    keys = merge_keys(engine_keys(cfg), cfg.router_keys)
    keys.pop("k_total", None)
    return keys


class MoelabRouterConverter(ModelConfigConverter):
    """Replaces the ``TokenChoiceTopKRouter.Config`` of every MoE of a model config
    (those whose FQN matches one of ``fqns``, when given) with a moelab router's."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        router_keys: dict[str, Any] = field(default_factory=dict)
        """RouterConfig keys over the engine's own (none: the engine's routing)."""
        fqns: list[str] | None = None
        """fnmatch globs of the MoE FQNs to convert (``"layers.*.moe"``); None: all."""

    def __init__(self, config: Config) -> None:
        check_keys(config.router_keys)
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """The model config with the moelab routers in place (changed in place too).

        Raises:
            ValueError: no MoE with a TokenChoiceTopKRouter matches, or the keys are
                refused (one line).
        """
        converted = 0
        for fqn, moe, _, _ in model_config.traverse(MoE.Config):
            assert isinstance(moe, MoE.Config)
            globs = self.config.fqns
            if globs is not None and not any(fnmatch(fqn, g) for g in globs):
                continue
            if type(moe.router) is not TokenChoiceTopKRouter.Config:
                continue
            new = moelab_config(
                moe.router, self.config.router_keys, moe.load_balance_coeff is not None
            )
            with torch.device("cpu"):
                slots = RouterConfig(**_keys(new)).slots
            if slots > new.top_k:  # the engine dispatches as many slots as the router fills
                new.top_k = slots
                dispatcher = moe.routed_experts.token_dispatcher
                if hasattr(dispatcher, "top_k"):
                    dispatcher.top_k = slots
            moe.router = new
            converted += 1
        if not converted:
            raise ValueError(
                "no MoE with a TokenChoiceTopKRouter in this model config"
                + (f" matches fqns={self.config.fqns}" if self.config.fqns else "")
                + ": MoelabRouterConverter has nothing to convert"
            )
        return model_config


@override(
    target=TokenChoiceTopKRouter.Config,
    exact=True,
    description="moelab router (map, selection, balancing ...) in place of top-k",
)
def moelab_router(cfg: TokenChoiceTopKRouter.Config, **router_keys: Any) -> MoelabRouter.Config:
    """``--override.imports 'moelab.integrations.torchtitan.converter.moelab_router=
    {"map": "entmax", "alpha": 1.5}'``: each engine router config becomes a moelab
    router's with these keys."""
    return moelab_config(cfg, router_keys)
