"""Paired comparisons over seeds: a difference, its 95% t-interval and a verdict.

A study's runs are paired: every arm is trained with seeds 0 … n−1 on one corpus (one
tokenizer, one split), so seed ``s`` of two arms differs by the arm alone (and by the
initialisation, data order and sampling noise that the seed sets, which both share).
The difference of a measure between an arm and the study's reference arm is taken seed
by seed, ``d_s = a_s − b_s``, and summarised by

- its mean ``d̄`` and sample sd ``s_d`` (ddof = 1),
- the 95% t-interval ``d̄ ± t_{0.975, n−1} · s_d / √n`` (:func:`t_quantile`),
- a verdict: *resolved* where the interval excludes 0, else *not resolved* (always so
  with one seed, which has no interval); *identical* where every seed's difference is
  exactly 0 (a value the two arms share by construction),
- the smallest difference these seeds could resolve, the interval's half-width
  ``t_{0.975, n−1} · s_d / √n`` (a true difference below it is not told from 0), and
- the seeds the observed difference would need: the smallest ``m`` with
  ``t_{0.975, m−1} · s_d / √m < |d̄|``, taking the sd as measured.

:class:`Finding` states one claim of a paper as a measured effect with the sign the
claim predicts; its verdict is *holds* (the interval lies on the predicted side),
*contradicted* (it lies on the other side) or *not resolved at this scale*.
:func:`findings_section` makes the "Findings" section that opens a study's report, and
:func:`paired_tables` the paired differences of every table from the reference arm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moelab._format import fmt
from moelab._strict_json import json_safe
from moelab.studies.tables import Section, StudyTable

__all__ = [
    "Finding",
    "Paired",
    "findings_section",
    "interval",
    "paired_difference",
    "paired_tables",
    "t_cdf",
    "t_quantile",
]

LEVEL = 0.95
"""The confidence level of every interval a study reports."""

MAX_SEEDS = 100_000
"""Beyond this many seeds :attr:`Paired.seeds_needed` gives up (None)."""


# ------------------------------------------------------------------------ Student's t


def t_cdf(x: float, df: int) -> float:
    """P(T ≤ x) for Student's t with ``df`` (a whole number ≥ 1) degrees of freedom, in
    closed form: with θ = atan(x/√df), the finite series in cos θ of Abramowitz and
    Stegun 26.7.3 (odd df) and 26.7.4 (even df)."""
    if int(df) != df or df < 1:
        raise ValueError(f"df must be a whole number >= 1, got {df}")
    df = int(df)
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    theta = math.atan2(x, math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2 == 1:
        # A(t|ν) = (2/π)[θ + sinθ (cos θ + (2/3) cos³θ + … + (2·4…(ν−3))/(1·3…(ν−2)) cos^{ν−2}θ)]
        total, term = 0.0, c
        if df > 1:
            total = term
            for k in range(3, df - 1, 2):
                term *= c * c * (k - 1) / k
                total += term
        a = (2 / math.pi) * (theta + s * total) if df > 1 else (2 / math.pi) * theta
    else:
        # A(t|ν) = sinθ [1 + (1/2) cos²θ + (1·3)/(2·4) cos⁴θ + …
        #                 + (1·3…(ν−3))/(2·4…(ν−2)) cos^{ν−2}θ]
        total, term = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= c * c * (k - 1) / k
            total += term
        a = s * total
    # a = P(|T| ≤ |x|) signed with x: P(T ≤ x) = (1 + a) / 2
    return min(1.0, max(0.0, 0.5 * (1.0 + a)))


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_cdf` to about 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ------------------------------------------------------------------------- intervals


def _finite(values: Sequence[Any]) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(float(v)) for v in values)


@dataclass(frozen=True)
class Paired:
    """A mean over seeds with its t-interval: a paired difference (:func:`paired_difference`)
    or an effect measured once per seed (:func:`interval`). With one seed (or a
    non-finite value) the sd, interval and half-width are NaN and nothing is resolved."""

    values: tuple[float, ...]
    """One value per seed, in seed order (a difference: arm − reference)."""
    level: float = LEVEL

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def measured(self) -> bool:
        """Every seed gave a finite value."""
        return self.n > 0 and _finite(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n if self.measured else math.nan

    @property
    def sd(self) -> float:
        if not self.measured or self.n < 2:
            return math.nan
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1))

    @property
    def half_width(self) -> float:
        """``t_{(1+level)/2, n−1} · sd / √n``: the smallest difference these seeds
        resolve (NaN with one seed)."""
        if not self.measured or self.n < 2:
            return math.nan
        return t_quantile(0.5 + self.level / 2, self.n - 1) * self.sd / math.sqrt(self.n)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (never with one seed)."""
        return self.n >= 2 and self.measured and (self.low > 0 or self.high < 0)

    @property
    def verdict(self) -> str:
        if not self.measured:
            return "not measured"
        if all(v == 0 for v in self.values):
            return "identical"  # e.g. a column the two arms share by construction
        if self.n < 2:
            return "not resolved (1 seed)"
        return "resolved" if self.resolved else "not resolved"

    @property
    def seeds_needed(self) -> int | None:
        """The fewest seeds whose interval, at the measured sd, would exclude 0 at the
        measured mean (None: no sd yet, a mean of 0, or more than MAX_SEEDS)."""
        if not self.measured or self.n < 2 or self.mean == 0:
            return None
        if self.sd == 0:
            return 2
        target = abs(self.mean) / self.sd
        q = 0.5 + self.level / 2
        m = 2
        while m <= MAX_SEEDS:
            if t_quantile(q, m - 1) / math.sqrt(m) < target:
                return m
            m = m + 1 if m < 64 else int(m * 1.1)  # coarse beyond 64 seeds
        return None

    def text(self, spec: str = ".3f") -> str:
        """``mean [low, high]`` (the mean alone with one seed)."""
        if not self.measured:
            return "-"
        if self.n < 2:
            return fmt(self.mean, spec)
        return f"{fmt(self.mean, spec)} [{fmt(self.low, spec)}, {fmt(self.high, spec)}]"

    def to_json(self) -> dict[str, Any]:
        return json_safe(
            {
                "values": list(self.values),
                "n": self.n,
                "mean": self.mean,
                "sd": self.sd,
                "level": self.level,
                "low": self.low,
                "high": self.high,
                "half_width": self.half_width,
                "verdict": self.verdict,
                "seeds_needed": self.seeds_needed,
            }
        )


def interval(values: Sequence[float | None], level: float = LEVEL) -> Paired:
    """The mean of ``values`` (one per seed) with its t-interval."""
    return Paired(tuple(math.nan if v is None else float(v) for v in values), level)


def paired_difference(
    a: Sequence[float | None], b: Sequence[float | None], level: float = LEVEL
) -> Paired:
    """``a − b`` seed by seed (``a[s]`` and ``b[s]`` from seed ``s``), with its interval."""
    if len(a) != len(b):
        raise ValueError(f"paired values need one per seed on both sides: {len(a)} and {len(b)}")
    pairs = zip(a, b, strict=True)
    diffs = [math.nan if x is None or y is None else float(x) - float(y) for x, y in pairs]
    return interval(diffs, level)


# -------------------------------------------------------------------------- findings

EXPECTS = ("positive", "negative", "zero")


@dataclass
class Finding:
    """One claim of a paper, tested by the study's arms.

    ``effect`` is measured once per seed (usually a paired difference); ``expect`` is the
    sign the claim predicts: "positive", "negative", or "zero" (``|effect| ≤
    tolerance``). ``exact``: the claim is an identity every run must satisfy (no sampling
    in it), so each seed is checked on its own: *holds* when every seed satisfies it,
    *contradicted* when none does. Otherwise the verdict comes from the interval."""

    key: str
    """The claim's name, one of its study's ``claims``."""
    claim: str
    """The claim, in words."""
    measured: str
    """What ``effect`` is (e.g. "ΔNLL(K = 2 → 8) of softmax − of sparsemax")."""
    effect: Paired
    expect: str = "positive"
    tolerance: float = 0.0
    exact: bool = False
    spec: str = ".3f"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """More measured values for results.json (e.g. each arm's own mean)."""
    testable: bool = True
    """False where the runs give the claim nothing to act on (an identity about events
    that never happened): the verdict is then "not resolved", whatever the effect."""

    def __post_init__(self) -> None:
        if self.expect not in EXPECTS:
            raise ValueError(f"expect must be one of {EXPECTS}, got {self.expect!r}")

    def _ok(self, v: float) -> bool:
        if self.expect == "positive":
            return v > self.tolerance
        if self.expect == "negative":
            return v < -self.tolerance
        return abs(v) <= self.tolerance

    @property
    def verdict(self) -> str:
        e = self.effect
        if not e.measured:
            return "not measured"
        if not self.testable:
            return "not resolved"
        if self.exact:
            ok = [self._ok(v) for v in e.values]
            return "holds" if all(ok) else "contradicted" if not any(ok) else "not resolved"
        if e.n < 2:
            return "not resolved (1 seed)"
        lo, hi, tol = e.low, e.high, self.tolerance
        if self.expect == "positive":
            return "holds" if lo > tol else "contradicted" if hi < -tol else "not resolved"
        if self.expect == "negative":
            return "holds" if hi < -tol else "contradicted" if lo > tol else "not resolved"
        # zero: the whole interval within ±tolerance, or the whole of it outside
        if -tol <= lo and hi <= tol:
            return "holds"
        return "contradicted" if lo > tol or hi < -tol else "not resolved"

    def to_json(self) -> dict[str, Any]:
        return json_safe(
            {
                "key": self.key,
                "claim": self.claim,
                "measured": self.measured,
                "expect": self.expect,
                "tolerance": self.tolerance,
                "exact": self.exact,
                "testable": self.testable,
                "effect": self.effect.to_json(),
                "verdict": self.verdict,
                "note": self.note,
                **({"extra": self.extra} if self.extra else {}),
            }
        )


_EXPECT_TEXT = {"positive": "> 0", "negative": "< 0", "zero": "= 0"}


def findings_section(findings: Sequence[Finding], checks: Sequence[str] = ()) -> Section:
    """The "Findings" section that opens a study's report: one row per claim (the claim,
    what was measured, the predicted sign, the effect with its 95% interval, the seeds,
    the verdict), then ``checks``: lines saying whether the study's mechanism acted
    (a warning where it did not)."""
    rows = []
    for f in findings:
        rows.append(
            {
                "claim": f.claim,
                "measured": f.measured,
                "expect": _EXPECT_TEXT[f.expect]
                + (f" (±{f.tolerance:g})" if f.tolerance and f.expect == "zero" else "")
                + (", exact" if f.exact else ""),
                "effect": f.effect.text(f.spec),
                "n": f.effect.n,
                "verdict": f.verdict,
            }
        )
    table = StudyTable(
        "findings",
        "The paper's claims, measured here",
        [
            ("claim", "claim", "s"),
            ("measured", "measured", "s"),
            ("predicts", "expect", "s"),
            ("effect, mean [95% CI]", "effect", "s"),
            ("seeds", "n", "d"),
            ("verdict", "verdict", "s"),
        ],
        rows,
        note="A claim *holds* where the 95% t-interval over the seeds lies on the side it "
        "predicts, is *contradicted* where it lies on the other side, and is *not resolved* "
        "where it holds 0 (with one seed there is no interval). Claims marked exact are "
        "identities checked seed by seed; one the runs gave nothing to act on (see the "
        "lines above the table) is not resolved.",
    )
    table.findings = list(findings)  # type: ignore[attr-defined]
    text = "\n".join(f"- {line}" for line in checks)
    return Section("Findings", text=text, tables=[table])


# ------------------------------------------------------------- paired difference tables


def _label_column(columns: Sequence[tuple[str, str, str]], rows: Sequence[Mapping]) -> str | None:
    for _, key, spec in columns:
        if spec == "s" and all(isinstance(r.get(key), str) for r in rows):
            return key
    return None


def paired_tables(
    tables: Sequence[Any],
    reference: str | Sequence[str],
    n_seeds: int,
    level: float = LEVEL,
) -> list[StudyTable]:
    """For every table with a row labelled ``reference`` (its first text column whose
    cells are all text; ``reference`` may list several names of the one arm) and
    per-seed cells: a table of each other row's paired difference from that row, column
    by column (mean [95% CI], verdict, the smallest difference the seeds resolve and the
    seeds the observed one would need). Tables without the reference row, or without
    per-seed numbers, give none."""
    names = [reference] if isinstance(reference, str) else list(reference)
    out = []
    for table in tables:
        label = _label_column(table.columns, table.rows)
        if label is None:
            continue
        refs = [r for r in table.rows if r.get(label) in names]
        if len(refs) != 1:
            continue
        ref = refs[0]
        rows = []
        for row in table.rows:
            if row is ref:
                continue
            for header, key, spec in table.columns:
                a, b = row.get(key), ref.get(key)
                if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
                    continue
                if len(a) != n_seeds or len(b) != n_seeds:
                    continue
                d = paired_difference(a, b, level)
                rows.append(
                    {
                        "row": row[label],
                        "column": header,
                        "diff": d.text(spec if spec != "d" else ".1f"),
                        "verdict": d.verdict,
                        "mdd": d.half_width,
                        "mdd_text": _fmt_plain(d.half_width, spec),
                        "needed": d.seeds_needed,
                        "paired": d.to_json(),
                    }
                )
        if not rows:
            continue
        out.append(
            StudyTable(
                f"paired_{table.key}",
                f"{table.title}: paired differences from {ref[label]}",
                [
                    ("row", "row", "s"),
                    ("column", "column", "s"),
                    ("difference, mean [95% CI]", "diff", "s"),
                    ("verdict", "verdict", "s"),
                    ("smallest resolvable", "mdd_text", "s"),
                    ("seeds needed", "needed", "s"),
                ],
                [{**r, "needed": "-" if r["needed"] is None else str(r["needed"])} for r in rows],
                note=f"Each row's value minus the {ref[label]} row's, seed by seed (seed s of "
                "both arms reads the same corpus in the same order from the same random "
                "stream), with its 95% t-interval; "
                "smallest resolvable: the interval's half-width; seeds needed: how many "
                "seeds would resolve the observed difference at the measured sd.",
            )
        )
    return out


def _fmt_plain(value: float, spec: str) -> str:
    return fmt(value, spec if spec != "d" else ".1f")
