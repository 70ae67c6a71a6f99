"""The papers' experiment grids, one command each (``moelab study NAME``).

Each study trains its arms with one or more seeds, measures them as its paper does and
writes ``report.md``, PNG figures, ``tables.tex`` and ``results.json`` (see
:mod:`moelab.studies.core`). Studies:

- ``sparse-maps``: *How Sparse Probability Maps Shape MoE Routing* (also ``moelab demo``);
- ``temperature``: temperature-controlled gating with a Lipschitz schedule;
- ``softmoe``: SoftMoE, soft top-k routing with LapSum;
- ``gate-norm``: the gate-normalisation essay's variants.

Each study is a sub-package (``moelab.studies.sparse_maps``, ...) with the same parts
under the same names: ``grid`` (its arms and their settings at each scale), ``run``
(what it measures on each trained run), ``findings`` (the paper's claims it tests and
the checks that what they rest on happened), ``figures`` and ``analysis`` (the report's
sections); its ``__init__`` holds the :class:`Study` that wires them, the one entry of
:data:`STUDIES`. What every study shares lies beside them: :mod:`~moelab.studies.core`
(arms, the study base class, the report files), :mod:`~moelab.studies.driver`
(:func:`run_study`), :mod:`~moelab.studies.tables`, :mod:`~moelab.studies.paired`,
:mod:`~moelab.studies.auto` (``--seeds auto``) and
:mod:`~moelab.studies.settings`; :mod:`~moelab.studies.tour` is the tour of the maps of
``moelab demo --maps``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moelab._lazy import lazy_names

if TYPE_CHECKING:
    from moelab.studies.auto import run_study_auto
    from moelab.studies.core import (
        SCALES,
        Arm,
        Context,
        Section,
        Study,
        StudyTable,
        cell_text,
        summarize,
        train_command,
    )
    from moelab.studies.driver import run_study

# NOTE: the package loads its parts (and matplotlib with them) on first use, so that the
# command line can list STUDIES without them (PEP 562).
_LAZY = {
    **dict.fromkeys(
        (
            "SCALES",
            "Arm",
            "Context",
            "Section",
            "Study",
            "StudyTable",
            "cell_text",
            "summarize",
            "train_command",
        ),
        "moelab.studies.core",
    ),
    "run_study": "moelab.studies.driver",
    "run_study_auto": "moelab.studies.auto",
}


__all__ = [
    "SCALES",
    "STUDIES",
    "Arm",
    "Context",
    "Section",
    "Study",
    "StudyTable",
    "cell_text",
    "get_study",
    "run_study",
    "run_study_auto",
    "summarize",
    "train_command",
]

STUDIES: dict[str, tuple[str, str]] = {
    "sparse-maps": ("moelab.studies.sparse_maps", "SparseMapsStudy"),
    "temperature": ("moelab.studies.temperature", "TemperatureStudy"),
    "softmoe": ("moelab.studies.softmoe", "SoftMoEStudy"),
    "gate-norm": ("moelab.studies.gate_norm", "GateNormStudy"),
}
"""Study name -> (module, class); modules load when the study is asked for."""


def get_study(name: str) -> Study:
    """The study registered as ``name`` (a ValueError naming the studies otherwise)."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose one of {', '.join(STUDIES)}")
    module, cls = STUDIES[name]
    return getattr(importlib.import_module(module), cls)()


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
