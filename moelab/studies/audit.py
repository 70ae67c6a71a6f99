"""The audit of a study's paired-difference records: :func:`source_record` names, in
results.json, the table, column, two arms and rows a :class:`~.paired.Finding`'s effect
comes from; :func:`audit` checks every such record, and every paired table, against the
per-seed values results.json itself holds (seed by seed, A - B). A study's quick-scale
test asserts an empty audit; ``write_outputs`` warns of any problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from moelab.studies.paired import Source, arm_rows, per_seed, row_arm

__all__ = ["audit", "source_record"]


def source_record(source: Source, tables: Sequence[Any], arms: Mapping[str, str]) -> dict[str, Any]:
    """A finding's :class:`Source` as results.json names it: the table and column keys,
    the two arms, and each row as the fields that pick it out of the table (the field
    that names its arm and the source's ``match_*`` fields). A row the table does not
    hold once is named by the source's own fields, which :func:`audit` reports."""

    def pick(table: Any, arm: str, match: Mapping[str, Any]) -> dict[str, Any] | None:
        hits = [
            (row, fld)
            for row in table.rows
            for fld in [_arm_field(row, arm, arms)]
            if fld is not None and all(row.get(k) == v for k, v in match.items())
        ]
        if len(hits) != 1 or per_seed(hits[0][0].get(source.column)) is None:
            return None
        row, fld = hits[0]
        return {fld: row[fld], **dict(match)}

    sides = ((source.a, source.match_a), (source.b, source.match_b))
    candidates = [t for t in tables if source.table is None or t.key == source.table]
    for table in candidates:
        rows = [pick(table, arm, match) for arm, match in sides]
        if all(r is not None for r in rows):
            break
    else:
        table = None
        rows = [{"arm": arm, **dict(match)} for arm, match in sides]
    return {
        "table": table.key if table is not None else source.table,
        "column": source.column,
        "arms": [source.a, source.b],
        "rows": rows,
    }


def _arm_field(row: Mapping[str, Any], arm: str, arms: Mapping[str, str]) -> str | None:
    found = row_arm(row, arms)
    return found[1] if found is not None and found[0] == arm else None


# ------------------------------------------------------------------------------ audit


def _same(x: Any, y: Any) -> bool:
    if x is None or y is None:
        return x is None and y is None
    x, y = float(x), float(y)
    if not (math.isfinite(x) and math.isfinite(y)):
        return (math.isnan(x) and math.isnan(y)) or x == y
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)


def _difference(a: Sequence[Any], b: Sequence[Any]) -> list[float | None]:
    out: list[float | None] = []
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            out.append(None)
        else:
            d = float(x) - float(y)
            out.append(d if math.isfinite(d) else None)
    return out


def _check_record(
    where: str,
    source: Any,
    values: Sequence[Any],
    tables: Mapping[str, Mapping[str, Any]],
    arms: Mapping[str, str],
) -> list[str]:
    """Problems of one paired-difference record: its names and its values."""
    if not isinstance(source, Mapping):
        return [f"{where}: names no table, column and arms"]
    missing = [k for k in ("table", "column", "arms", "rows") if k not in source]
    if missing:
        return [f"{where}: does not name its {', '.join(missing)}"]
    table = tables.get(source["table"])
    if table is None:
        return [f"{where}: table {source['table']!r} is not in results.json"]
    column = source["column"]
    if column not in {c["key"] for c in table["columns"]}:
        return [f"{where}: table {source['table']!r} has no column {column!r}"]
    pair, rows = source["arms"], source["rows"]
    if not (isinstance(pair, list) and len(pair) == 2 and all(a in arms for a in pair)):
        return [f"{where}: arms {pair!r} are not two of the study's arms"]
    if not (isinstance(rows, list) and len(rows) == 2):
        return [f"{where}: names {rows!r}, not two rows"]
    cells = []
    for arm, pick in zip(pair, rows, strict=True):
        hits = [
            r
            for r in table["rows"]
            if isinstance(pick, Mapping) and pick and all(r.get(k) == v for k, v in pick.items())
        ]
        if len(hits) != 1:
            return [f"{where}: {len(hits)} rows of {source['table']!r} hold {pick!r}, not one"]
        found = row_arm(hits[0], arms)
        if found is None or found[0] != arm:
            return [f"{where}: the row {pick!r} is not arm {arm!r}'s"]
        cell = per_seed(hits[0].get(column))
        if cell is None:
            return [f"{where}: {arm}'s {column!r} in {source['table']!r} holds no per-seed values"]
        cells.append(cell)
    if len(cells[0]) != len(cells[1]) or len(cells[0]) != len(values):
        return [
            f"{where}: {len(values)} values, but the rows hold {len(cells[0])} and {len(cells[1])}"
        ]
    want = _difference(*cells)
    if not all(_same(x, y) for x, y in zip(values, want, strict=True)):
        return [
            f"{where}: values {list(values)} are not {pair[0]} − {pair[1]} of "
            f"{source['table']}.{column}, seed by seed ({want})"
        ]
    return []


def audit(doc: Mapping[str, Any]) -> list[str]:
    """The problems of a study's results.json (``doc``) with its paired differences, one
    line each (none: an empty list):

    - every paired-difference record (each row of a ``paired_*`` table, and each finding
      whose effect is a paired difference) names its table, column, two arms and two
      rows, and its per-seed values equal, seed by seed, the difference of the two rows'
      per-seed values that results.json holds in that table and column;
    - every finding is either such a paired difference or marked a measure (``"kind"``);
    - every table with one row per arm, one of them the reference's, has the paired
      difference of every other arm's per-seed cell from the reference's, column by
      column, in its ``paired_KEY`` table."""
    arms = {a["name"]: a.get("label", a["name"]) for a in doc.get("arms", [])}
    tables = {t["key"]: t for t in doc.get("tables", [])}
    n = len(doc.get("seeds", []))
    problems: list[str] = []
    for key, table in tables.items():
        if not key.startswith("paired_"):
            continue
        for i, row in enumerate(table["rows"]):
            where = f"{key} row {i} ({row.get('row')}, {row.get('column')})"
            values = row.get("paired", {}).get("values")
            if not isinstance(values, list):
                problems.append(f"{where}: holds no per-seed differences")
                continue
            problems += _check_record(where, row.get("source"), values, tables, arms)
    for f in doc.get("findings", []):
        where = f"finding {f.get('key')}"
        kind = f.get("kind")
        if kind == "measure":
            continue
        if kind != "paired difference":
            problems.append(f"{where}: neither a paired difference naming its source nor a measure")
            continue
        problems += _check_record(where, f.get("source"), f["effect"]["values"], tables, arms)
    ref = doc.get("reference")
    if ref in arms:
        for key, table in tables.items():
            if key.startswith("paired_") or key == "findings":
                continue
            by_arm = arm_rows(table["rows"], arms)
            if not by_arm or ref not in by_arm:
                continue
            have = {
                (r["source"]["column"], r["source"]["arms"][0])
                for r in tables.get(f"paired_{key}", {}).get("rows", [])
                if isinstance(r.get("source"), Mapping)
                and r["source"].get("table") == key
                and r["source"].get("arms", [None, None])[1] == ref
            }
            ref_row = by_arm[ref][0]
            for arm, (row, _) in by_arm.items():
                if arm == ref:
                    continue
                for col in table["columns"]:
                    a, b = per_seed(row.get(col["key"])), per_seed(ref_row.get(col["key"]))
                    if a is None or b is None or len(a) != n or len(b) != n:
                        continue
                    if (col["key"], arm) not in have:
                        problems.append(
                            f"{key}: {arm}'s {col['key']!r} has per-seed values but no paired "
                            f"difference from {ref} in paired_{key}"
                        )
    return problems
