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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moelab._format import fmt
from moelab._strict_json import json_safe
from moelab.studies.tables import Section, StudyTable

__all__ = [
    "Finding",
    "Paired",
    "Source",
    "arm_rows",
    "findings_section",
    "interval",
    "paired_difference",
    "paired_tables",
    "per_seed",
    "row_arm",
    "seeds_for",
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
        if not self.measured or self.n < 2:
            return None
        return seeds_for(self.sd, abs(self.mean), self.level)

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


def seeds_for(sd: float, margin: float, level: float = LEVEL) -> int | None:
    """The fewest seeds ``m`` (at least 2) with ``t_{(1+level)/2, m−1} · sd / √m <
    margin``: how many seeds an interval of this sd needs to keep a mean ``margin`` away
    from a boundary on one side (None: ``margin`` ≤ 0, a sd that is not finite, or more
    than MAX_SEEDS)."""
    if not (math.isfinite(sd) and math.isfinite(margin)) or margin <= 0:
        return None
    if sd == 0:
        return 2
    target = margin / sd
    q = 0.5 + level / 2
    m = 2
    while m <= MAX_SEEDS:
        if t_quantile(q, m - 1) / math.sqrt(m) < target:
            return m
        m = m + 1 if m < 64 else int(m * 1.1)  # coarse beyond 64 seeds
    return None


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


@dataclass(frozen=True)
class Source:
    """Where a finding's effect comes from, when it is a paired difference: in the study
    table ``table`` (its key), column ``column`` (its key), the row of arm ``a`` minus the
    row of arm ``b`` (arm names), seed by seed. ``match_a`` / ``match_b``: more fields
    the row must hold, for a table with several rows per arm (e.g. ``{"scale": "2 ×"}``;
    ``a`` may equal ``b`` there). results.json names them (``"source"``) and
    :func:`~moelab.studies.audit.audit` checks that the effect equals that difference
    of the values it keeps."""

    table: str | None
    """The table's key; None: the first table of the report that holds a row of each arm
    (with the ``match_*`` fields) with per-seed values in ``column``."""
    column: str
    a: str
    b: str
    match_a: Mapping[str, Any] = field(default_factory=dict)
    match_b: Mapping[str, Any] = field(default_factory=dict)


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
    source: Source | None = None
    """For an effect that is a paired difference: the table, column and two arms it is
    taken from (results.json names them, and :func:`~moelab.studies.audit.audit` checks it)."""
    measure: bool = False
    """True for an effect that is no difference of two arms' table cells (a ratio, an
    identity's residual, a slope within one arm): results.json says so, and its per-seed
    values are the effect's own."""

    def __post_init__(self) -> None:
        if self.expect not in EXPECTS:
            raise ValueError(f"expect must be one of {EXPECTS}, got {self.expect!r}")
        if self.source is not None and self.measure:
            raise ValueError(f"finding {self.key}: a paired difference (source) is no measure")

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

    @property
    def resolved(self) -> bool:
        """The verdict is "holds" or "contradicted"."""
        return self.verdict in ("holds", "contradicted")

    @property
    def seeds_needed(self) -> int | None:
        """How many seeds the claim would need to be resolved, at the measured mean and sd
        of its effect: the fewest ``m`` whose interval lies wholly beyond the boundary
        (±tolerance) that the mean lies beyond, or wholly within ±tolerance for an "= 0"
        claim whose mean lies within it (:func:`seeds_for`). None where more seeds
        cannot resolve it: fewer than two seeds measured, an exact claim that some seeds
        satisfy and some do not, a claim the runs give nothing to act on, or a mean on
        the boundary (see :meth:`why_unresolved`). A resolved claim: its seeds."""
        e = self.effect
        if self.resolved:
            return e.n
        if not e.measured or e.n < 2 or self.exact or not self.testable:
            return None
        mean, tol = e.mean, self.tolerance
        if self.expect == "zero" and abs(mean) < tol:
            margin = tol - abs(mean)
        else:
            margin = abs(mean) - tol
        return seeds_for(e.sd, margin, e.level)

    def why_unresolved(self) -> str:
        """Why the claim is not resolved, in words ("" when it is)."""
        e = self.effect
        if self.resolved:
            return ""
        if not e.measured:
            return "not measured (a seed gave no finite value)"
        if not self.testable:
            return "the runs gave the claim nothing to act on (see the checks)"
        if self.exact:
            return (
                "an identity that some seeds satisfy and some do not: more seeds cannot resolve it"
            )
        if e.n < 2:
            return "one seed: no interval"
        need = self.seeds_needed
        if need is None:
            if self.tolerance and abs(abs(e.mean) - self.tolerance) <= 0.0:
                return (
                    "the observed mean lies on the boundary of its tolerance: more seeds "
                    "cannot resolve it at this mean"
                )
            if (self.expect != "zero" and abs(e.mean) <= self.tolerance) or e.mean == 0:
                return (
                    "the observed mean lies within its tolerance of 0, on neither side the "
                    "claim names: more seeds cannot resolve it at this mean"
                    if self.tolerance
                    else "an observed mean of exactly 0: more seeds cannot resolve it"
                )
            return f"needs more than {MAX_SEEDS:,} seeds at the measured mean and sd"
        return f"needs about {need} seeds at the measured mean and sd"

    def to_json(self, resolve: Callable[[Source], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The finding as results.json holds it; ``resolve`` turns its :class:`Source`
        into the record that names the rows (:func:`~moelab.studies.audit.source_record`)."""
        source: dict[str, Any] | None = None
        if self.source is not None:
            source = resolve(self.source) if resolve is not None else _plain_source(self.source)
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
                "kind": "paired difference"
                if source is not None
                else "measure"
                if self.measure
                else "unlabeled",
                **({"source": source} if source is not None else {}),
                "verdict": self.verdict,
                "seeds_needed": self.seeds_needed,
                "why_unresolved": self.why_unresolved(),
                "note": self.note,
                **({"extra": self.extra} if self.extra else {}),
            }
        )


def _plain_source(src: Source) -> dict[str, Any]:
    return {
        "table": src.table,
        "column": src.column,
        "arms": [src.a, src.b],
        "rows": [dict(src.match_a), dict(src.match_b)],
    }


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


def row_arm(row: Mapping[str, Any], arms: Mapping[str, str]) -> tuple[str, str] | None:
    """The arm a table row belongs to and the field that says so: its ``"name"`` field
    when that is an arm's name, else its first text field holding an arm's name, or the
    label of exactly one arm (``arms``: name -> label). None for a row of no arm."""
    by_label: dict[str, list[str]] = {}
    for name, label in arms.items():
        by_label.setdefault(label, []).append(name)
    name = row.get("name")
    if isinstance(name, str) and name in arms:
        return name, "name"
    for key, value in row.items():
        if not isinstance(value, str):
            continue
        if value in arms:
            return value, key
        if len(by_label.get(value, [])) == 1:
            return by_label[value][0], key
    return None


def per_seed(cell: Any) -> list[Any] | None:
    """A cell's per-seed values: a list as the study made it, or the ``values`` of its
    summary as results.json holds it; None for any other cell."""
    if isinstance(cell, (list, tuple)):
        return list(cell)
    if isinstance(cell, Mapping) and isinstance(cell.get("values"), list):
        return list(cell["values"])
    return None


def arm_rows(
    rows: Sequence[Mapping[str, Any]], arms: Mapping[str, str]
) -> dict[str, tuple[Mapping[str, Any], str]] | None:
    """Each arm's row with the field that names it, for a table with one row per arm
    (rows of no arm left out); None where an arm has several rows."""
    out: dict[str, tuple[Mapping[str, Any], str]] = {}
    for row in rows:
        found = row_arm(row, arms)
        if found is None:
            continue
        if found[0] in out:
            return None
        out[found[0]] = (row, found[1])
    return out


def paired_tables(
    tables: Sequence[Any],
    reference: str | Sequence[str],
    n_seeds: int,
    level: float = LEVEL,
    arms: Mapping[str, str] | None = None,
) -> list[StudyTable]:
    """For every table with one row per arm (:func:`row_arm`), one of them the
    reference's, and per-seed cells: a table of each other arm's paired difference from
    the reference, column by column (mean [95% CI], verdict, the smallest difference the
    seeds resolve and the seeds the observed one would need). ``arms``: the study's arms,
    name -> label (None: ``reference``, a name or several names of the one arm, found in
    the tables' first all-text column). Each row also names its record in full: the
    table and column keys, the two arms (names) and the two rows (``"rows"``: the field
    and value that pick each row out of the table), so that results.json's reader finds
    the per-seed values it is the difference of (:func:`~moelab.studies.audit.audit`)."""
    names = [reference] if isinstance(reference, str) else list(reference)
    if arms is None:
        arms = {names[0]: names[0]}
        ref_name = names[0]
        aliases = set(names)
    else:
        ref_name = next((n for n in names if n in arms), names[0])
        aliases = {ref_name}
    out = []
    for table in tables:
        if arms is not None and len(arms) > 1:
            by_arm = arm_rows(table.rows, arms)
        else:
            label = _label_column(table.columns, table.rows)
            by_arm = None
            if label is not None:
                by_arm = {}
                for row in table.rows:
                    key = ref_name if row.get(label) in aliases else row.get(label)
                    if key in by_arm:
                        by_arm = None
                        break
                    by_arm[key] = (row, label)
        if not by_arm or ref_name not in by_arm:
            continue
        ref, ref_field = by_arm[ref_name]
        shown = _label_column(table.columns, table.rows)
        rows = []
        for arm, (row, fld) in by_arm.items():
            if arm == ref_name:
                continue
            for header, key, spec in table.columns:
                a, b = per_seed(row.get(key)), per_seed(ref.get(key))
                if a is None or b is None or len(a) != n_seeds or len(b) != n_seeds:
                    continue
                d = paired_difference(a, b, level)
                rows.append(
                    {
                        "row": row[shown] if shown is not None else row[fld],
                        "column": header,
                        "diff": d.text(spec if spec != "d" else ".1f"),
                        "verdict": d.verdict,
                        "mdd": d.half_width,
                        "mdd_text": _fmt_plain(d.half_width, spec),
                        "needed": d.seeds_needed,
                        "paired": d.to_json(),
                        "source": {
                            "table": table.key,
                            "column": key,
                            "arms": [arm, ref_name],
                            "rows": [{fld: row[fld]}, {ref_field: ref[ref_field]}],
                        },
                    }
                )
        if not rows:
            continue
        ref_text = ref[shown] if shown is not None else ref[ref_field]
        out.append(
            StudyTable(
                f"paired_{table.key}",
                f"{table.title}: paired differences from {ref_text}",
                [
                    ("row", "row", "s"),
                    ("column", "column", "s"),
                    ("difference, mean [95% CI]", "diff", "s"),
                    ("verdict", "verdict", "s"),
                    ("smallest resolvable", "mdd_text", "s"),
                    ("seeds needed", "needed", "s"),
                ],
                [{**r, "needed": "-" if r["needed"] is None else str(r["needed"])} for r in rows],
                note=f"Each row's value minus the {ref_text} row's, seed by seed (seed s of "
                "both arms reads the same corpus in the same order from the same random "
                "stream), with its 95% t-interval; "
                "smallest resolvable: the interval's half-width; seeds needed: how many "
                "seeds would resolve the observed difference at the measured sd.",
            )
        )
    return out


def _fmt_plain(value: float, spec: str) -> str:
    return fmt(value, spec if spec != "d" else ".1f")
