"""Run labels of the report: folder names, made unique; a study's seed folders carry
their arm's name."""

from __future__ import annotations

from pathlib import Path

from moelab.report.report import _labels


def test_labels_name_study_seed_folders_by_their_arm():
    runs = [
        Path("demo/runs/softmax/seed0"),
        Path("demo/runs/sparsemax/seed0"),
        Path("runs/a b"),
        Path("runs/x/seed0"),
        Path("other/x/seed0"),
        Path("runs/seedling"),
    ]
    assert _labels(runs) == [
        "softmax_seed0",
        "sparsemax_seed0",
        "a_b",
        "x_seed0",
        "x_seed0-2",
        "seedling",
    ]
