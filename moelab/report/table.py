"""The one table type of moelab: report, studies, downstream and the CLI print with it.

    t = Table([("run", "label", "s"), ("loss", "val_loss", ".4f")], rows, "Caption.")
    t.markdown(); t.latex(); t.text(); t.records(); t.to_json()

``columns`` are ``(header, key in the row dicts, format spec)`` (".4f", ".1%", "d", or
"s" for text; text columns align left, numbers right). A cell is a text, a number, or a
list with one value per seed, summarised as mean ± sd (:func:`summarize`,
:func:`cell_text`). Every number prints through the one formatter
:func:`moelab._format.fmt` ("-" where a value is None, NaN or infinite).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moelab._format import fmt, json_value
from moelab._strict_json import json_safe

__all__ = ["Columns", "Table", "cell_text", "latex_table", "summarize"]

Columns = Sequence[tuple[str, str, str]]
"""(header, key in the row dicts, format spec) per column."""


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "n", "values"}`` over the finite entries of ``values`` (one per
    seed): the mean and the sample standard deviation (ddof = 1; None below two
    values). A cell with no finite value has mean None."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    mean = sum(vals) / n if n else None
    sd = None
    if n >= 2:
        assert mean is not None
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    return {"mean": mean, "sd": sd, "n": n, "values": [json_safe(v) for v in values]}


def cell_text(cell: Any, spec: str) -> str:
    """A table cell as text: a summary (see :func:`summarize`) prints "mean ± sd" when
    it has an sd and the mean alone otherwise; any other value prints with ``fmt``."""
    if isinstance(cell, dict) and "mean" in cell:
        if cell.get("sd") is None:
            return fmt(cell["mean"], spec)
        return f"{fmt(cell['mean'], spec)} ± {fmt(cell['sd'], spec)}"
    return fmt(cell, spec)


def _summary(v: Any) -> Any:
    """A per-seed list (or tuple) as its summary; any other value as it is."""
    return summarize(v) if isinstance(v, (list, tuple)) else v


def _md_table(columns: Columns, rows: Sequence[Mapping[str, Any]]) -> str:
    head = "| " + " | ".join(c[0].replace("|", "\\|") for c in columns) + " |"
    sep = "|" + "|".join("---" if c[2] == "s" else "---:" for c in columns) + "|"
    body = [
        "| "
        + " | ".join(
            cell_text(_summary(r.get(key)), spec).replace("|", "\\|") for _, key, spec in columns
        )
        + " |"
        for r in rows
    ]
    return "\n".join([head, sep, *body])


_TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "|": r"\textbar{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
}


def _tex(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(c, c) for c in text)


def latex_table(
    columns: Columns,
    rows: Sequence[dict[str, Any]],
    caption: str,
    label: str | None = None,
    cell: Callable[[Any, str], str] = fmt,
) -> str:
    """A booktabs ``table`` environment scaled to the line width (needs
    ``\\usepackage{booktabs,graphicx}``): text columns left, numbers right, "-" where a
    value is undefined; headers and cells escaped; cells formatted as in Markdown
    (``cell(value, spec)``, :func:`fmt` by default; a "±" becomes ``$\\pm$``), with
    ``\\label{tab:LABEL}`` when a label is given."""
    align = "".join("l" if spec == "s" else "r" for _, _, spec in columns)
    head = " & ".join(_tex(name) for name, _, _ in columns) + r" \\"
    body = [
        " & ".join(_tex(cell(r.get(key), spec)).replace("±", r"$\pm$") for _, key, spec in columns)
        + r" \\"
        for r in rows
    ]
    return "\n".join(
        [
            r"\begin{table}[t]",
            r"\centering",
            rf"\caption{{{_tex(caption)}}}",
            *([rf"\label{{tab:{_tex(label)}}}"] if label else []),
            r"\resizebox{\linewidth}{!}{%",
            rf"\begin{{tabular}}{{{align}}}",
            r"\toprule",
            head,
            r"\midrule",
            *body,
            r"\bottomrule",
            r"\end{tabular}}",
            r"\end{table}",
        ]
    )


def _text_table(columns: Columns, rows: Sequence[Mapping[str, Any]]) -> str:
    cells = [[c[0] for c in columns]]
    cells += [[cell_text(_summary(r.get(key)), spec) for _, key, spec in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for row in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if spec == "s" else v.rjust(w)
                for v, w, (_, _, spec) in zip(row, widths, columns, strict=True)
            )
        )
    return "\n".join(lines)


@dataclass
class Table:
    """A table: ``columns`` as (header, key in the row dicts, format spec), ``rows`` the
    row dicts (a per-seed list in a cell prints as mean ± sd); ``caption`` titles it in
    LaTeX (a report's table without one stays out of tables.tex); ``key`` names it in a
    study's results.json and labels it in LaTeX (``tab:KEY``); ``note``: text under it."""

    columns: Columns
    rows: Sequence[dict[str, Any]]
    caption: str | None = None
    key: str | None = None
    note: str = ""

    @property
    def title(self) -> str:
        """The caption as text ("" without one)."""
        return self.caption or ""

    def cells(self) -> list[dict[str, Any]]:
        """The rows with every per-seed list replaced by its summary."""
        out = []
        for row in self.rows:
            out.append(
                {k: summarize(v) if isinstance(v, (list, tuple)) else v for k, v in row.items()}
            )
        return out

    def markdown(self) -> str:
        """The table as Markdown (a "|" in a header escaped)."""
        return _md_table(self.columns, self.rows)

    def latex(self) -> str:
        """The table as a booktabs environment (:func:`latex_table`)."""
        rows = [{k: _summary(r.get(k)) for _, k, _ in self.columns} for r in self.rows]
        return latex_table(self.columns, rows, self.title, self.key, cell_text)

    def text(self) -> str:
        """The table as fixed-width text: the headers, then one line per row."""
        return _text_table(self.columns, self.rows)

    def records(self) -> list[dict[str, Any]]:
        """The rows as strict-JSON values keyed by column header (NaN and inf: None)."""
        return [{name: json_value(r.get(key)) for name, key, _ in self.columns} for r in self.rows]

    def to_json(self) -> dict[str, Any]:
        """The table as a study's results.json holds it (cells summarised)."""
        return json_safe(
            {
                "key": self.key,
                "title": self.title,
                "columns": [{"header": h, "key": k, "spec": s} for h, k, s in self.columns],
                "rows": self.cells(),
                "note": self.note,
            }
        )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Table:
        """The table back from its :meth:`to_json` document (cells already summarised)."""
        columns = [(c["header"], c["key"], c["spec"]) for c in doc["columns"]]
        return cls(columns, list(doc["rows"]), doc["title"], doc["key"], doc.get("note", ""))
