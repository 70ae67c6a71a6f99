"""The one definition of each shared routing number: expert counts (on the device, no
host sync), load CV, top-2 gaps and the certified radius from a margin, against loops,
numpy and hand values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from moelab.routing.certification import margin_radius
from moelab.routing.measures import expert_counts, load_cv, top2_gap


def test_expert_counts_matches_loop_and_ignores_unused_slots() -> None:
    g = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(0, 5, (40, 3), generator=g)
    mask_TK = torch.rand(40, 3, generator=g) < 0.6
    ids_TK = torch.where(mask_TK, ids_TK, -7)  # unused slots may hold anything
    expected = [0] * 5
    for t in range(40):
        for k in range(3):
            if mask_TK[t, k]:
                expected[int(ids_TK[t, k])] += 1
    counts_E = expert_counts(ids_TK, mask_TK, 5, torch.int64)
    assert counts_E.dtype == torch.int64 and counts_E.tolist() == expected
    assert expert_counts(ids_TK, mask_TK, 5).dtype == torch.float32


def test_expert_counts_reads_nothing_on_the_host() -> None:
    """Under FakeTensorMode tensors hold no values: any op that needs them on the host
    (a sync on a GPU: boolean indexing, bincount, .item(), .tolist()) raises there."""
    with FakeTensorMode():
        ids_TK = torch.zeros(6, 2, dtype=torch.int64)
        mask_TK = torch.ones(6, 2, dtype=torch.bool)
        assert expert_counts(ids_TK, mask_TK, 4).shape == (4,)
        with pytest.raises(DynamicOutputShapeException):  # what the check catches
            torch.bincount(ids_TK[mask_TK], minlength=4)


def test_load_cv_matches_numpy() -> None:
    load = np.array([3, 0, 5, 1, 1])
    assert float(load_cv(torch.tensor(load))) == pytest.approx(load.std() / load.mean())
    shares = torch.tensor(load / load.sum(), dtype=torch.float32)
    assert float(load_cv(shares)) == pytest.approx(load.std() / load.mean(), rel=1e-6)
    assert math.isnan(float(load_cv(torch.zeros(4))))  # no load: undefined
    assert float(load_cv(torch.full((3,), 2.0))) == 0.0


def test_top2_gap_by_hand() -> None:
    inf = float("inf")
    values_TE = torch.tensor(
        [[0.5, 2.0, -1.0], [1.0, 1.0, 0.0], [3.0, -inf, -inf], [-inf, -inf, -inf]]
    )
    gap_T = top2_gap(values_TE)
    assert gap_T[:3].tolist() == [1.5, 0.0, inf]
    assert math.isnan(gap_T[3])  # every expert masked
    with pytest.raises(ValueError, match="2 experts"):
        top2_gap(torch.ones(3, 1))


def test_margin_radius_by_hand() -> None:
    m_T = torch.tensor([0.5, 0.0, 0.25], dtype=torch.float64)
    # r = sqrt(2) * tau * m / ||W||_2 with tau = 2, ||W||_2 = 4
    expected = [math.sqrt(2) * 2 * 0.5 / 4, 0.0, math.sqrt(2) * 2 * 0.25 / 4]
    assert margin_radius(m_T, 2.0, 4.0).tolist() == pytest.approx(expected)
    assert margin_radius(m_T, torch.tensor(2.0), torch.tensor(4.0)).tolist() == pytest.approx(
        expected
    )
    assert margin_radius(m_T, 2.0, 0.0).tolist() == [0.0, 0.0, 0.0]  # constant gate
