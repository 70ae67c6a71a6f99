"""``moelab report``: a Markdown + PNG comparison of trained runs.

    write_report(["runs/softmax", "runs/sparsemax"], "report")   # -> report/report.md

For each run: the training and validation loss of ``metrics.jsonl``, the routing
statistics of the newest checkpoint (:func:`moelab.diagnostics.stats`), the
inference-time budget sweep (:func:`moelab.diagnostics.evaluate`, the K values that fit
the model), the top-2 logit gaps of every MoE layer from the same pass as the statistics,
and the routing curves of ``metrics.jsonl``. The folder ``out`` gets ``report.md`` and
the figures it embeds:

    loss_curves.png          training and validation loss over training tokens, every
                             run in one figure (first in report.md)
    loss_vs_k.png            NLL against K, one line per run
    nll_vs_active.png        NLL against active experts: the K sweeps and, for
                             truncating routers, the threshold-scale sweeps
    training_curves.png      discarded mass and active experts over training tokens
                             (a panel that is flat for every run is left out and
                             report.md states its value instead)
    gaps.png                 top-2 gap histograms of all runs on one shared x range,
                             one panel per MoE layer (or group of layers by depth), the
                             share beyond the range and at or above each map's
                             threshold in the legend (MoE runs)
    load_<run>.png           expert load shares per MoE layer (MoE runs)
    radii.png                certified top-1 radii, relative to the token norm (MoE runs)
    temperature.png          temperature and gate Lipschitz constant over training
                             (runs that logged them; flat panels left out as above)
    allocation.png           learned per-layer budgets k_l and active experts over
                             training (truncating runs)
    tables.tex               the routing, budget-sweep, gap and certification tables
                             as LaTeX (booktabs)
    downstream_vs_k.png      downstream accuracy against K, when runs hold
                             ``downstream.json`` of ``moelab downstream`` at several K
                             (the section's tables: :mod:`moelab.report.downstream`)

The folder ``out`` is new, empty, or one an earlier report made (``.moelab-report.json``
marks it; running the report again refreshes it); a study's or a run's folder needs
``overwrite=True`` (``--overwrite``) and any other folder is refused
(:mod:`moelab.runs.folders`).

Every table is also returned as numbers (:func:`build_report`'s ``"tables"``). Dense
runs (no MoE layers) get "-" wherever routing does not apply.

Saved results stand next to runs: a JSON file of ``moelab stats --hf DIR --json`` or
``moelab eval --hf DIR --json`` (:func:`read_result` tells which by its keys) is an entry
labelled by the name of its model directory (its ``"run"``); a stats file and an eval
file with the same ``"run"`` make one entry. A stats file fills the routing, per-layer,
gap and load tables as a run's statistics would; an eval file fills the budget sweep.
Sections that need training curves, a checkpoint, the temperature or certified radii
leave such an entry out with a note.

Shape suffixes: T, E (moelab.shapes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.diagnostics import evaluate, evaluate_truncation, load_run, stats
from moelab.report.builder import SECTIONS, ReportBuilder, ReportSection
from moelab.report.sections import (
    CERT_COLUMNS,
    GAP_COLUMNS,
    LAPSUM_COLUMNS,
    LAYER_COLUMNS,
    METRIC_COLUMNS,
    ROUTING_COLUMNS,
    SWEEP_DETAIL_COLUMNS,
)
from moelab.report.table import Table, latex_table
from moelab.routing.measures import top2_gap
from moelab.runs import corpus_id, read_metrics, read_summary
from moelab.runs.folders import Staging, check_out, read_marker, write_marker

__all__ = [
    "CERT_COLUMNS",
    "GAP_COLUMNS",
    "LAPSUM_COLUMNS",
    "LAYER_COLUMNS",
    "METRIC_COLUMNS",
    "ROUTING_COLUMNS",
    "SECTIONS",
    "SWEEP_DETAIL_COLUMNS",
    "ReportBuilder",
    "ReportSection",
    "Table",
    "build_report",
    "collect_result",
    "collect_run",
    "format_routing_table",
    "latex_table",
    "read_result",
    "write_report",
]

THRESHOLD_SCALES = (0.5, 1.0, 1.5, 2.0)
"""Default threshold scales of the truncation sweep (1: as trained)."""


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
    """Run folder names, made unique with a counter where two runs share one; a study's
    seed folder (``OUT/runs/ARM/seed0``) is named with its arm (``ARM_seed0``)."""
    labels: list[str] = []
    for p in runs:
        name = p.name
        if re.fullmatch(r"seed\d+", name) and p.resolve().parent.name:
            name = f"{p.resolve().parent.name}_{name}"
        base = _slug(name)
        label, i = base, 2
        while label in labels:
            label, i = f"{base}-{i}", i + 1
        labels.append(label)
    return labels


@contextmanager
def _layer_gaps(model: torch.nn.Module) -> Iterator[list[list[np.ndarray]]]:
    """While open, collect the top-2 logit gaps z(1) - z(2) of every token each MoE layer's
    router sees, one list of chunks per MoE layer (forward hooks on the routers, so the
    gaps come from the same pass as the statistics). Rows whose top logit is -inf are left
    out, as in ``stats(gaps=True)``, which pools the layers."""
    layers = list(model.moe_layers)  # type: ignore[arg-type]
    chunks: list[list[np.ndarray]] = [[] for _ in layers]

    def keep(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            gap_T = top2_gap(out.logits_TE.detach().float())  # NaN: every expert masked
            chunks[i].append(gap_T[~gap_T.isnan()].cpu().numpy())

        return hook

    handles = [layer.router.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        yield chunks
    finally:
        for h in handles:
            h.remove()


def collect_run(
    run: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
    step: int | None = None,
) -> dict[str, Any]:
    """Everything the report shows about one run, as plain data: ``{"run", "dense",
    "row" (routing-table row), "layers", "sweep" (evaluate's document or None),
    "truncation" (evaluate_truncation's, for truncating routers, or None), "gaps" (all
    top-2 gaps), "gap_layers" (the gaps of each MoE layer), "gap_blocks" (the block of
    each MoE layer), "n_blocks", "radii" (numpy arrays or None), "threshold",
    "metrics", "tokens_per_step" (batch_size x seq_len of config.json), "summary",
    "checkpoint_step"}``. The run is loaded once: the checkpoint of ``step``, or the
    newest. The routing table's val_loss is training's final one only when that is the
    checkpoint measured; otherwise the loss measured on the checkpoint; its val_tokens
    are the tokens that loss covers (training's ``eval_batches``, or the statistics')."""
    run = Path(run)
    loaded = load_run(run, step)  # once: stats and the sweep reuse it
    summary = read_summary(run)
    if summary.get("steps") != loaded.step:  # training's final numbers are another model's
        summary = {}
    mc = loaded.model.config
    rc = mc.router_config()
    rule = rc.selection_rule
    dense = not loaded.model.moe_layers
    row: dict[str, Any] = {
        "map": None if dense else rc.map,
        "alpha": None if dense else rc.alpha,
        # a truncating router has no K: its count of experts varies per token
        "top_k": (
            None if dense or rule.sweep != "top_k" else int(loaded.model.moe_layers[0].router.top_k)
        ),
        "val_loss": summary.get("val_loss"),
        # what val_loss covers: training's evaluation (eval_batches, the first batches of
        # the validation split), or the statistics' batches where it falls back to them
        "val_tokens": summary.get("val_tokens") if summary.get("val_loss") is not None else None,
    }
    result: dict[str, Any] = {
        "run": str(run),
        "dense": dense,
        "metrics": read_metrics(run),
        "corpus": corpus_id(run),
        "tokens_per_step": loaded.config.batch_size * loaded.config.seq_len,
        "summary": summary,
        "checkpoint_step": loaded.step,
        "layers": [],
        "sweep": None,
        "truncation": None,
        "truncating": not dense and rule.truncates,
        "budget_k": None if dense else (rc.lapsum_k if rc.lapsum_k is not None else rc.top_k),
        "gaps": None,
        "gap_layers": None,
        "gap_blocks": list(mc.moe_indices),
        "n_blocks": mc.n_layers,
        "radii": None,
        "threshold": None,
    }
    if not dense:
        with _layer_gaps(loaded.model) as chunks:
            st = stats(loaded, max_batches=max_batches, radii=True)
        result["gap_layers"] = [np.concatenate(c) if c else np.zeros(0) for c in chunks]
        result["gaps"] = np.concatenate(result["gap_layers"])
        result["radii"] = st.pop("radii")
        row["schedule"] = st["schedule"]
        row["learned_allocation"] = st["learned_allocation"]
        row.update(_with_pct(st["mean"]))
        row["alpha"] = st["alpha"]
        if row["val_loss"] is None:
            row["val_loss"], row["val_tokens"] = st["nll"], st["tokens"]
        result["stats"] = st
        result["layers"] = [_with_pct(lay) for lay in st["layers"]]
        result["threshold"] = st["mean"].get("threshold")
        ks = [int(k) for k in top_ks if 1 <= int(k) <= mc.n_experts]
        if ks and rule.sweep == "top_k":
            result["sweep"] = evaluate(loaded, ks, max_batches=max_batches)
        if rule.sweep == "threshold_scale" and threshold_scales:
            result["truncation"] = evaluate_truncation(
                loaded, threshold_scales, max_batches=max_batches
            )
    result["row"] = row
    return result


RESULT_KEYS = {
    "stats": ("run", "mean", "layers"),
    "eval": ("run", "trained_top_k", "results"),
}
"""The keys that make a JSON file a saved ``moelab stats`` or ``moelab eval`` result."""


def read_result(path: str | Path) -> tuple[str, dict[str, Any]]:
    """``("stats" | "eval", document)`` of a JSON file saved from ``moelab stats --hf ...
    --json`` or ``moelab eval --hf ... --json``, told apart by their keys
    (:data:`RESULT_KEYS`). Raises ValueError, in one line, for a file that is neither."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path}: not a readable JSON file ({type(err).__name__}); give a run folder or "
            "the JSON of `moelab stats --hf ... --json` / `moelab eval --hf ... --json`"
        ) from None
    if isinstance(doc, dict):
        for kind, keys in RESULT_KEYS.items():
            if all(k in doc for k in keys) and isinstance(doc[keys[-1]], list):
                return kind, doc
    raise ValueError(
        f"{path}: neither a `moelab stats --hf ... --json` result (keys run, mean, layers) "
        "nor a `moelab eval --hf ... --json` result (keys run, trained_top_k, results)"
    )


def collect_result(
    stats_doc: dict[str, Any] | None, eval_doc: dict[str, Any] | None
) -> dict[str, Any]:
    """A report entry, shaped as :func:`collect_run`'s, from the saved statistics and/or
    budget sweep of one model (``"result": True``; no metrics, checkpoint, gaps or radii).
    The routing row is the statistics' mean; ``val_loss`` is the NLL on the result's text
    (the stats file's, else the eval file's at the model's own K)."""
    if stats_doc is None and eval_doc is None:
        raise ValueError("give a stats or an eval result")
    first = stats_doc if stats_doc is not None else eval_doc
    assert first is not None
    row: dict[str, Any] = {"map": first.get("map"), "alpha": first.get("alpha")}
    layers: list[dict[str, Any]] = []
    threshold = None
    if stats_doc is not None:
        row["top_k"] = stats_doc.get("top_k")
        row["val_loss"], row["val_tokens"] = stats_doc.get("nll"), stats_doc.get("tokens")
        row.update(_with_pct(stats_doc["mean"]))
        layers = [_with_pct(lay) for lay in stats_doc["layers"]]
        threshold = stats_doc["mean"].get("threshold")
    else:
        assert eval_doc is not None
        row["top_k"] = eval_doc["trained_top_k"]
        own = [x for x in eval_doc["results"] if x["top_k"] == eval_doc["trained_top_k"]]
        row["val_loss"] = own[0]["nll"] if own else None
        row["val_tokens"] = own[0].get("tokens") if own else None
    return {
        "run": str(first["run"]),
        "result": True,
        "stats": stats_doc,
        "dense": False,
        "metrics": [],
        "tokens_per_step": None,
        "summary": {},
        "layers": layers,
        "sweep": eval_doc,
        "truncation": None,
        "truncating": False,
        "budget_k": None,
        "gaps": None,
        "gap_layers": None,
        "gap_blocks": [],
        "n_blocks": 0,
        "radii": None,
        "threshold": threshold,
        "row": row,
    }


def _entries(runs: Sequence[str | Path]) -> list[tuple[Path, dict[str, Any] | None]]:
    """The report's entries in the order given: ``(run folder, None)`` for a folder, and
    ``(model directory, {"stats": doc, "eval": doc, "files": [...]})`` for the result
    files of one model (paired by their ``"run"``), at the place of its first file. Every
    file is read here, before anything is computed."""
    entries: list[tuple[Path, dict[str, Any] | None]] = []
    by_model: dict[str, dict[str, Any]] = {}
    for r in runs:
        p = Path(r)
        if not p.is_file():
            entries.append((p, None))
            continue
        kind, doc = read_result(p)
        key = str(doc["run"])
        if key not in by_model:
            by_model[key] = {"stats": None, "eval": None, "files": []}
            entries.append((Path(key), by_model[key]))
        group = by_model[key]
        if group[kind] is not None:
            raise ValueError(
                f"{p}: a second `moelab {kind}` result for the model {key} (already read: "
                f"{', '.join(group['files'])}); give at most one stats and one eval file "
                "per model"
            )
        group[kind] = doc
        group["files"].append(str(p))
    return entries


def format_routing_table(rows: Sequence[dict[str, Any]]) -> str:
    """The routing-statistics table as fixed-width text (one row per run)."""
    return Table(ROUTING_COLUMNS, rows).text()


def _latex(rep: ReportBuilder) -> Path:
    tex = ["% moelab report tables: \\usepackage{booktabs,graphicx}, then \\input{tables.tex}"]
    tex += [t.latex() for t in rep.tables.values() if t.caption]
    path = rep.out / "tables.tex"
    path.write_text("\n\n".join(tex) + "\n", encoding="utf-8")
    rep.md += [
        "## LaTeX",
        "",
        "`tables.tex` holds the routing, budget-sweep, gap and certification tables as "
        "booktabs tables.",
        "",
    ]
    return path


def build_report(
    runs: Sequence[str | Path],
    out: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
    step: int | None = None,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``out/report.md``, its figures and ``out/tables.tex``; return ``{"report":
    path, "files": [the PNGs], "latex": tables.tex, "tables": {name: [row, ...]},
    "rows": [routing-table rows]}`` (paths as strings).

    ``out`` must be new, empty or a folder an earlier report made (it is refreshed);
    ``overwrite``: also a study's or a run's folder. Anything else raises
    FileExistsError before anything is computed (see :mod:`moelab.runs.folders`). The new
    files are built in a temporary folder inside ``out`` and renamed into it at the end
    (report.md last), so a failure leaves the earlier report whole; files of the earlier
    report that the new one does not write are removed.

    ``runs``: run folders and JSON files saved from ``moelab stats --hf ... --json`` or
    ``moelab eval --hf ... --json`` (see the module docstring; a JSON that is neither
    raises ValueError before anything is computed). ``step``: every run folder's
    checkpoint of that step instead of its newest (the report names each run's step).

    ``"tables"`` holds every table of report.md as numbers: "routing", "layers" (every
    run's per-layer table, with a run column), "budget_sweep", "budget_sweep_detail"
    (every sweep per K, when a saved eval result is given), "truncation_sweep"
    (truncating runs only), "gaps", "certification", "lapsum" (LapSum runs only),
    "active_experts" (per layer, the share of tokens computing n experts),
    "downstream" and "downstream_routing" (runs holding a ``downstream.json``),
    each a list of rows keyed by the column headers of report.md, unrounded, with None
    where a value is undefined, NaN or infinite (strict JSON). ``"corpora"``: the corpus
    each run folder trained on (:func:`moelab.runs.corpus_id`, by label; None without a
    record); runs of different corpora are named in a note at the top of report.md."""
    if not runs:
        raise ValueError("give at least one run folder")
    out = Path(out)
    folder = check_out(out, "report", overwrite=overwrite)  # before anything is read
    entries = _entries(runs)  # reads every result file first
    before = (read_marker(out, "report") if "report" in folder.kinds else None) or {}
    earlier = [str(f) for f in before.get("files", []) if isinstance(f, str)]
    # the marker first: a report that fails half way still leaves its own folder
    write_marker(out, "report", runs=[str(r) for r in runs], files=earlier)
    data = []
    for label, (p, saved) in zip(_labels([p for p, _ in entries]), entries, strict=True):
        if saved is None:
            d = collect_run(p, top_ks, max_batches, threshold_scales, step)
        else:
            d = collect_result(saved["stats"], saved["eval"])
            d["files"] = saved["files"]
        d["label"] = label
        d["row"]["label"] = label
        data.append(d)

    staging = Staging(out)  # every new file is built here, then renamed into out
    try:
        written = _write(staging, data, max_batches)
    finally:
        staging.discard()
    # files of the previous report that this one does not write (a run left out)
    for name in sorted(set(earlier) - set(written["names"])):
        stale = out / name
        if "/" not in name and name.endswith(_REPORT_FILES) and stale.is_file():
            stale.unlink()
    write_marker(out, "report", runs=[str(r) for r in runs], files=written["names"])
    return written["doc"]


_REPORT_FILES = (".png", ".md", ".tex")
"""What a report writes (the stale files of an earlier report it may remove)."""


def _write(staging: Staging, data: list[dict[str, Any]], max_batches: int | None) -> dict:
    """Build report.md, its figures and tables.tex in ``staging`` and move them into its
    folder (report.md last); return build_report's document and the names written."""
    rep = ReportBuilder(staging.dir, data, max_batches, md=["# moelab report", ""])
    rep.md += ["Runs:", ""]
    for d in data:
        if d.get("result"):
            files = ", ".join(f"`{f}`" for f in d["files"])
            rep.md.append(f"- `{d['label']}`: saved results of the model `{d['run']}` ({files})")
        else:
            step = d["checkpoint_step"]
            rep.md.append(f"- `{d['label']}`: `{d['run']}`, checkpoint of step {step}")
    rep.md += [""]
    rep.md += _corpus_note(data)
    rep.build()
    tables = _latex(rep)
    (staging.dir / "report.md").write_text("\n".join(rep.md), encoding="utf-8")
    names = staging.commit(last=("tables.tex", "report.md"))
    doc = {
        "report": str(staging.out / "report.md"),
        "files": [str(staging.final(f)) for f in rep.files],
        "latex": str(staging.final(tables)),
        "tables": {name: t.records() for name, t in rep.tables.items()},
        "rows": [d["row"] for d in data],
        # NOTE: each run folder's corpus (None: no record); several: report.md notes it
        "corpora": {d["label"]: d.get("corpus") for d in data if not d.get("result")},
    }
    return {"doc": doc, "names": names}


def _corpus_note(data: list[dict[str, Any]]) -> list[str]:
    """A paragraph of report.md when the runs were trained on different corpora
    (config.json's ``run_info.corpus``, :func:`moelab.runs.corpus_id`): their losses are
    then measured on different text and tokens, and do not compare. Names the runs of
    each corpus; [] when they share one."""
    groups: dict[str, list[str]] = {}
    for d in data:
        if not d.get("result"):
            groups.setdefault(d.get("corpus") or "unknown", []).append(d["label"])
    known = [c for c in groups if c != "unknown"]
    if len(known) < 2:
        return []
    parts = [
        f"corpus `{c}`: " + ", ".join(f"`{label}`" for label in labels)
        for c, labels in groups.items()
        if c != "unknown"
    ]
    if "unknown" in groups:
        parts.append(
            "no record of its corpus: " + ", ".join(f"`{label}`" for label in groups["unknown"])
        )
    return [
        f"**Note: these runs were trained on {len(known)} different corpora** (tokenizer and "
        "train/validation split, as each run's config.json records them), so their losses and "
        "NLLs are measured on different text and tokens and do not compare across corpora: "
        + "; ".join(parts)
        + ". (Runs of one source with different seeds split it differently unless they set "
        "data_seed.)",
        "",
    ]


def write_report(
    runs: Sequence[str | Path],
    out: str | Path,
    top_ks: Sequence[int] = (1, 2, 4, 8),
    max_batches: int | None = None,
    threshold_scales: Sequence[float] = THRESHOLD_SCALES,
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``out/report.md`` and its PNG figures comparing ``runs``; return the path
    of report.md. See the module docstring and :func:`build_report` (``overwrite``)."""
    doc = build_report(runs, out, top_ks, max_batches, threshold_scales, overwrite=overwrite)
    return Path(doc["report"])
