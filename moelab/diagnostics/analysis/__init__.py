"""Routing analyses across checkpoints, texts and numerical settings (``moelab analyze``).

    from moelab.diagnostics.analysis import RunSource, coactivation, fragility
    from moelab.diagnostics import load_run
    src = RunSource(loaded=load_run("runs/run"))
    coactivation(src)                          # E x E P(j | i) per MoE layer, lifts
    fragility(src, "perturb", eps=[0.01])      # flips by gap, threshold, certified radius

- :mod:`.saturation`: each checkpoint's routing against the last's;
- :mod:`.coactivation`: which experts a token uses together;
- :mod:`.specialization`: per token id and per corpus;
- :mod:`.fragility`: what changes under bf16, the kernels or a perturbed input;
- :mod:`.agreement`: two routing records of one text (an engine's and moelab's, two
  dtypes): which decisions differ, where, and at which margins.
- :mod:`.invariance`: what changes with the batch, padding, chunking, recomputation.

Each but agreement (which reads two :class:`~moelab.diagnostics.replay.RoutingRecord`)
works on a :class:`~.source.RoutingSource`: a moelab run (:class:`RunSource`) or a Hugging
Face model (:class:`moelab.integrations.hf.analysis.HFSource`). Files, figures and the
report's section: :mod:`moelab.report.analysis`. docs/analysis.md shows each.
"""

from __future__ import annotations

from moelab.diagnostics.analysis.agreement import agreement
from moelab.diagnostics.analysis.coactivation import CoactivationCounts, coactivation
from moelab.diagnostics.analysis.fragility import SETTINGS, FragilityCounts, fragility
from moelab.diagnostics.analysis.invariance import InvarianceCounts, batch_mechanisms, invariance
from moelab.diagnostics.analysis.saturation import SaturationCounts, saturation
from moelab.diagnostics.analysis.source import (
    Capture,
    RoutingSource,
    RunSource,
    capture,
    route,
    run_sources,
    top1,
    used_mask,
)
from moelab.diagnostics.analysis.specialization import VocabularyCounts, specialization

__all__ = [
    "SETTINGS",
    "Capture",
    "CoactivationCounts",
    "FragilityCounts",
    "InvarianceCounts",
    "RoutingSource",
    "RunSource",
    "SaturationCounts",
    "VocabularyCounts",
    "agreement",
    "batch_mechanisms",
    "capture",
    "coactivation",
    "fragility",
    "invariance",
    "route",
    "run_sources",
    "saturation",
    "specialization",
    "top1",
    "used_mask",
]
