"""The analysis of the ``sparse-maps`` study (:mod:`moelab.studies.sparse_maps`): the
report's sections from what :mod:`~moelab.studies.sparse_maps.run` measured on each run
(routing statistics, the frozen-weight K sweep, downstream scores), its tables in the
paper's layouts, and the figures of :mod:`~moelab.studies.sparse_maps.figures`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moelab.studies.core import Arm, Context, Section, StudyTable
from moelab.studies.paired import findings_section
from moelab.studies.sparse_maps.figures import figures_section, training_section
from moelab.studies.sparse_maps.findings import checks, claim_arms, findings
from moelab.studies.sparse_maps.grid import SIZES
from moelab.studies.sparse_maps.run import MAX_BATCHES, is_dense, measure, measure_ood

# the routing statistics of the paper's Table 2: (header, stats field, format, percent)
ROUTING_FIELDS: list[tuple[str, str, str, bool]] = [
    ("discarded mass", "discarded_mass", ".4f", False),
    ("contributors K+", "contributors", ".3f", False),
    ("s=1 %", "singleton_rate", ".2f", True),
    ("s=2 %", "pair_rate", ".2f", True),
    ("E[delta | s>=3]", "discarded_mass_support_ge3", ".4f", False),
    ("nominal CV", "nominal_cv", ".3f", False),
    ("contrib CV", "contrib_cv", ".3f", False),
    ("contrib SD", "contrib_sd", ".4f", False),
]

# the score spread and gap percentiles of Tables 7 and 8
SCORE_FIELDS: list[tuple[str, str, str, bool]] = [
    ("RMS", "score_rms", ".3f", False),
    ("g50", "gap_p50", ".3f", False),
    ("g90", "gap_p90", ".3f", False),
    ("g99", "gap_p99", ".3f", False),
]


# ------------------------------------------------------------------------ analysis


def analyse(ctx: Context) -> list[Section]:
    """The study's sections: the main table, the routing statistics (and on
    ``ctx.eval_data``), the K sweep, training curves and figures."""
    n_batches = ctx.max_batches or MAX_BATCHES.get(ctx.scale, 16)
    moe = [a for a in ctx.arms if not is_dense(a)]
    measured: dict[str, list[dict[str, Any]]] = {}
    full: dict[str, dict[str, Any]] = {}  # collect_run of the first seed (figures)
    for arm in ctx.arms:
        ctx.say(f"sparse-maps: measuring {arm.name}")
        measured[arm.name] = [
            measure(ctx, arm, run, n_batches, full if i == 0 else None)
            for i, run in enumerate(ctx.runs[arm.name])
        ]
    ood: dict[str, list[dict[str, Any]]] = {}
    if ctx.eval_data:
        for arm in moe:
            ctx.say(f"sparse-maps: routing of {arm.name} on {ctx.eval_data}")
            ood[arm.name] = [
                measure_ood(ctx, run, ctx.eval_data, n_batches) for run in ctx.runs[arm.name]
            ]
    batches = f"the first {n_batches} validation batches of each run, in file order"
    names = claim_arms(ctx)
    sections = [
        findings_section(
            findings({m: measured[a] for m, a in names.items()}),
            checks({m: measured[a] for m, a in names.items()}),
        ),
        _main_section(ctx, measured, batches),
        _routing_section(ctx, moe, measured, "val", batches),
    ]
    if ctx.eval_data:
        sections.append(
            _routing_section(
                ctx, moe, ood, "ood", f"the first {n_batches} batches of {ctx.eval_data}"
            )
        )
    sections.append(_budget_section(ctx, moe, measured, batches))
    sections.append(_mechanism_section(ctx, moe, measured, batches))
    sections.append(_paper_section(ctx, measured, names))
    sections.append(training_section(ctx, moe))
    sections.append(figures_section(ctx, full))
    return sections


def downstream_note(measured: dict[str, list[dict[str, Any]]]) -> str:
    """The main table's sentences on the saved downstream scores: checkpoint, limit,
    runs whose scores were left out (another checkpoint) or record no step."""
    records = [m["downstream_record"] for ms in measured.values() for m in ms]
    used = [r for r in records if r["scores"]]
    limits = list(dict.fromkeys(lim for r in used for lim in r["limits"]))
    text = ""
    if used:
        text = (
            "Downstream columns come from each run's `downstream.json` (accuracy at the "
            "run's trained K, scored at its newest checkpoint; `--limit`: "
            + ", ".join(limits)
            + (" (runs differ)" if len(limits) > 1 else "")
            + ")."
        )

    def name(r: dict[str, Any]) -> str:
        return "`" + "/".join(Path(r["run"]).parts[-2:]) + "`"

    stale = [r for r in records if r["stale"]]
    if stale:
        text += (
            " Left out (scored at another checkpoint): "
            + "; ".join(
                f"{name(r)} scored at step {', '.join(map(str, r['stale']))}; newest checkpoint "
                f"{r['newest']}"
                for r in stale
            )
            + "; run `moelab downstream` on these runs again."
        )
    unknown = [r for r in records if r["unknown"]]
    if unknown:
        text += (
            " Step unknown: the scores of "
            + ", ".join(name(r) for r in unknown)
            + " record no checkpoint step (an older downstream.json) and may not be of the "
            "newest checkpoint; run `moelab downstream` on them again."
        )
    return text.strip()


# ------------------------------------------------------------------------ tables


def _values(per_seed: Sequence[dict[str, Any]], fn: Callable[[dict[str, Any]], Any]) -> list:
    out = []
    for m in per_seed:
        try:
            v = fn(m)
        except (KeyError, TypeError, IndexError):
            v = None
        out.append(None if v is None else float(v))
    return out


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


def _main_section(ctx: Context, measured: dict[str, list[dict[str, Any]]], batches: str) -> Section:
    tasks: list[str] = []
    ppl_tasks: list[str] = []
    for per_seed in measured.values():
        for m in per_seed:
            for task, score in m["downstream"].items():
                if task not in tasks:
                    tasks.append(task)
                if score.get("perplexity") is not None and task not in ppl_tasks:
                    ppl_tasks.append(task)
    columns: list[tuple[str, str, str]] = [
        ("model", "arm", "s"),
        ("active params", "active", "s"),
        ("total params", "total", "s"),
        ("val loss", "val_loss", ".4f"),
        ("perplexity", "ppl", ".2f"),
    ]
    columns += [(f"{t} (ppl)", f"ppl:{t}", ".1f") for t in ppl_tasks]
    columns += [(f"{t} %", f"acc:{t}", ".1f") for t in tasks]
    if len(tasks) >= 2:
        columns.append(("avg %", "acc_avg", ".1f"))
    rows = []
    for arm in ctx.arms:
        per_seed = measured[arm.name]
        params = per_seed[0]["active_params"]
        row: dict[str, Any] = {
            "arm": arm.label,
            "active": f"{params['active']:,}",
            "total": f"{params['total']:,}",
            "val_loss": _values(per_seed, lambda m: m["nll"]),
            "ppl": _values(per_seed, lambda m: math.exp(m["nll"])),
        }
        for t in ppl_tasks:
            row[f"ppl:{t}"] = _values(per_seed, lambda m, t=t: m["downstream"][t]["perplexity"])
        for t in tasks:
            row[f"acc:{t}"] = _values(per_seed, lambda m, t=t: _pct(m["downstream"][t]["acc"]))
        if len(tasks) >= 2:

            def avg(m: dict[str, Any]) -> float | None:
                accs = [m["downstream"].get(t, {}).get("acc") for t in tasks]
                if any(a is None for a in accs):
                    return None
                return 100.0 * sum(accs) / len(accs)

            row["acc_avg"] = _values(per_seed, avg)
        rows.append(row)
    note = downstream_note(measured) or (
        "No run has downstream results yet: `moelab downstream RUN ...` saves "
        "`RUN/downstream.json`, and running the study again adds one accuracy column per "
        "task here (the paper's LAMBADA and OLMES columns)."
    )
    table = StudyTable(
        "main",
        "Predictive quality (the paper's Table 1 layout)",
        columns,
        rows,
        note=note,
    )
    text = (
        "Validation loss (nats per token) of the newest checkpoint with its trained K on "
        f"{batches}, and its perplexity exp(loss) (per seed, then mean ± sd). Dense "
        "references, where trained, match the MoE model's total parameters with every "
        "parameter active. Parameters are counted as `moelab params` counts them, with the "
        "run's trained vocabulary."
    )
    return Section("Predictive quality", text, [table])


def _routing_section(
    ctx: Context,
    moe: list[Arm],
    measured: dict[str, list[dict[str, Any]]],
    source: str,
    where: str,
) -> Section:
    suffix = "" if source == "val" else "_ood"
    on = "" if source == "val" else " (out-of-domain text)"
    routing_cols, gap_cols, spread_cols, percent = _routing_columns(source)
    routing_rows, gap_rows, spread_rows = _routing_rows(
        moe, measured, source, gap_cols, spread_cols, percent
    )
    tables = [
        StudyTable(
            f"routing{suffix}",
            f"Routing statistics{on} (Table 2 layout; means over MoE layers)",
            routing_cols,
            routing_rows,
        ),
        StudyTable(
            f"gap_fractions{suffix}",
            f"Top-2 gaps against the singleton thresholds{on} (Table 5 layout)",
            gap_cols,
            gap_rows,
            note="For a sparse map the share of gaps at or above its own threshold equals "
            "its singleton rate; softmax has no finite threshold.",
        ),
        StudyTable(
            f"score_spread{suffix}",
            f"Score spread and top-2 gap percentiles{on} (Table 7 layout)",
            spread_cols,
            spread_rows,
        ),
        _per_layer_table(
            f"per_layer_routing{suffix}",
            f"Routing statistics per MoE layer{on} (Table 6 layout)",
            moe,
            measured,
            ROUTING_FIELDS,
        ),
        _per_layer_table(
            f"per_layer_scores{suffix}",
            f"Score spread and gap percentiles per MoE layer{on} (Table 8 layout)",
            moe,
            measured,
            SCORE_FIELDS,
        ),
    ]
    text = (
        f"The newest checkpoint of every MoE run with its trained K, on {where}. Discarded "
        "mass: the map's mass outside the selected experts; contributors K+: selected "
        "experts with a positive weight; s=1 / s=2: states (token x MoE layer) whose map "
        "support has one / two experts; E[delta | s>=3]: the discarded mass of states with "
        "a larger support; nominal / contrib CV: coefficient of variation of the expert "
        "loads counting every selection / only positive-weight ones; contrib SD: standard "
        "deviation of the contributor load shares. RMS: root mean square of the centred "
        "scores; g50, g90, g99: percentiles of the top-2 score gap z(1) - z(2). Per-layer "
        "tables name each MoE layer by its transformer block, counting from 0."
    )
    title = "Routing statistics" if source == "val" else "Routing on the out-of-domain text"
    return Section(title, text, tables)


def _routing_columns(
    source: str,
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]], list[tuple[str, str, str]], set]:
    """The columns of the routing, gap and spread tables, and the fields shown in %."""
    routing_cols: list[tuple[str, str, str]] = [("map", "arm", "s")]
    if source == "ood":
        routing_cols.append(("NLL", "nll", ".4f"))
    routing_cols += [(h, f, spec) for h, f, spec, _ in ROUTING_FIELDS]
    gap_cols: list[tuple[str, str, str]] = [
        ("map", "arm", "s"),
        ("threshold", "threshold", "s"),
        ("g>=1 %", "frac_gap_ge1", ".3f"),
        ("g>=2 %", "frac_gap_ge2", ".3f"),
        ("own threshold %", "frac_gap_ge_threshold", ".3f"),
        ("singleton %", "singleton_rate", ".3f"),
    ]
    spread_cols: list[tuple[str, str, str]] = [("map", "arm", "s"), ("threshold", "threshold", "s")]
    spread_cols += [(h, f, spec) for h, f, spec, _ in SCORE_FIELDS]
    spread_cols.append(("singletons %", "singleton_rate", ".2f"))
    percent = {f for _, f, _, p in ROUTING_FIELDS if p} | {
        "frac_gap_ge1",
        "frac_gap_ge2",
        "frac_gap_ge_threshold",
        "singleton_rate",
    }
    return routing_cols, gap_cols, spread_cols, percent


def _routing_rows(
    moe: list[Arm],
    measured: dict[str, list[dict[str, Any]]],
    source: str,
    gap_cols: list[tuple[str, str, str]],
    spread_cols: list[tuple[str, str, str]],
    percent: set,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of the routing, gap and spread tables: one per MoE arm."""

    def mean_value(field: str) -> Callable[[dict[str, Any]], Any]:
        def get(m: dict[str, Any]) -> Any:
            v = m["mean"].get(field)
            return _pct(v) if field in percent and v is not None else v

        return get

    routing_rows, gap_rows, spread_rows = [], [], []
    for arm in moe:
        per_seed = measured[arm.name]
        thr = per_seed[0]["mean"].get("threshold")
        threshold = "-" if thr is None else f"{thr:g}"
        row: dict[str, Any] = {"arm": arm.label}
        if source == "ood":
            row["nll"] = _values(per_seed, lambda m: m["nll"])
        row.update({f: _values(per_seed, mean_value(f)) for _, f, _, _ in ROUTING_FIELDS})
        routing_rows.append(row)
        gap_rows.append(
            {
                "arm": arm.label,
                "threshold": threshold,
                **{f: _values(per_seed, mean_value(f)) for _, f, _ in gap_cols[2:]},
            }
        )
        spread_rows.append(
            {
                "arm": arm.label,
                "threshold": threshold,
                **{f: _values(per_seed, mean_value(f)) for _, f, _ in spread_cols[2:]},
            }
        )
    return routing_rows, gap_rows, spread_rows


def _per_layer_table(
    key: str,
    title: str,
    moe: list[Arm],
    measured: dict[str, list[dict[str, Any]]],
    fields: list[tuple[str, str, str, bool]],
) -> StudyTable:
    blocks = sorted({lay["block"] for arm in moe for lay in measured[arm.name][0]["layers"]})
    columns: list[tuple[str, str, str]] = [("statistic", "stat", "s"), ("map", "arm", "s")]
    # one format per column: the rows mix statistics, so the widest precision is used
    columns += [(f"block {b}", f"b{b}", ".4f") for b in blocks]
    rows = []
    for header, field, _, percent in fields:
        for arm in moe:
            # NOTE: a "|" in a text cell would split the Markdown row
            row: dict[str, Any] = {"stat": header.replace(" | ", " given "), "arm": arm.label}
            for b in blocks:

                def get(
                    m: dict[str, Any], b: int = b, field: str = field, percent: bool = percent
                ) -> Any:
                    lay = next(x for x in m["layers"] if x["block"] == b)
                    v = lay.get(field)
                    return _pct(v) if percent and v is not None else v

                row[f"b{b}"] = _values(measured[arm.name], get)
            rows.append(row)
    return StudyTable(key, title, columns, rows)


def _budget_section(
    ctx: Context, moe: list[Arm], measured: dict[str, list[dict[str, Any]]], batches: str
) -> Section:
    ks = sorted({r["top_k"] for a in moe for m in measured[a.name] for r in m["sweep"]["results"]})
    nll_cols: list[tuple[str, str, str]] = [("map", "arm", "s")]
    nll_cols += [(f"K={k}", f"nll{k}", ".4f") for k in ks]
    nll_cols.append(("Delta K=2 -> K=max", "delta", "+.4f"))
    ret_cols: list[tuple[str, str, str]] = [("map", "arm", "s")]
    ret_cols += [(f"1-delta K={k}", f"ret{k}", ".4f") for k in ks]
    ret_cols += [(f"K+ K={k}", f"con{k}", ".3f") for k in ks]

    def at(k: int, key: str) -> Callable[[dict[str, Any]], Any]:
        def get(m: dict[str, Any]) -> Any:
            return next(r[key] for r in m["sweep"]["results"] if r["top_k"] == k)

        return get

    nll_rows, ret_rows = [], []
    for arm in moe:
        per_seed = measured[arm.name]
        row: dict[str, Any] = {"arm": arm.label}
        row.update({f"nll{k}": _values(per_seed, at(k, "nll")) for k in ks})
        row["delta"] = _values(per_seed, lambda m: m["sweep"]["nll_increase"])
        nll_rows.append(row)
        ret = {"arm": arm.label}
        ret.update({f"ret{k}": _values(per_seed, at(k, "retained_mass")) for k in ks})
        ret.update({f"con{k}": _values(per_seed, at(k, "contributors")) for k in ks})
        ret_rows.append(ret)
    text = (
        "The trained weights (K = 2) run with K experts per token at inference, nothing "
        f"retrained; NLL in nats per token on {batches}. Delta: the NLL at the largest K "
        "minus the NLL at the trained K (the paper's K = 8 minus K = 2). Retained mass "
        "1 - delta-bar and contributors K+ at each budget complete the paper's Table 9."
    )
    return Section(
        "Frozen-weight budgets",
        text,
        [
            StudyTable(
                "budget_nll", "NLL at inference budget K (Tables 3 and 9)", nll_cols, nll_rows
            ),
            StudyTable(
                "budget_retention",
                "Retained mass and contributors at inference budget K (Table 9)",
                ret_cols,
                ret_rows,
            ),
        ],
    )


def _mechanism_section(
    ctx: Context, moe: list[Arm], measured: dict[str, list[dict[str, Any]]], batches: str
) -> Section:
    """The spread ratio per layer, the contributor trajectories and the gradient
    saturation (the measures of the findings ``score_spread_*``,
    ``contributors_return_*`` and ``saturation_*``)."""
    from moelab.studies.sparse_maps.findings import spread_ratios

    names = claim_arms(ctx)
    soft = measured[names["softmax"]]
    blocks = [lay["block"] for lay in soft[0]["layers"]]

    def softmax_of(arm: Arm) -> list[dict[str, Any]]:
        """The softmax arm of the arm's model size (at the paper scale, 300M or 1B)."""
        for size in SIZES:
            if arm.name.endswith(f"-{size}") and f"softmax-{size}" in measured:
                return measured[f"softmax-{size}"]
        return soft

    ratio_rows = []
    for arm in moe:
        if arm.tags.get("map") == "softmax":
            continue
        ref = softmax_of(arm)
        per_seed = [spread_ratios(m, s) for m, s in zip(measured[arm.name], ref, strict=True)]
        blocks = sorted(set(blocks) | {lay["block"] for lay in ref[0]["layers"]})
        row: dict[str, Any] = {"arm": arm.label}
        own = [lay["block"] for lay in measured[arm.name][0]["layers"]]
        for j, b in enumerate(own):
            row[f"b{b}"] = [None if r is None else r[j] for r in per_seed]
        row["mean"] = [None if r is None else sum(r) / len(r) for r in per_seed]
        ratio_rows.append(row)
    ratio_cols: list[tuple[str, str, str]] = [("map", "arm", "s")]
    ratio_cols += [(f"block {b}", f"b{b}", ".3f") for b in blocks]
    ratio_cols.append(("mean over layers", "mean", ".3f"))

    traj_rows = []
    sat_rows = []
    sat_layer_rows = []
    sat_blocks = blocks
    for arm in moe:
        per_seed = measured[arm.name]
        traj = [m.get("trajectory") for m in per_seed]
        traj_rows.append(
            {
                "arm": arm.label,
                **{
                    k: [None if t is None else t[k] for t in traj]
                    for k in ("dip", "dip_tokens", "end", "return")
                },
            }
        )
        sat = [m.get("saturation") for m in per_seed]
        if not any(sat):
            continue
        thr = next(s for s in sat if s)["threshold"]

        def pct(s: Any, key: str) -> float | None:
            v = None if s is None else s["mean"][key]
            return None if v is None else 100.0 * v

        sat_rows.append(
            {
                "arm": arm.label,
                "threshold": f"{thr:g}",
                "tokens": [pct(s, "token_share_past") for s in sat],
                "lost": [pct(s, "lost_share") for s in sat],
                "passed": [None if s is None else s["mean"]["passed_share_past"] for s in sat],
                "aux": [pct(s, "aux_share_past") for s in sat],
            }
        )
        row = {"arm": arm.label}
        for b in sat_blocks:
            row[f"b{b}"] = [
                None
                if s is None
                else next(
                    (
                        100.0 * lay["lost_share"]
                        for lay in s["layers"]
                        if lay["block"] == b and lay["lost_share"] is not None
                    ),
                    None,
                )
                for s in sat
            ]
        sat_layer_rows.append(row)
    tables = [
        StudyTable(
            "spread_ratio",
            "Score spread against softmax's, per MoE layer (Table 8's RMS, as ratios)",
            ratio_cols,
            ratio_rows,
            note="Each map's score RMS (root mean square of the centred scores) in a layer "
            "over softmax's in the same layer, seed by seed; the paper's 1.5-entmax "
            "learns about half softmax's spread (0.53 at 300M, 0.42 at 1B, Table 7).",
        ),
        StudyTable(
            "contributor_trajectory",
            "Contributors during training: dip and return (Figures 2 and 4)",
            [
                ("map", "arm", "s"),
                ("dip K+", "dip", ".4f"),
                ("dip at tokens", "dip_tokens", ".0f"),
                ("end K+", "end", ".4f"),
                ("return (end - dip)", "return", "+.4f"),
            ],
            traj_rows,
            note="From the contributors per token logged on the training batches "
            "(metrics.jsonl): end, the mean of the rows in the last 10% of training; dip, "
            "the lowest running mean of 5 logged rows before those; return, end − dip.",
        ),
    ]
    if sat_rows:
        tables += [
            StudyTable(
                "saturation",
                "Gradient saturation past the singleton threshold (Figures 3 and 5)",
                [
                    ("map", "arm", "s"),
                    ("threshold", "threshold", "s"),
                    ("tokens past %", "tokens", ".3f"),
                    ("gate gradient lost %", "lost", ".3f"),
                    ("score gradient past", "passed", ".1e"),
                    ("balance gradient past %", "aux", ".3f"),
                ],
                sat_rows,
                note="On the tokens of the first validation batches (LM loss without the "
                "balance loss): tokens past %, the share whose top-2 gap is at or above the "
                "map's threshold; gate gradient lost %, the share of |dL/dw| of the tokens' "
                "top-1 gate weights that falls on those tokens, which the saturated map "
                "passes to nothing; score gradient past, the share of the router's score "
                "gradient that they do send (0 where the map saturates); balance gradient "
                "past %, the same share of the balance loss's score gradient (0 when it is "
                "computed on the map's probabilities, positive on their softmax).",
            ),
            _plain_layer_table(
                "per_layer_saturation",
                "Gate gradient lost past the threshold per MoE layer (%)",
                sat_blocks,
                sat_layer_rows,
            ),
        ]
    text = (
        f"The measures behind the findings on the score spread, the contributors' "
        f"trajectory and gradient saturation, on {batches} (saturation: on the first "
        "few of them; see docs/studies.md for the definitions)."
    )
    return Section("Spread, trajectory and saturation", text, tables)


def _plain_layer_table(
    key: str, title: str, blocks: Sequence[int], rows: list[dict[str, Any]]
) -> StudyTable:
    columns: list[tuple[str, str, str]] = [("map", "arm", "s")]
    columns += [(f"block {b}", f"b{b}", ".3f") for b in blocks]
    return StudyTable(key, title, columns, rows)


def _paper_section(
    ctx: Context, measured: dict[str, list[dict[str, Any]]], names: Mapping[str, str]
) -> Section:
    from moelab.studies.sparse_maps.findings import LABELS
    from moelab.studies.sparse_maps.paper import paper_table

    per_map = {m: measured[a] for m, a in names.items()}
    total = per_map["softmax"][0]["active_params"]
    common = ctx.common
    tokens = None
    try:
        tokens = int(common["steps"]) * int(common["batch_size"]) * int(common["seq_len"])
    except (KeyError, TypeError, ValueError):
        pass
    scale = f"moelab {ctx.scale} ({total['total']:,} total, {total['active']:,} active"
    scale += f"; {tokens:,} training tokens)" if tokens else ")"
    columns, rows = paper_table(per_map, LABELS, scale, _values)
    table = StudyTable(
        "paper_beside_moelab",
        "The paper's numbers beside this study's",
        columns,
        rows,
        note="The paper's values are its Tables 1, 2, 3, 5 and 7 at its two scales ('-': "
        "not in the paper's text); its routing statistics (Tables 2, 5, 7) are on the Paloma "
        "WikiText-103 test documents and its Table 3 on a retained DCLM sample, moelab's on "
        "this study's validation batches. The paper does not state its training tokens.",
    )
    text = (
        f"This study's arms at the `{ctx.scale}` scale beside the paper's 300M and 1B models "
        "(the map-balanced arms; the claims' arms at the paper scale)."
    )
    return Section("The paper beside this study", text, [table])


# ------------------------------------------------------------------------ demo


def headline_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per arm of a results document: its label, its main-table values and its
    routing statistics (means over the seeds, the routing keys named as
    ``moelab.diagnostics.stats`` names them; routing keys are absent for dense arms):
    what ``moelab demo --json`` prints as ``rows``."""
    tables = {t["key"]: t for t in doc.get("tables", [])}
    out: dict[str, dict[str, Any]] = {}
    for key in ("main", "routing"):
        table = tables.get(key)
        if not table:
            continue
        for row in table["rows"]:
            label = row.get("arm")
            entry = out.setdefault(label, {"label": label})
            for k, v in row.items():
                if k in ("arm", "active", "total"):
                    continue
                entry[k] = v.get("mean") if isinstance(v, dict) else v
    return list(out.values())
