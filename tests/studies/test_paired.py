"""moelab.studies.paired against independent references: Student's t from a printed
table (and scipy where installed), paired differences and verdicts by hand."""

from __future__ import annotations

import math

import pytest

from moelab.studies.paired import (
    Finding,
    findings_section,
    interval,
    paired_difference,
    paired_tables,
    t_cdf,
    t_quantile,
)

# two-sided 95% critical values t_{0.975, df}, as printed in statistics tables
T_TABLE = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    15: 2.131,
    20: 2.086,
    30: 2.042,
    60: 2.000,
    120: 1.980,
}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T_TABLE[df], abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-T_TABLE[df], abs=6e-4)
    assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-10)


def test_t_cdf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 8, 13, 40, 101):
        for x in (-7.0, -2.0, -0.3, 0.0, 0.5, 1.96, 3.3, 25.0):
            assert t_cdf(x, df) == pytest.approx(stats.t.cdf(x, df), abs=1e-11)
        for p in (0.5, 0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-9)


def test_t_cdf_closed_forms():
    # df 1 is Cauchy, df 2 has F(x) = 1/2 + x / (2 sqrt(2 + x^2))
    for x in (-3.0, -0.5, 0.0, 1.0, 4.0):
        assert t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-15)
        assert t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-15)
    with pytest.raises(ValueError, match="df must be"):
        t_cdf(0.0, 0)


def test_paired_difference_by_hand():
    a, b = [1.0, 1.2, 1.1], [0.9, 1.0, 1.05]
    d = paired_difference(a, b)
    diffs = [0.1, 0.2, 0.05]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    half = 4.302652730 * sd / math.sqrt(3)
    assert d.values == pytest.approx(diffs)
    assert d.mean == pytest.approx(mean) and d.sd == pytest.approx(sd)
    assert d.half_width == pytest.approx(half)
    assert (d.low, d.high) == pytest.approx((mean - half, mean + half))
    assert d.verdict == "not resolved"  # the interval [-0.073, 0.306] holds 0
    # seeds needed: the fewest m with t_{0.975, m-1} sd / sqrt(m) < |mean|
    need = next(m for m in range(2, 100) if t_quantile(0.975, m - 1) * sd / math.sqrt(m) < mean)
    assert d.seeds_needed == need == 5
    tight = paired_difference([1.1, 1.2, 1.3], [1.0, 1.1, 1.21])
    assert tight.verdict == "resolved" and tight.low > 0


def test_one_seed_resolves_nothing_and_bad_values_are_not_measured():
    one = paired_difference([2.0], [1.0])
    assert one.mean == 1.0 and math.isnan(one.sd) and math.isnan(one.half_width)
    assert not one.resolved and one.verdict == "not resolved (1 seed)"
    assert one.seeds_needed is None and one.text(".2f") == "1.00"
    assert paired_difference([1.0, None], [0.0, 0.0]).verdict == "not measured"
    assert interval([1.0, math.nan]).verdict == "not measured"
    same = paired_difference([2.0, 3.0], [2.0, 3.0])
    assert same.verdict == "identical" and not same.resolved and same.seeds_needed is None
    exact = paired_difference([1.0, 2.0], [0.5, 1.5])  # sd 0
    assert exact.resolved and exact.seeds_needed == 2
    with pytest.raises(ValueError, match="one per seed"):
        paired_difference([1.0, 2.0], [1.0])


def test_finding_verdicts():
    up = interval([0.3, 0.35, 0.32])
    down = interval([-0.3, -0.35, -0.32])
    wide = interval([-0.3, 0.4, 0.1])
    assert Finding("a", "c", "m", up).verdict == "holds"
    assert Finding("a", "c", "m", down).verdict == "contradicted"
    assert Finding("a", "c", "m", wide).verdict == "not resolved"
    assert Finding("a", "c", "m", down, expect="negative").verdict == "holds"
    assert Finding("a", "c", "m", interval([0.3])).verdict == "not resolved (1 seed)"
    small = interval([1e-9, -2e-9, 0.0])
    assert Finding("a", "c", "m", small, expect="zero", tolerance=1e-6).verdict == "holds"
    assert Finding("a", "c", "m", up, expect="zero", tolerance=1e-6).verdict == "contradicted"
    # an exact identity is checked seed by seed, one seed included
    one = interval([0.0])
    assert Finding("a", "c", "m", one, expect="zero", exact=True).verdict == "holds"
    mixed = interval([0.0, 0.5])
    assert Finding("a", "c", "m", mixed, expect="zero", exact=True).verdict == "not resolved"
    # an identity about events that never happened is not resolved, not "holds"
    vacuous = Finding("a", "c", "m", interval([0.0, 0.0]), expect="zero", exact=True)
    assert vacuous.verdict == "holds"
    vacuous.testable = False
    assert vacuous.verdict == "not resolved" and vacuous.to_json()["testable"] is False
    with pytest.raises(ValueError, match="expect must be"):
        Finding("a", "c", "m", up, expect="bigger")


def test_findings_section_and_paired_tables():
    from moelab.studies import StudyTable

    f = Finding("k", "later layers take more", "k_last − k_first", interval([0.2, 0.3]))
    section = findings_section([f], ["warning: nothing moved"])
    (table,) = section.tables
    assert section.title == "Findings" and table.key == "findings"
    (row,) = table.rows
    assert row["verdict"] == f.verdict and row["n"] == 2
    assert "warning: nothing moved" in section.text
    t = StudyTable(
        "main",
        "Loss",
        [("arm", "arm", "s"), ("loss", "loss", ".3f"), ("fixed", "fixed", ".1f")],
        [
            {"arm": "ref", "loss": [1.0, 2.0], "fixed": 1.0},
            {"arm": "other", "loss": [1.5, 2.7], "fixed": 2.0},
        ],
    )
    (p,) = paired_tables([t], "ref", 2)
    (r,) = p.rows  # the per-seed column only; the reference row is not compared with itself
    assert r["row"] == "other" and r["column"] == "loss"
    assert r["paired"]["values"] == pytest.approx([0.5, 0.7])
    assert paired_tables([t], "absent", 2) == []
    # a text cell holding "|" does not break the Markdown table
    assert "E[a \\| b]" in StudyTable("x", "x", [("c", "c", "s")], [{"c": "E[a | b]"}]).markdown()
