"""The ``sparse-maps`` study: *How Sparse Probability Maps Shape Mixture-of-Experts
Routing* (also ``moelab demo``).

Four top-2 routers that differ only in their probability map (softmax, 1.5-entmax,
sparsemax, 2-normmax), trained with the same data and seed, and, when asked (always at
the paper scale), dense references with a larger active budget (the paper's dense models
match the MoE models' total parameters). The analysis measures the newest checkpoint of
every run as the paper does:

- Table 1 layout: validation loss and perplexity, with downstream accuracy columns read
  from ``RUN/downstream.json`` where ``moelab downstream`` saved one
  (:func:`downstream_scores`);
- the routing statistics of Table 2, the gap fractions against each map's singleton
  threshold (Table 5), the score spread and gap percentiles (Table 7), and the same per
  MoE layer (Tables 6 and 8), on the validation split and, with ``--eval-data``, on a
  second, out-of-domain text;
- frozen-weight budgets (Tables 3 and 9): the trained weights run with K in {1, 2, 4, 8};
- discarded mass and contributors over training tokens on a log axis (Figures 2 and 4),
  from the training batches logged in ``metrics.jsonl``; the loss curves, the budget
  sweep and the top-2 gap histograms (Figure 3) of the first seed.

Scales: ``quick`` (a shrunken tiny model, seconds per arm), ``cpu`` (the tiny preset on
the default corpus, 400 steps of 8 x 128 tokens: the demo) and ``paper`` (the 300M and
1B models of the paper's Table 4 and their dense references; the training settings the
paper does not state are moelab's choice, see :func:`.grid.paper_sources`).

The parts, as every study has them: ``grid`` (the arms and their settings at each scale),
``run`` (what is measured on each trained run), ``findings`` (the paper's claims and the
checks), ``figures`` and ``analysis`` (the report's sections).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moelab.studies.core import Arm, Context, Section, Study
from moelab.studies.sparse_maps import analysis, grid
from moelab.studies.sparse_maps.analysis import headline_rows
from moelab.studies.sparse_maps.figures import training_curves
from moelab.studies.sparse_maps.findings import CLAIMS, REFERENCE, checks, findings
from moelab.studies.sparse_maps.grid import DENSE_D_FF, MAPS, SIZES
from moelab.studies.sparse_maps.run import (
    DOWNSTREAM_FILE,
    MAX_BATCHES,
    TOP_KS,
    downstream_record,
    downstream_scores,
)

__all__ = [
    "CLAIMS",
    "DENSE_D_FF",
    "DOWNSTREAM_FILE",
    "MAPS",
    "MAX_BATCHES",
    "SIZES",
    "TOP_KS",
    "SparseMapsStudy",
    "checks",
    "downstream_record",
    "downstream_scores",
    "findings",
    "headline_rows",
    "training_curves",
]


class SparseMapsStudy(Study):
    """Softmax, 1.5-entmax, sparsemax and 2-normmax top-2 routers (and dense references
    with ``options["dense"]``, always at the paper scale), measured as the sparse-maps
    paper measures them."""

    name = "sparse-maps"
    reference = REFERENCE
    claims = CLAIMS
    title = "How sparse probability maps shape MoE routing"
    paper = "How Sparse Probability Maps Shape Mixture-of-Experts Routing"

    def common(self, scale: str) -> dict[str, Any]:
        return grid.common(scale)

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        return grid.arms(scale, options)

    def paper_sources(self) -> dict[str, str]:
        return grid.paper_sources()

    def analyse(self, ctx: Context) -> list[Section]:
        return analysis.analyse(ctx)
