"""The sections of ``moelab report``'s report.md (the loss curves, the routing
statistics, the budget sweeps, the training curves, the gaps, the certification, the
LapSum routers, the active experts per token and the expert load), each a function of the
:class:`~moelab.report.builder.ReportBuilder`, and their columns. The order they run in
is :data:`moelab.report.builder.SECTIONS`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab import maps
from moelab._format import fmt
from moelab.report import plots
from moelab.report.builder import ReportBuilder
from moelab.report.table import Columns, Table

__all__ = [
    "CERT_COLUMNS",
    "GAP_COLUMNS",
    "LAPSUM_COLUMNS",
    "LAYER_COLUMNS",
    "METRIC_COLUMNS",
    "ROUTING_COLUMNS",
    "SWEEP_DETAIL_COLUMNS",
]

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
    ("val tokens", "val_tokens", ",d"),
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

# every budget sweep per K (moelab runs and saved eval results alike)
SWEEP_DETAIL_COLUMNS: list[tuple[str, str, str]] = [
    ("run", "label", "s"),
    ("K", "top_k", "d"),
    ("trained", "trained", "s"),
    ("NLL", "nll", ".4f"),
    ("retained mass", "retained_mass", ".4f"),
    ("contributors", "contributors", ".3f"),
    ("active experts", "active_experts", ".3f"),
]

LAYER_COLUMNS: list[tuple[str, str, str]] = [
    ("layer", "layer", "d"),
    ("block", "block", "d"),
    *METRIC_COLUMNS,
    ("gap p50", "gap_p50", ".3f"),
    ("active", "active_experts", ".3f"),
]


def _per_run(columns: Columns, data: Sequence[dict[str, Any]], key: str) -> Table:
    """The per-run tables under ``key`` stacked into one, with a leading run column."""
    rows = [{**row, "label": d["label"]} for d in data for row in d[key]]
    return Table([("run", "label", "s"), *columns], rows)


def _panel_note(panel: plots.Panel) -> str:
    """The sentence that replaces a panel left out because it is flat for every run."""
    values = panel.constants()
    distinct = {fmt(v, ".4g") for v in values.values()}
    if len(distinct) == 1:
        return (
            f"{panel.what[0].upper()}{panel.what[1:]} is {distinct.pop()} for every run at "
            "every logged step, so its panel is left out."
        )
    each = ", ".join(f"{fmt(v, '.4g')} ({label})" for label, v in values.items())
    return (
        f"{panel.what[0].upper()}{panel.what[1:]} stays constant in every run ({each}), so "
        "its panel is left out."
    )


def _curve_figure(
    panels: Sequence[plots.Panel], path: Path, files: list[Path]
) -> tuple[Path | None, list[plots.Panel], list[str]]:
    """Draw the panels that are not flat for every run into ``path``; return the file
    (None when every panel is flat), the drawn panels and a note per left-out panel."""
    drawn = [p for p in panels if not p.flat]
    notes = [_panel_note(p) for p in panels if p.flat]
    out = plots.plot_panels(drawn, path)
    if out is not None:
        files.append(out)
    return out, drawn, notes


# --- the sections of report.md (their order: builder.SECTIONS) ---------------------


def _loss_section(rep: ReportBuilder) -> None:
    panel = plots.loss_panel(rep.data)
    rep.md += ["## Training and validation loss", ""]
    rep.md += rep.skip_note("training curves")
    if panel is None:
        rep.md += ["No run logged a loss.", ""]
        return
    rep.files.append(plots.plot_panels([panel], rep.out / "loss_curves.png", ncols=1))
    has_val = any(s.label.endswith(": val") for s in panel.series)
    rep.md += [
        "Loss in nats per token against training tokens, from each run's `metrics.jsonl`: "
        "the training loss on the batch of each logged step"
        + (
            ", and the validation loss wherever training evaluated (a row logged without "
            "a token count is placed at step x batch_size x seq_len of the run's "
            "`config.json`)."
            if has_val
            else "; no run logged a validation loss."
        ),
        "",
        "![training and validation loss over training tokens](loss_curves.png)",
        "",
    ]


def _batches_note(rep: ReportBuilder) -> str:
    """What the statistics and the sweeps of the report cover: its batches and, when
    every run's are the same, their tokens."""
    n = rep.max_batches
    note = "all validation batches" if n is None else f"{n} batch{'' if n == 1 else 'es'}"
    tokens = {d["stats"]["tokens"] for d in rep.data if d.get("stats") and not d.get("result")}
    return note + (f", {tokens.pop():,} tokens" if len(tokens) == 1 else "")


def _routing_section(rep: ReportBuilder) -> None:
    batches_note = _batches_note(rep)
    routing = Table(
        ROUTING_COLUMNS,
        [d["row"] for d in rep.data],
        "Routing statistics (means over MoE layers).",
    )
    rep.tables["routing"] = routing
    rep.tables["layers"] = _per_run(LAYER_COLUMNS, rep.routed, "layers")
    rep.md += [
        "## Routing statistics",
        "",
        f"Newest checkpoint with its trained K, on the validation split ({batches_note}); "
        "means over the MoE layers. `val loss` is training's final validation loss, on "
        "the first `eval_batches` batches of the same split, and `val tokens` the tokens "
        "it covers: not the text of these statistics and of the budget sweep's NLL, so the "
        "two losses of one checkpoint differ by the text each is measured on (a run "
        "without training's final numbers for this checkpoint shows the NLL of these "
        "statistics instead, and their tokens). E[delta | s>=3] is the mean discarded mass "
        'over states whose support has 3 or more experts. Dense runs show "-".'
        + (
            " A saved result's row is its `moelab stats --hf` file (its own text, the "
            "model's own K; `val loss`: the NLL on that text) or, without one, its "
            "`moelab eval --hf` file's model K and NLL at that K."
            if rep.results
            else ""
        ),
        "",
        routing.markdown(),
        "",
    ]
    for d in rep.data:
        rep.md += [f"### Per layer: {d['label']}", ""]
        if d["dense"]:
            rep.md += ["Dense model: no MoE layers.", ""]
        elif d.get("result") and not d["stats"]:
            rep.md += ["No `moelab stats` result given for this model.", ""]
        else:
            rep.md += [Table(LAYER_COLUMNS, d["layers"]).markdown(), ""]


def _sweep_table(data: Sequence[dict[str, Any]]) -> Table:
    """The budget sweep: one row per run, the NLL at each K and the increase to max K."""
    all_ks = sorted({r["top_k"] for d in data if d["sweep"] for r in d["sweep"]["results"]})
    cols: list[tuple[str, str, str]] = [("run", "label", "s"), ("trained K", "tk", "d")]
    cols += [(f"NLL K={k}", f"k{k}", ".4f") for k in all_ks]
    cols.append(("increase trained K -> max K", "inc", "+.4f"))
    rows = []
    for d in data:
        sw = d["sweep"]
        r: dict[str, Any] = {"label": d["label"]}
        if sw:
            r["tk"] = sw["trained_top_k"]
            r.update({f"k{x['top_k']}": x["nll"] for x in sw["results"]})
            r["inc"] = sw["nll_increase"]
        rows.append(r)
    caption = "Inference-time budget sweep (NLL)." if any(d["sweep"] for d in data) else None
    return Table(cols, rows, caption)


def _truncation_table(truncating: Sequence[dict[str, Any]]) -> Table:
    """The threshold-scale sweep of truncating routers: NLL and active experts per scale."""
    scales = sorted({x["threshold_scale"] for d in truncating for x in d["truncation"]["results"]})
    tcols: list[tuple[str, str, str]] = [("run", "label", "s")]
    for sc in scales:
        tcols += [
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
    return Table(tcols, trows)


def _sweep_section(rep: ReportBuilder) -> None:
    data = rep.data
    sweep = rep.tables["budget_sweep"] = _sweep_table(data)
    rep.files.append(plots.plot_loss_vs_k(data, rep.out / "loss_vs_k.png"))
    rep.md += [
        "## Inference-time budget sweep",
        "",
        "The same weights run with K experts per token (validation NLL, nats per token, "
        f"on {_batches_note(rep)} of the validation split, as the routing statistics: not "
        "training's `val loss`, whose `val tokens` the routing table gives); "
        "the last column is the NLL at the largest K minus the NLL at the trained K. "
        "K values above a model's expert count are left out."
        + (
            " A saved `moelab eval --hf` result shows the K values it holds, its NLL on "
            "its own text, and the model's own K as trained K."
            if any(d["sweep"] for d in rep.results)
            else ""
        ),
        "",
        sweep.markdown(),
        "",
        "![NLL against K](loss_vs_k.png)",
        "",
    ]
    detail = [
        {
            **x,
            "label": d["label"],
            "trained": "yes" if x["top_k"] == d["sweep"]["trained_top_k"] else "no",
        }
        for d in data
        if d["sweep"]
        for x in d["sweep"]["results"]
    ]
    if detail and any(d["sweep"] for d in rep.results):  # moelab runs alone: as before
        per_k = rep.tables["budget_sweep_detail"] = Table(SWEEP_DETAIL_COLUMNS, detail)
        rep.md += [
            "Per K: the NLL, the retained mass (1 - discarded mass), the contributors and "
            "the active experts per token.",
            "",
            per_k.markdown(),
            "",
        ]
    truncating = [d for d in data if d["truncation"]]
    if truncating:
        table = rep.tables["truncation_sweep"] = _truncation_table(truncating)
        rep.md += [
            "Truncating routers have no K: their sweep multiplies every layer's trained "
            "threshold by a scale (x1: as trained; smaller keeps more experts, up to the cap) "
            "and reports the validation NLL and the active experts per token.",
            "",
            table.markdown(),
            "",
        ]
    budget_file = plots.plot_nll_vs_active(data, rep.out / "nll_vs_active.png")
    if budget_file is not None:
        rep.files.append(budget_file)
        rep.md += [
            "Every sweep against the compute it uses:",
            "",
            "![NLL against active experts](nll_vs_active.png)",
            "",
        ]


def _training_section(rep: ReportBuilder) -> None:
    path, _, notes = _curve_figure(
        plots.training_panels(rep.data), rep.out / "training_curves.png", rep.files
    )
    if path is None and not notes:
        return
    rep.md += ["## Routing during training", ""]
    rep.md += rep.skip_note("training curves")
    if path is not None:
        rep.md += [
            "![routing numbers over training tokens](training_curves.png)",
            "",
        ]
    rep.md += [*notes, ""] if notes else []


def _gap_section(rep: ReportBuilder) -> None:
    moe = rep.routed
    table = Table(
        GAP_COLUMNS,
        [d["row"] for d in moe],
        "Top-2 score gaps and singleton rates (means over MoE layers)." if moe else None,
    )
    rep.tables["gaps"] = table
    rep.md += [
        "## Top-2 score gaps",
        "",
        "Gap z(1) - z(2) of every token-layer state, means over the MoE layers. A sparse "
        "map leaves a single expert with weight exactly when the gap reaches its threshold, "
        "so its singleton rate equals its share of gaps at or above the threshold.",
        "",
        table.markdown() if moe else "No MoE runs.",
        "",
    ]
    rep.md += rep.skip_note("per-token gaps for the histograms")
    hist = plots.gap_histograms(rep.data)
    if hist is None:
        return
    rep.files.append(plots.plot_gap_histograms(hist, rep.out / "gaps.png"))
    marked = any(p["thresholds"] for p in hist["panels"])
    rep.md += [
        "The histograms of all runs share one x range, 0 to "
        f"{hist['hi']:g} (the {plots.GAP_QUANTILE:g}th percentile of all gaps, or past "
        "the largest threshold, rounded up); each legend entry gives the run's share of "
        "gaps beyond that range"
        + (
            " and its share at or above its map's threshold, which vertical lines mark."
            if marked
            else "."
        ),
        "",
        "![top-2 score gaps of every run](gaps.png)",
        "",
    ]


def _certification_section(rep: ReportBuilder) -> None:
    moe = rep.moe
    table = Table(
        CERT_COLUMNS,
        [d["row"] for d in moe],
        "Temperature, gate Lipschitz constant and certified top-1 radii." if moe else None,
    )
    rep.tables["certification"] = table
    rep.md += [
        "## Temperature and certified radii",
        "",
        "The gate g(x) = softmax(W x / tau) of each router is ||W||_2 / (2 tau)-Lipschitz, "
        "and no input closer to a token x than r(x) = sqrt(2) tau m(x) / ||W||_2 "
        "(m: gap between the two largest gate values) changes its top-1 expert, whatever "
        "the map. Means over the MoE layers of the newest checkpoint, radii over the "
        "validation tokens; radius/||x|| is the radius relative to the norm of the token "
        "the router saw, tied % the share of tokens with radius 0.",
        "",
        table.markdown() if moe else "No MoE runs.",
        "",
    ]
    rep.md += rep.skip_note("checkpoint to read the temperature and certified radii from")
    radii_file = plots.plot_radii(rep.data, rep.out / "radii.png")
    if radii_file is not None:
        rep.files.append(radii_file)
        rep.md += ["![certified top-1 radii](radii.png)", ""]
    path, drawn, notes = _curve_figure(
        plots.temperature_panels(rep.data), rep.out / "temperature.png", rep.files
    )
    if path is not None:
        band = any(s.has_band for p in drawn for s in p.series)
        rep.md += [
            "Over training"
            + (" (band: min to max over the layers)" if band else "")
            + ": a fixed temperature lets the Lipschitz constant grow with ||W||_2; the "
            "Lipschitz schedule holds it.",
            "",
            "![temperature and Lipschitz constant over training](temperature.png)",
            "",
        ]
    rep.md += [*notes, ""] if notes else []


def _lapsum_section(rep: ReportBuilder) -> None:
    lapsum = [d for d in rep.moe if maps.info(d["row"]["map"]).needs_k]
    allocation_file = plots.plot_allocation(rep.data, rep.out / "allocation.png")
    if allocation_file is not None:
        rep.files.append(allocation_file)
    if not lapsum and allocation_file is None:
        return
    rep.md += ["## LapSum routers" if lapsum else "## Truncating routers", ""]
    if lapsum:
        rep.tables["lapsum"] = _per_run(LAPSUM_COLUMNS, lapsum, "layers")
        rep.md += [
            "Per layer: the LapSum budget k_l (learned under a global budget when "
            "allocation is learned), the cut on the map's values that truncates it, and "
            "the active experts per token it gives on the validation split.",
            "",
        ]
    for d in lapsum:
        kind = "learned allocation" if d["row"].get("learned_allocation") else "fixed k"
        layers = Table(LAPSUM_COLUMNS, d["layers"]).markdown()
        rep.md += [f"### {d['label']} ({kind})", "", layers, ""]
    if allocation_file is not None:
        rep.md += [
            "Over training, per layer: the learned budget k_l and the active experts it "
            "gives, or for a fixed k the active experts against k (the legend names each "
            "line):",
            "",
            "![learned allocation over training](allocation.png)",
            "",
        ]


def _active_columns(width: int) -> list[tuple[str, str, str]]:
    """The columns of the active-experts table: the layer, its mean active experts and the
    share of tokens computing n experts, n = 0 .. width - 1."""
    cols: list[tuple[str, str, str]] = [
        ("layer", "layer", "d"),
        ("block", "block", "d"),
        ("active experts", "active_experts", ".3f"),
    ]
    return cols + [(f"n={n} %", f"n{n}", ".1f") for n in range(width)]


def _active_section(rep: ReportBuilder) -> None:
    """The distribution of active experts per token, per MoE layer (the SoftMoE paper's
    Figure 1), of every entry with routing statistics: a figure and a table per entry, and
    the table ``active_experts`` of every entry's layers (shares up to the largest count
    of active experts any layer reached)."""
    from moelab.diagnostics import active_histograms

    found, missing = [], []
    for d in rep.routed:
        try:
            found.append((d, active_histograms({"layers": d["layers"]}, shares=True)))
        except ValueError:
            missing.append(d["label"])
    if not found and not missing:
        return
    rep.md += [
        "## Active experts per token",
        "",
        "Per MoE layer, the share of tokens that compute n experts (selected, not dropped "
        "by a capacity limit, non-zero gate weight) on the tokens of the routing "
        "statistics; its mean is the layer's `active experts`. A top-K router without "
        "drops or zero weights puts every token at n = K; a truncating router, a sparse "
        "map's zero weights and capacity drops spread it (the SoftMoE paper's Figure 1).",
        "",
    ]
    if missing:
        names = ", ".join(f"`{m}`" for m in missing)
        rep.md += [f"The statistics of {names} hold no such distribution: left out here.", ""]
    reached = [n for _, shares in found for row in shares for n, v in enumerate(row) if v]
    columns = _active_columns(max(reached, default=0) + 1)
    rows = []
    for d, shares in found:
        layer_rows = [
            {**lay, "label": d["label"], **{f"n{n}": 100.0 * v for n, v in enumerate(row)}}
            for lay, row in zip(d["layers"], shares, strict=True)
        ]
        rows += layer_rows
        path = plots.plot_active_hist(d["label"], shares, rep.out / f"active_{d['label']}.png")
        rep.files.append(path)
        rep.md += [
            f"### {d['label']}",
            "",
            Table(columns, layer_rows).markdown(),
            "",
            f"![active experts per token of {d['label']}]({path.name})",
            "",
        ]
    rep.tables["active_experts"] = Table([("run", "label", "s"), *columns], rows)


def _load_section(rep: ReportBuilder) -> None:
    rep.md += ["## Expert load", ""]
    for d in rep.routed:
        path = plots.plot_load(d["label"], d["layers"], rep.out / f"load_{d['label']}.png")
        rep.files.append(path)
        rep.md += [f"![expert load of {d['label']}]({path.name})", ""]
    if not rep.routed:
        rep.md += ["No MoE runs.", ""]
