"""moelab routers inside OLMo-core (extra ``olmo``): :func:`swap_routers` puts a moelab
Router in place of every ``MoERouter`` of a built OLMo-core model or MoE block,
:class:`MoelabRouterConfig` (or :func:`use_moelab_routers` on a whole
``TransformerConfig``) picks it in a training config. See
:mod:`moelab.integrations.olmo_core.router`.

Importing this package checks the installed ``ai2-olmo-core`` against the pinned release
(:func:`~moelab.integrations.olmo_core.version.check_version`)."""

from moelab.integrations.olmo_core.version import PINNED, check_version

check_version()

from moelab.integrations.olmo_core.router import (  # noqa: E402
    EngineGate,
    MoelabRouter,
    MoelabRouterConfig,
    UniformAssignment,
    engine_weight,
    equivalent_keys,
    moelab_router,
    moelab_router_config,
    moelab_routers,
    swap_routers,
    use_moelab_routers,
)

__all__ = [
    "PINNED",
    "EngineGate",
    "MoelabRouter",
    "MoelabRouterConfig",
    "UniformAssignment",
    "check_version",
    "engine_weight",
    "equivalent_keys",
    "moelab_router",
    "moelab_router_config",
    "moelab_routers",
    "swap_routers",
    "use_moelab_routers",
]
