"""``moelab report``: a Markdown + PNG comparison of trained runs.

    write_report(["runs/softmax", "runs/sparsemax"], "report")   # -> report/report.md

For each run: the routing statistics of the newest checkpoint (:func:`moelab.diagnostics
.stats`), the inference-time budget sweep (:func:`moelab.diagnostics.evaluate`, the K
values that fit the model), the top-2 logit gaps of every MoE layer from the same
pass as the statistics, and the training curves of ``metrics.jsonl``. The folder ``out``
gets ``report.md`` and the figures it embeds:

    loss_vs_k.png            NLL against K, one line per run
    nll_vs_active.png        NLL against active experts: the K sweeps and, for
                             truncating routers, the threshold-scale sweeps
    training_curves.png      discarded mass and active experts over training tokens
    gaps_<run>.png           top-2 gap histogram with the map's threshold (MoE runs)
    load_<run>.png           expert load shares per MoE layer (MoE runs)
    radii.png                certified top-1 radii, relative to the token norm (MoE runs)
    temperature.png          temperature and gate Lipschitz constant over training
                             (runs that logged them)
    allocation.png           learned per-layer budgets k_l and active experts over
                             training (truncating runs)
    tables.tex               the routing, budget-sweep and certification tables as
                             LaTeX (booktabs)

Dense runs (no MoE layers) get "-" wherever routing does not apply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moelab.diagnostics import evaluate, evaluate_truncation, load_run, stats
from moelab.report import plots

__all__ = ["build_report", "collect_run", "format_routing_table", "latex_table", "write_report"]

THRESHOLD_SCALES = (0.5, 1.0, 1.5, 2.0)
"""Default threshold scales of the truncation sweep (1: as trained)."""

# (header, key in the row dict, format): the routing statistics of a run or a layer
METRIC_COLUMNS: list[tuple[str, str, str]] = [
    ("discarded mass", "discarded_mass", ".4f"),
    ("contributors", "contributors", ".3f"),
    ("singleton %", "singleton_pct", ".1f"),
    ("pair %", "pair_pct", ".1f"),
    ("E[delta | s>=3]", "discarded_mass_support_ge3", ".4f"),
    ("nominal CV", "nominal_cv", ".3f"),
    ("contrib CV", "contrib_cv", ".3f"),
    ("contrib SD", "contrib_sd", ".4f"),
    ("score RMS", "score_rms", ".3f"),
]

ROUTING_COLUMNS: list[tuple[str, str, str]] = [
    ("run", "label", "s"),
    ("map", "map", "s"),
    ("alpha", "alpha", "g"),
    ("K", "top_k", "d"),
    ("val loss", "val_loss", ".4f"),
    *METRIC_COLUMNS,
]

# the threshold law on the trained routers (the sparse-maps paper's Table 5)
GAP_COLUMNS: list[tuple[str, str, str]] = [
    ("run", "label", "s"),
    ("map", "map", "s"),
    ("threshold", "threshold", "g"),
    ("singleton %", "singleton_pct", ".2f"),
    ("gaps >= threshold %", "gap_ge_threshold_pct", ".2f"),
    ("gaps >= 1 %", "gap_ge1_pct", ".2f"),
    ("gaps >= 2 %", "gap_ge2_pct", ".2f"),
    ("gap p50", "gap_p50", ".3f"),
    ("gap p90", "gap_p90", ".3f"),
    ("gap p99", "gap_p99", ".3f"),
]

# temperature and certification, one row per run (means over MoE layers)
CERT_COLUMNS: list[tuple[str, str, str]] = [
    ("run", "label", "s"),
    ("map", "map", "s"),
    ("schedule", "schedule", "s"),
    ("tau", "tau", ".3g"),
    ("||W||_2", "weight_norm", ".3g"),
    ("Lipschitz ||W||_2/(2 tau)", "lipschitz", ".3g"),
    ("radius p10", "radius_p10", ".3g"),
    ("radius p50", "radius_p50", ".3g"),
    ("radius p90", "radius_p90", ".3g"),
    ("radius/||x|| p50", "radius_rel_p50", ".3g"),
    ("tied %", "radius_zero_pct", ".2f"),
]

# LapSum routers: the budget, the cut and what it gives, per layer
LAPSUM_COLUMNS: list[tuple[str, str, str]] = [
    ("layer", "layer", "d"),
    ("block", "block", "d"),
    ("k_l", "lapsum_k", ".3f"),
    ("cut on p", "truncation", ".4f"),
    ("active experts", "active_experts", ".3f"),
    ("discarded mass", "discarded_mass", ".4f"),
    ("load CV", "load_cv", ".3f"),
]

LAYER_COLUMNS: list[tuple[str, str, str]] = [
    ("layer", "layer", "d"),
    ("block", "block", "d"),
    *METRIC_COLUMNS,
    ("gap p50", "gap_p50", ".3f"),
    ("active", "active_experts", ".3f"),
]


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    if spec == "s":
        return str(v)
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _with_pct(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for src, dst in (
        ("singleton_rate", "singleton_pct"),
        ("pair_rate", "pair_pct"),
        ("radius_zero_frac", "radius_zero_pct"),
        ("frac_gap_ge_threshold", "gap_ge_threshold_pct"),
        ("frac_gap_ge1", "gap_ge1_pct"),
        ("frac_gap_ge2", "gap_ge2_pct"),
    ):
        v = d.get(src)
        out[dst] = None if v is None else 100.0 * v
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _labels(runs: Sequence[Path]) -> list[str]:
    """Run folder names, made unique with a counter where two runs share one."""
    labels: list[str] = []
    for p in runs:
        base = _slug(p.name)
        label, i = base, 2
        while label in labels:
            label, i = f"{base}-{i}", i + 1
        labels.append(label)
    return labels


def _read_metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _read_summary(run: Path) -> dict[str, Any]:
    path = run / "summary.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def collect_run(
    run: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
) -> dict[str, Any]:
    """Everything the report shows about one run, as plain data: ``{"run", "dense",
    "row" (routing-table row), "layers", "sweep" (evaluate's document or None),
    "truncation" (evaluate_truncation's, for truncating routers, or None), "gaps"
    and "radii" (numpy arrays or None), "threshold", "metrics", "summary"}``. The run
    is loaded once."""
    run = Path(run)
    loaded = load_run(run)  # once: stats and the sweep reuse it
    summary = _read_summary(run)
    mc = loaded.model.config
    rc = mc.router_config()
    dense = not loaded.model.moe_layers
    row: dict[str, Any] = {
        "map": "-" if dense else rc.map,
        "alpha": None if dense else rc.alpha,
        # a truncating router has no K: its count of experts varies per token
        "top_k": (
            None
            if dense or rc.selection != "topk"
            else int(loaded.model.moe_layers[0].router.top_k)
        ),
        "val_loss": summary.get("val_loss"),
    }
    result: dict[str, Any] = {
        "run": str(run),
        "dense": dense,
        "metrics": _read_metrics(run),
        "summary": summary,
        "layers": [],
        "sweep": None,
        "truncation": None,
        "truncating": not dense and rc.selection == "threshold",
        "budget_k": None if dense else (rc.lapsum_k if rc.lapsum_k is not None else rc.top_k),
        "gaps": None,
        "radii": None,
        "threshold": None,
    }
    if not dense:
        st = stats(loaded, max_batches=max_batches, gaps=True, radii=True)
        result["gaps"] = st.pop("gaps")
        result["radii"] = st.pop("radii")
        row["schedule"] = st["schedule"]
        row["learned_allocation"] = st["learned_allocation"]
        row.update(_with_pct(st["mean"]))
        row["alpha"] = st["alpha"]
        if row["val_loss"] is None:
            row["val_loss"] = st["nll"]
        result["stats"] = st
        result["layers"] = [_with_pct(lay) for lay in st["layers"]]
        result["threshold"] = st["mean"].get("threshold")
        ks = [int(k) for k in top_ks if 1 <= int(k) <= mc.n_experts]
        if ks and rc.selection == "topk":
            result["sweep"] = evaluate(loaded, ks, max_batches=max_batches)
        if rc.selection == "threshold" and threshold_scales:
            result["truncation"] = evaluate_truncation(
                loaded, threshold_scales, max_batches=max_batches
            )
    result["row"] = row
    return result


def _md_table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c[0].replace("|", "\\|") for c in columns) + " |"
    sep = "|" + "|".join("---" if c[2] == "s" else "---:" for c in columns) + "|"
    body = [
        "| " + " | ".join(_fmt(r.get(key), spec) for _, key, spec in columns) + " |" for r in rows
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
    columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]], caption: str
) -> str:
    """A booktabs ``table`` environment scaled to the line width (needs
    ``\\usepackage{booktabs,graphicx}``): text columns left, numbers right, "-" where a
    value is undefined; headers and cells escaped."""
    align = "".join("l" if spec == "s" else "r" for _, _, spec in columns)
    head = " & ".join(_tex(name) for name, _, _ in columns) + r" \\"
    body = [
        " & ".join(_tex(_fmt(r.get(key), spec)) for _, key, spec in columns) + r" \\" for r in rows
    ]
    return "\n".join(
        [
            r"\begin{table}[t]",
            r"\centering",
            rf"\caption{{{_tex(caption)}}}",
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


def format_routing_table(rows: Sequence[dict[str, Any]]) -> str:
    """The routing-statistics table as fixed-width text (one row per run)."""
    cells = [[c[0] for c in ROUTING_COLUMNS]]
    cells += [[_fmt(r.get(key), spec) for _, key, spec in ROUTING_COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(ROUTING_COLUMNS))]
    lines = []
    for row in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if spec == "s" else v.rjust(w)
                for v, w, (_, _, spec) in zip(row, widths, ROUTING_COLUMNS, strict=True)
            )
        )
    return "\n".join(lines)


def _map_desc(row: dict[str, Any]) -> str:
    return row["map"] if row.get("alpha") is None else f"{row['map']} alpha={row['alpha']:g}"


def build_report(
    runs: Sequence[str | Path],
    out: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
) -> dict[str, Any]:
    """Write ``out/report.md`` and its figures; return ``{"report": path, "files":
    [the PNGs], "rows": [routing-table rows]}`` (paths as strings)."""
    if not runs:
        raise ValueError("give at least one run folder")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(r) for r in runs]
    labels = _labels(paths)
    data = []
    for label, p in zip(labels, paths, strict=True):
        d = collect_run(p, top_ks, max_batches, threshold_scales)
        d["label"] = label
        d["row"]["label"] = label
        data.append(d)

    files: list[Path] = []
    files.append(plots.plot_loss_vs_k(data, out / "loss_vs_k.png"))
    files.append(plots.plot_training_curves(data, out / "training_curves.png"))
    gap_files: dict[str, Path] = {}
    load_files: dict[str, Path] = {}
    for d in data:
        if d["dense"]:
            continue
        label = d["label"]
        gap_files[label] = plots.plot_gaps(
            label, d["gaps"], d["threshold"], _map_desc(d["row"]), out / f"gaps_{label}.png"
        )
        load_files[label] = plots.plot_load(label, d["layers"], out / f"load_{label}.png")
        files += [gap_files[label], load_files[label]]

    budget_file = plots.plot_nll_vs_active(data, out / "nll_vs_active.png")
    if budget_file is not None:
        files.append(budget_file)
    temperature_file = plots.plot_temperature(data, out / "temperature.png")
    radii_file = plots.plot_radii(data, out / "radii.png")
    allocation_file = plots.plot_allocation(data, out / "allocation.png")
    files += [f for f in (temperature_file, radii_file, allocation_file) if f is not None]

    rows = [d["row"] for d in data]
    md: list[str] = ["# moelab report", ""]
    md += ["Runs:", ""] + [f"- `{d['label']}`: `{d['run']}`" for d in data] + [""]
    batches_note = "all validation batches" if max_batches is None else f"{max_batches} batches"
    md += [
        "## Routing statistics",
        "",
        f"Newest checkpoint with its trained K, on the validation split ({batches_note}); "
        "means over the MoE layers. `val loss` is training's final validation loss; "
        "E[delta | s>=3] is the mean discarded mass over states whose support has 3 or "
        'more experts. Dense runs show "-".',
        "",
        _md_table(ROUTING_COLUMNS, rows),
        "",
    ]
    for d in data:
        md += [f"### Per layer: {d['label']}", ""]
        if d["dense"]:
            md += ["Dense model: no MoE layers.", ""]
        else:
            md += [_md_table(LAYER_COLUMNS, d["layers"]), ""]

    # budget sweep
    all_ks = sorted({r["top_k"] for d in data if d["sweep"] for r in d["sweep"]["results"]})
    sweep_cols: list[tuple[str, str, str]] = [("run", "label", "s"), ("trained K", "tk", "d")]
    sweep_cols += [(f"NLL K={k}", f"k{k}", ".4f") for k in all_ks]
    sweep_cols.append(("increase trained K -> max K", "inc", "+.4f"))
    sweep_rows = []
    for d in data:
        sw = d["sweep"]
        r: dict[str, Any] = {"label": d["label"]}
        if sw:
            r["tk"] = sw["trained_top_k"]
            r.update({f"k{x['top_k']}": x["nll"] for x in sw["results"]})
            r["inc"] = sw["nll_increase"]
        sweep_rows.append(r)
    md += [
        "## Inference-time budget sweep",
        "",
        "The same weights run with K experts per token (validation NLL, nats per token); "
        "the last column is the NLL at the largest K minus the NLL at the trained K. "
        "K values above a model's expert count are left out.",
        "",
        _md_table(sweep_cols, sweep_rows),
        "",
        "![NLL against K](loss_vs_k.png)",
        "",
    ]
    truncating = [d for d in data if d["truncation"]]
    if truncating:
        scales = sorted(
            {x["threshold_scale"] for d in truncating for x in d["truncation"]["results"]}
        )
        cols: list[tuple[str, str, str]] = [("run", "label", "s")]
        for sc in scales:
            cols += [
                (f"NLL x{sc:g}", f"nll{sc:g}", ".4f"),
                (f"active x{sc:g}", f"act{sc:g}", ".3f"),
            ]
        trows = []
        for d in truncating:
            r = {"label": d["label"]}
            for x in d["truncation"]["results"]:
                r[f"nll{x['threshold_scale']:g}"] = x["nll"]
                r[f"act{x['threshold_scale']:g}"] = x["active_experts"]
            trows.append(r)
        md += [
            "Truncating routers have no K: their sweep multiplies every layer's trained "
            "threshold by a scale (x1: as trained; smaller keeps more experts, up to the cap) "
            "and reports the validation NLL and the active experts per token.",
            "",
            _md_table(cols, trows),
            "",
        ]
    if budget_file is not None:
        md += [
            "Every sweep against the compute it uses:",
            "",
            "![NLL against active experts](nll_vs_active.png)",
            "",
        ]
    md += [
        "## Training curves",
        "",
        "![discarded mass and active experts over training tokens](training_curves.png)",
        "",
        "## Top-2 score gaps",
        "",
        "Gap z(1) - z(2) of every token-layer state, means over the MoE layers. A sparse "
        "map leaves a single expert with weight exactly when the gap reaches its threshold, "
        "so its singleton rate equals its share of gaps at or above the threshold; the "
        "histograms draw the threshold as a dashed line.",
        "",
        _md_table(GAP_COLUMNS, [d["row"] for d in data if not d["dense"]])
        if any(not d["dense"] for d in data)
        else "No MoE runs.",
        "",
    ]
    for d in data:
        if d["label"] in gap_files:
            md += [f"![top-2 gaps of {d['label']}]({gap_files[d['label']].name})", ""]
    moe = [d for d in data if not d["dense"]]
    md += [
        "## Temperature and certified radii",
        "",
        "The gate g(x) = softmax(W x / tau) of each router is ||W||_2 / (2 tau)-Lipschitz, "
        "and no input closer to a token x than r(x) = sqrt(2) tau m(x) / ||W||_2 "
        "(m: gap between the two largest gate values) changes its top-1 expert, whatever "
        "the map. Means over the MoE layers of the newest checkpoint, radii over the "
        "validation tokens; radius/||x|| is the radius relative to the norm of the token "
        "the router saw, tied % the share of tokens with radius 0.",
        "",
        _md_table(CERT_COLUMNS, [d["row"] for d in moe]) if moe else "No MoE runs.",
        "",
    ]
    if radii_file is not None:
        md += ["![certified top-1 radii](radii.png)", ""]
    if temperature_file is not None:
        md += [
            "Temperature and Lipschitz constant over training (band: min to max over the "
            "layers). A fixed temperature lets the constant grow with ||W||_2; the "
            "Lipschitz schedule holds it.",
            "",
            "![temperature and Lipschitz constant over training](temperature.png)",
            "",
        ]
    lapsum = [d for d in moe if d["row"]["map"] == "lapsum"]
    if lapsum:
        md += [
            "## LapSum routers",
            "",
            "Per layer: the LapSum budget k_l (learned under a global budget when "
            "allocation is learned), the cut on the map's values that truncates it, and "
            "the active experts per token it gives on the validation split.",
            "",
        ]
        for d in lapsum:
            kind = "learned allocation" if d["row"].get("learned_allocation") else "fixed k"
            md += [f"### {d['label']} ({kind})", "", _md_table(LAPSUM_COLUMNS, d["layers"]), ""]
        if allocation_file is not None:
            md += [
                "Over training: the learned budgets k_l (solid) and the active experts they "
                "give (dashed); for a fixed k, the active experts per layer and k (dotted):",
                "",
                "![learned allocation over training](allocation.png)",
                "",
            ]
    md += ["## Expert load", ""]
    for d in data:
        if d["label"] in load_files:
            md += [f"![expert load of {d['label']}]({load_files[d['label']].name})", ""]
    if not load_files:
        md += ["No MoE runs.", ""]
    tex = [
        "% moelab report tables: \\usepackage{booktabs,graphicx}, then \\input{tables.tex}",
        latex_table(ROUTING_COLUMNS, rows, "Routing statistics (means over MoE layers)."),
    ]
    if any(d["sweep"] for d in data):
        tex.append(latex_table(sweep_cols, sweep_rows, "Inference-time budget sweep (NLL)."))
    if moe:
        tex.append(
            latex_table(
                GAP_COLUMNS,
                [d["row"] for d in moe],
                "Top-2 score gaps and singleton rates (means over MoE layers).",
            )
        )
    if moe:
        tex.append(
            latex_table(
                CERT_COLUMNS,
                [d["row"] for d in moe],
                "Temperature, gate Lipschitz constant and certified top-1 radii.",
            )
        )
    tables = out / "tables.tex"
    tables.write_text("\n\n".join(tex) + "\n", encoding="utf-8")
    md += [
        "## LaTeX",
        "",
        "`tables.tex` holds the routing, budget-sweep and certification tables as booktabs tables.",
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(md), encoding="utf-8")
    return {
        "report": str(report),
        "files": [str(f) for f in files],
        "tables": str(tables),
        "rows": rows,
    }


def write_report(
    runs: Sequence[str | Path],
    out: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
) -> Path:
    """Write ``out/report.md`` and its PNG figures comparing ``runs``; return the path
    of report.md. See the module docstring."""
    return Path(build_report(runs, out, top_ks, max_batches, threshold_scales)["report"])
