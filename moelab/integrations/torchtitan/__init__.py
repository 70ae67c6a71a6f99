"""moelab's routers inside torchtitan (extra ``torchtitan``; torchtitan 0.3.0).

- :func:`swap_routers` puts a moelab Router in place of every ``TokenChoiceTopKRouter``
  of a built model (:mod:`.router`: no keys reproduce the engine's routing);
- :class:`MoelabRouterConverter` and the ``--override.imports`` factory
  :func:`moelab_router` select it in a torchtitan config (:mod:`.converter`);
- :func:`aux_loss`, :func:`with_aux_loss` and :func:`step_routers` bring moelab's
  auxiliary losses and per-step state into torchtitan's training (:mod:`.losses`);
- :mod:`.config_registry`: training configs for torchtitan's launcher
  (``--module moelab.integrations.torchtitan --config deepseek_v3_debugmodel_entmax``)
  under ``MoelabTrainer``, which adds both to the engine's Trainer.

Importing this package imports torchtitan and checks its version
(:func:`.version.check_version`); ``import moelab`` never does.
"""

from moelab.integrations.torchtitan.version import PINNED, check_version

check_version()

from moelab.integrations.torchtitan.calibration import calibrate_routers  # noqa: E402
from moelab.integrations.torchtitan.checkpoint import with_moelab_state  # noqa: E402
from moelab.integrations.torchtitan.converter import (  # noqa: E402 - after the version check
    MoelabRouterConverter,
    moelab_router,
)
from moelab.integrations.torchtitan.losses import (  # noqa: E402
    aux_loss,
    register_router_steps,
    step_routers,
    with_aux_loss,
    with_router_steps,
)
from moelab.integrations.torchtitan.router import (  # noqa: E402
    MoelabRouter,
    TitanAllocator,
    moelab_routers,
    swap_routers,
)

__all__ = [
    "PINNED",
    "MoelabRouter",
    "MoelabRouterConverter",
    "TitanAllocator",
    "aux_loss",
    "calibrate_routers",
    "check_version",
    "moelab_router",
    "moelab_routers",
    "register_router_steps",
    "step_routers",
    "swap_routers",
    "with_aux_loss",
    "with_moelab_state",
    "with_router_steps",
]
