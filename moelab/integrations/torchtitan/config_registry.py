"""torchtitan training configs with moelab routers, for torchtitan's own launcher:
``--module moelab.integrations.torchtitan --config NAME`` (its ConfigManager imports
this module as the package's ``config_registry``).

Every config here trains with :class:`MoelabTrainer`: torchtitan's Trainer whose loss
adds the moelab routers' aux loss (:func:`~.losses.with_aux_loss`) and whose optimizer
steps the routers' per-step state (:func:`~.losses.register_router_steps`). Under
pipeline parallelism the loss runs inside the pipeline schedule, which the engine
builds before the wrap: there the aux losses do not reach the loss, so the trainer
refuses routers with an aux loss on (:func:`check_pipeline`); with none on, as with the
engine's loss-free bias balancing, nothing is lost.

- ``deepseek_v3_debugmodel`` / ``qwen3_moe_debug``: the engine's debug models, its own
  routers; choose a moelab router with ``--override.imports
  'moelab.integrations.torchtitan.converter.moelab_router={"map": "entmax", ...}'``;
- ``deepseek_v3_debugmodel_entmax``, ``deepseek_v3_16b_entmax``,
  ``qwen3_moe_debug_entmax``, ``qwen3_30b_a3b_entmax``: 1.5-entmax routing through
  :class:`~.converter.MoelabRouterConverter` (the engine's top-k, renorm, scaling,
  groups and expert-bias balancing otherwise kept).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_models
from torchtitan.models.qwen3 import config_registry as qwen3
from torchtitan.models.qwen3 import model_registry as qwen3_models
from torchtitan.trainer import Trainer

from moelab.integrations.torchtitan.checkpoint import with_moelab_state
from moelab.integrations.torchtitan.converter import MoelabRouterConverter
from moelab.integrations.torchtitan.losses import register_router_steps, with_aux_loss
from moelab.integrations.torchtitan.router import moelab_routers

__all__ = [
    "ENTMAX",
    "MoelabTrainer",
    "check_pipeline",
    "deepseek_v3_16b_entmax",
    "deepseek_v3_debugmodel",
    "deepseek_v3_debugmodel_entmax",
    "moelab_trainer",
    "qwen3_30b_a3b_entmax",
    "qwen3_moe_debug",
    "qwen3_moe_debug_entmax",
]

ENTMAX: dict[str, Any] = {"map": "entmax", "alpha": 1.5}
"""The router keys of the ``*_entmax`` configs."""


class MoelabTrainer(Trainer):
    """torchtitan's Trainer with the moelab routers' aux loss in its loss and their
    per-step state moved after each optimizer step (a model without moelab routers
    trains as with the engine's Trainer)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        check_pipeline(self.model_parts, self.parallel_dims.pp_enabled)
        if any(moelab_routers(m) for m in self.model_parts):
            self.loss_fn = with_aux_loss(self.loss_fn, self.model_parts)  # type: ignore[assignment]
            register_router_steps(self.optimizers, self.model_parts)


def check_pipeline(model_parts: list[Any], pp_enabled: bool) -> None:
    """ValueError, in one line, when pipeline parallelism would drop the moelab routers'
    aux losses: its schedule holds the loss function from before the trainer could wrap
    it, so a router with an auxiliary loss on would train without it, silently."""
    if not pp_enabled:
        return
    on = sorted(
        {
            loss.name
            for m in model_parts
            for _, r in moelab_routers(m)
            for loss in r.router.aux_losses
        }
    )
    if on:
        raise ValueError(
            f"the moelab routers' auxiliary losses ({', '.join(on)}) do not reach the loss "
            "under pipeline parallelism: set their weights to 0 (aux_weight=0, ...) or "
            "train without pipeline parallelism"
        )


def moelab_trainer(config: Trainer.Config, **changes: Any) -> MoelabTrainer.Config:
    """``config`` (an engine config_registry function's) as a :class:`MoelabTrainer`
    config, with ``changes`` (e.g. ``model_spec=``) applied; the model spec's HF adapter
    leaves the moelab keys out (:func:`~.checkpoint.with_moelab_state`)."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    values.update(changes)
    spec = values.get("model_spec")
    if spec is not None and spec.state_dict_adapter is not None:
        # the HF export (checkpoint.last_save_in_hf) leaves the moelab keys out
        spec.state_dict_adapter = with_moelab_state(spec.state_dict_adapter)
    return MoelabTrainer.Config(**values)


def _entmax(registry: Any, flavor: str, **kwargs: Any) -> Any:
    return registry(flavor, converters=[MoelabRouterConverter.Config(router_keys=ENTMAX)], **kwargs)


def deepseek_v3_debugmodel() -> MoelabTrainer.Config:
    """torchtitan's ``deepseek_v3_debugmodel`` under :class:`MoelabTrainer`."""
    return moelab_trainer(deepseek_v3.deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_entmax() -> MoelabTrainer.Config:
    """torchtitan's ``deepseek_v3_debugmodel`` with 1.5-entmax routers."""
    spec = _entmax(deepseek_v3_models, "debugmodel")
    return moelab_trainer(deepseek_v3.deepseek_v3_debugmodel(), model_spec=spec)


def deepseek_v3_16b_entmax() -> MoelabTrainer.Config:
    """torchtitan's ``deepseek_v3_16b`` (DeepSeek-MoE 16B layout, 64 experts, top-6,
    EP 8, PP) with 1.5-entmax routers."""
    spec = _entmax(deepseek_v3_models, "16B", attn_backend="flex")
    return moelab_trainer(deepseek_v3.deepseek_v3_16b(), model_spec=spec)


def qwen3_moe_debug() -> MoelabTrainer.Config:
    """torchtitan's ``qwen3_moe_debug`` under :class:`MoelabTrainer`."""
    return moelab_trainer(qwen3.qwen3_moe_debug())


def qwen3_moe_debug_entmax() -> MoelabTrainer.Config:
    """torchtitan's ``qwen3_moe_debug`` with 1.5-entmax routers."""
    spec = _entmax(qwen3_models, "debugmodel_moe")
    return moelab_trainer(qwen3.qwen3_moe_debug(), model_spec=spec)


def qwen3_30b_a3b_entmax() -> MoelabTrainer.Config:
    """torchtitan's ``qwen3_30b_a3b`` (Qwen3-30B-A3B, 128 experts, top-8) with
    1.5-entmax routers."""
    base = qwen3.qwen3_30b_a3b()
    spec = _entmax(qwen3_models, base.model_spec.flavor)
    return moelab_trainer(base, model_spec=spec)
