"""The temperature study: *Stable Token Routing in Sparse Mixture-of-Experts Models via
Temperature-Controlled Gating* (``moelab study temperature``).

Five arms with the same number of active parameters, as the paper's Table 1:

- ``dense``: no MoE layer;
- ``switch``: Switch-style top-1 softmax routing (tau = 1);
- ``fixed-0.5`` / ``fixed-2.0``: top-2 routing with the gate ``g(x) = softmax(W x / tau)``
  at a fixed temperature;
- ``lipschitz``: top-2 with the paper's schedule ``tau = max(tau_min, sigma^ / (2 L*))``
  (:mod:`moelab.routing.temperature`; L* = 4, tau_min = 0.25 at the paper scale, smaller
  L* at the quick and cpu scales, :data:`SCHEDULE`; at cpu below both fixed arms'
  measured L, :func:`cpu_schedule`).

Every MoE arm uses capacity factor 1.25 and the Switch balance loss with weight 0.01 (f_i
counting each token's top-1 expert, ``router.aux_count="top1"``, the paper's eq. 6), and
weighs the selected experts with the gate values themselves (the paper's eq. 2: no
renormalisation). The top-2 arms' experts are half as wide as Switch's, so that every arm
uses the same parameters per token (the paper compares models of 125M active parameters).

The report opens with the paper's claims as findings (:data:`CLAIMS`, :func:`findings`;
reference arm ``switch``) and checks that the schedule acted (:func:`checks`). The
analysis measures, per run: validation perplexity; the load CV over experts of the routed
slots, the share of slots the capacity limit drops and of tokens it drops whole
(:func:`moelab.diagnostics.stats`); load shares per expert; the certified top-1 radii
(``stats(..., radii=True)``); tau and ``||W||_2`` over training (``tau_layers`` and
``lipschitz_layers`` of metrics.jsonl); and a numerical check of the paper's theorem,
:func:`lipschitz_check`, on pairs of the token representations the routers see on
validation text.

The parts, as every study has them: ``grid`` (the arms and their settings at each scale),
``run`` (what is measured on each trained run, the theorem check included), ``findings``
(the paper's claims and the checks), ``figures`` and ``analysis`` (the report's sections).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import Arm, Context, Section, Study
from moelab.studies.temperature import analysis, grid
from moelab.studies.temperature.findings import (
    CLAIMS,
    HELD_CLAIM,
    REFERENCE,
    THEOREM_CLAIM,
    checks,
    findings,
    schedule_trace,
)
from moelab.studies.temperature.grid import (
    CAPACITY_FACTOR,
    LIPSCHITZ_TARGET,
    SCHEDULE,
    START_TAU,
    TAU_MIN,
    cpu_schedule,
)
from moelab.studies.temperature.run import (
    collect_router_inputs,
    gate,
    lipschitz_check,
    sample_pairs,
)

__all__ = [
    "CAPACITY_FACTOR",
    "CLAIMS",
    "LIPSCHITZ_TARGET",
    "REFERENCE",
    "SCHEDULE",
    "START_TAU",
    "TAU_MIN",
    "TemperatureStudy",
    "checks",
    "collect_router_inputs",
    "cpu_schedule",
    "findings",
    "gate",
    "lipschitz_check",
    "sample_pairs",
    "schedule_trace",
]


class TemperatureStudy(Study):
    """Dense, Switch top-1, fixed tau = 0.5 and 2.0, and the Lipschitz schedule (see the
    module docstring)."""

    name = "temperature"
    title = "Temperature-controlled gating and the Lipschitz schedule"
    paper = (
        "Stable Token Routing in Sparse Mixture-of-Experts Models via Temperature-Controlled Gating"
    )
    reference = REFERENCE
    claims = (THEOREM_CLAIM, HELD_CLAIM, *(c.key for c in CLAIMS))

    def common(self, scale: str) -> dict[str, Any]:
        return grid.common(scale)

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        return grid.arms(scale, options)

    def paper_sources(self) -> dict[str, str]:
        return grid.paper_sources()

    def analyse(self, ctx: Context) -> list[Section]:
        return analysis.analyse(ctx)
