"""What ``moelab analyze`` writes, and the section of ``moelab report`` that shows it.

Each analysis (:mod:`moelab.diagnostics.analysis`) writes three kinds of files into its
folder (``RUN/analyze/`` for a run, ``--out DIR`` otherwise): ``NAME.json`` (the
analysis's document; fragility's is ``fragility_SETTING.json``, one per setting),
``NAME*.png`` (its figures) and ``NAME.md`` (a Markdown section
that names the figures). Every set is written whole or not at all (all its files into a
staging folder, then renamed into the folder, the JSON last), so a folder never pairs a
new figure with an old document, and a failure (a full disk) leaves the folder as it was. A
folder that holds files moelab analyze did not write is refused (``check_folder``).

``moelab report`` includes the sections of each run's ``RUN/analyze/`` (the figures
copied beside report.md); a section measured on another checkpoint than the one the
report shows is marked stale.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from moelab import __version__
from moelab._format import fmt
from moelab._io import write_atomic, write_json
from moelab.report.panels import save_figure
from moelab.runs.folders import Staging

__all__ = [
    "ANALYSES",
    "MARKER",
    "analysis_section",
    "check_folder",
    "markdown",
    "read_analyses",
    "write_analysis",
]

ANALYSES = ("saturation", "coactivation", "specialization", "fragility", "invariance", "agreement")
MARKER = ".moelab-analyze.json"


def check_folder(out: Path) -> None:
    """FileExistsError unless ``out`` is missing, empty, or a folder of moelab analyze
    (its marker, or nothing but its own files)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    if (out / MARKER).is_file():
        return
    names = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    foreign = [n for n in names if n.split(".")[0].split("_")[0] not in ANALYSES]
    if foreign:
        raise FileExistsError(
            f"--out {out} holds files moelab analyze did not write "
            f"({', '.join(sorted(foreign)[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); give an empty or new folder"
        )


def _title(doc: dict[str, Any]) -> str:
    if doc["analysis"] == "agreement":  # two records, not a run
        a, b = (Path(r["label"]).name for r in doc["records"])
        return f"{a} vs {b}"
    alpha = "" if doc.get("alpha") is None else f" (alpha {doc['alpha']:g})"
    step = "" if doc.get("checkpoint_step") is None else f", step {doc['checkpoint_step']}"
    name = "/".join(Path(doc["source"]).parts[-2:])
    return f"{name}: {doc['map']}{alpha}{step}"


# -- figures -------------------------------------------------------------------------------


def _fig_saturation(doc: dict[str, Any], out: Path) -> list[Path]:
    rows = doc["checkpoints"]
    xs = [
        r["training_tokens"] if r["training_tokens"] is not None else i for i, r in enumerate(rows)
    ]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, name in (
        (axes[0], "top1_agreement", "top-1 expert = final's"),
        (axes[1], "set_overlap", "overlap with final used set"),
    ):
        for layer in range(doc["n_layers"]):
            ax.plot(xs, [r["layers"][layer][key] for r in rows], marker="o", ms=3,
                    label=f"MoE layer {layer}")  # fmt: skip
        ax.plot(xs, [r["mean"][key] for r in rows], color="black", lw=2, label="mean")
        ax.set_ylim(0, 1.02)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
        ax.set_xlabel("training tokens" if rows[0]["training_tokens"] is not None else "checkpoint")
        ax.set_ylabel("share of tokens")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"router saturation, {_title(doc)}", fontsize=9)
    return [save_figure(fig, out / "saturation.png")]


def _fig_coactivation(doc: dict[str, Any], out: Path) -> list[Path]:
    layers = doc["layers"]
    n = len(layers)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, lay in zip(axes.flat, layers, strict=False):
        lift = np.array([[np.nan if v is None else v for v in r] for r in lay["lift"]], float)
        with np.errstate(divide="ignore"):  # a pair never used together: lift 0
            im = ax.imshow(np.log2(lift), cmap="RdBu_r", vmin=-2, vmax=2)
        ax.set_title(f"MoE layer {lay['layer']}", fontsize=8)
        ax.set_xlabel("j", fontsize=7)
        ax.set_ylabel("i", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=axes, shrink=0.8, label="log2 lift of P(j | i)")
    fig.suptitle(f"co-activation against independent choice, {_title(doc)}", fontsize=9)
    fig.subplots_adjust(right=0.82)
    return [save_figure(fig, out / "coactivation.png", tight=False)]


def _fig_specialization(doc: dict[str, Any], out: Path) -> list[Path]:
    files = []
    vocab = [v for v in doc["vocabulary"] if v["histogram"] is not None]
    if vocab:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        edges = np.linspace(0, 1, len(vocab[0]["histogram"]) + 1)
        for v in vocab:
            h = np.asarray(v["histogram"], float)
            ax.step(edges[:-1], h / max(h.sum(), 1), where="post", label=f"MoE layer {v['layer']}")
        if vocab[0]["uniform"] is not None:
            ax.axvline(vocab[0]["uniform"], color="gray", ls="--", label="even spread K/E")
        ax.set_xlabel("share of a token id's occurrences at its most frequent expert")
        ax.set_ylabel("share of token ids")
        ax.set_title(f"vocabulary specialisation, {_title(doc)}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        files.append(save_figure(fig, out / "specialization_vocabulary.png"))
    domains = doc["domains"]
    L, E = doc["n_layers"], doc["n_experts"]
    fig, axes = plt.subplots(L, 1, figsize=(max(5, 0.35 * E + 2), 1.8 * L + 0.6), squeeze=False)
    width = 0.8 / len(domains)
    for layer in range(L):
        ax = axes[layer, 0]
        for d, dom in enumerate(domains):
            ratio = dom["layers"][layer]["ratio_to_uniform"]
            ax.bar(np.arange(E) + d * width - 0.4 + width / 2, ratio, width,
                   label=Path(dom["data"]).name if dom["data"] else "validation split")  # fmt: skip
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_ylabel(f"layer {layer}", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[-1, 0].set_xlabel("expert")
    axes[0, 0].legend(fontsize=6)
    axes[0, 0].set_title(f"load / uniform share per corpus, {_title(doc)}", fontsize=9)
    files.append(save_figure(fig, out / "specialization_domains.png"))
    return files


def _fig_fragility(doc: dict[str, Any], out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in doc["results"]:
        bins = [0] * len(r["layers"][0]["by_gap"])
        flips = [0] * len(bins)
        for lay in r["layers"]:
            for i, b in enumerate(lay["by_gap"]):
                bins[i] += b["tokens"]
                flips[i] += b["set_changed"]
        share = [f / b if b else np.nan for f, b in zip(flips, bins, strict=True)]
        labels = [f"{b['lo']:g}" for b in r["layers"][0]["by_gap"]]
        name = doc["setting"] if r["eps"] is None else f"eps {r['eps']:g}"
        axes[0].plot(range(len(share)), share, marker="o", label=name)
        axes[0].set_xticks(range(len(labels)), labels, fontsize=7)
        rb = [0] * len(r["layers"][0]["by_radius"])
        rf = [0] * len(rb)
        for lay in r["layers"]:
            for i, b in enumerate(lay["by_radius"]):
                rb[i] += b["tokens"]
                rf[i] += b["argmax_changed"]
        rl = [f"{b['lo']:g}" for b in r["layers"][0]["by_radius"]]
        axes[1].plot(range(len(rb)), [f / b if b else np.nan for f, b in zip(rf, rb, strict=True)],
                     marker="o", label=name)  # fmt: skip
        axes[1].set_xticks(range(len(rl)), rl, fontsize=7)
    axes[0].set_xlabel("top-2 logit gap (bin from)")
    axes[0].set_ylabel("share of tokens whose used set changed")
    axes[1].set_xlabel("certified radius / ||delta|| (bin from)")
    axes[1].set_ylabel("share whose top-1 changed")
    axes[1].axvline(2, color="gray", ls="--", lw=0.8)  # the bin that starts at ratio 1
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"fragility ({doc['setting']}), {_title(doc)}", fontsize=9)
    return [save_figure(fig, out / f"{_stem(doc)}.png")]


def _agreement_margins(doc: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The margins the agreement's text and figure show: A's, else B's (None: neither)."""
    for i, key in enumerate(("A", "B")):
        if doc["margins"][key] is not None:
            return doc["records"][i]["label"], doc["margins"][key]
    return None


def _fig_agreement(doc: dict[str, Any], out: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    layers = doc["layers"]
    axes[0].bar([lay["layer"] for lay in layers], [100 * lay["differ"] for lay in layers],
                color="tab:blue", label="expert set differs")  # fmt: skip
    axes[0].axhline(100 * doc["differ_any"], color="black", ls="--", lw=1,
                    label=f"in >= 1 layer ({100 * doc['differ_any']:.2f}%)")  # fmt: skip
    axes[0].set_xlabel("MoE layer")
    axes[0].set_ylabel("% of tokens")
    axes[0].set_xticks([lay["layer"] for lay in layers])
    axes[0].legend(fontsize=7)
    axes[0].set_title("tokens whose expert set differs", fontsize=9)
    axes[0].grid(alpha=0.3, axis="y")
    pos = doc["positions"]
    names = [f"{b['lo']}" if b["hi"] - b["lo"] == 1 else f"{b['lo']}-{b['hi'] - 1}" for b in pos]
    axes[1].bar(range(len(pos)), [100 * (b["differ_any"] or 0) for b in pos], color="tab:blue",
                label="tokens differing in >= 1 layer")  # fmt: skip
    axes[1].plot(range(len(pos)), [100 * (b["differ_states"] or 0) for b in pos], "o-",
                 color="black", label="token-layer states differing")  # fmt: skip
    axes[1].set_xticks(range(len(pos)), names, rotation=45, fontsize=7)
    where = "position t mod S" if doc["position_axis"] == "position" else "row of the record"
    axes[1].set_xlabel(where + ("" if doc["seq_len"] is None else f" (S = {doc['seq_len']})"))
    axes[1].set_ylabel("% of the bucket's tokens")
    axes[1].set_title("where they sit", fontsize=9)
    axes[1].legend(fontsize=7)
    axes[1].grid(alpha=0.3, axis="y")
    shown = _agreement_margins(doc)
    ax = axes[2]
    if shown is None:
        ax.axis("off")
        ax.text(0.5, 0.5, "margins unavailable:\nneither record holds them", ha="center",
                va="center", fontsize=9)  # fmt: skip
    else:
        label, margins = shown
        ax.set_title(f"top-K / top-(K+1) margin ({Path(label).name}'s scores)", fontsize=9)
        ax.set_xlabel("margin s(K) - s(K+1) (ranking-score units; 0: a tie)", fontsize=8)
        ax.set_ylabel("share of the group")
        hist = margins["histogram"]
        names = hist["bins"]
        width = 0.4
        for g, (group, color) in enumerate((("differing", "tab:red"), ("rest", "tab:gray"))):
            counts = np.asarray(hist["topk"][group], float)
            share = counts / max(counts.sum(), 1)
            ax.bar(np.arange(len(names)) + (g - 0.5) * width, share, width, color=color,
                   label=f"{group} ({int(counts.sum()):,} token-layers)")  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=6)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"routing agreement, {_title(doc)}", fontsize=9)
    return [save_figure(fig, out / "agreement.png")]


def _fig_invariance(doc: dict[str, Any], out: Path) -> list[Path]:
    rows = [r for r in doc["settings"] if r["applies"]]
    L = doc["n_layers"]
    share = np.array(
        [[np.nan if lay["changed"] is None else lay["changed"] for lay in r["layers"]]
         for r in rows] or [[np.nan] * L], float,
    )  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * L + 2.5), 0.45 * len(share) + 1.4))
    im = ax.imshow(share, cmap="Reds", vmin=0, vmax=max(0.01, float(np.nanmax(share, initial=0))),
                   aspect="auto")  # fmt: skip
    for (i, j), v in np.ndenumerate(share):
        if not np.isnan(v):
            ax.text(j, i, f"{100 * v:.1f}%", ha="center", va="center", fontsize=7)
    names = [r["setting"] + (" (router)" if r["level"] == "router" else "") for r in rows]
    ax.set_yticks(range(len(names)), names or ["-"], fontsize=7)
    ax.set_xticks(range(L), [str(i) for i in range(L)], fontsize=7)
    ax.set_xlabel("MoE layer")
    fig.colorbar(im, ax=ax, label="share of tokens whose experts changed")
    ax.set_title(f"routing invariance, {_title(doc)}", fontsize=9)
    return [save_figure(fig, out / "invariance.png")]


_FIGURES: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "saturation": _fig_saturation,
    "coactivation": _fig_coactivation,
    "specialization": _fig_specialization,
    "fragility": _fig_fragility,
    "agreement": _fig_agreement,
    "invariance": _fig_invariance,
}


# -- Markdown --------------------------------------------------------------------------


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _md_saturation(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"Each kept checkpoint against the last (step {doc['final_step']}) on "
        f"{doc['tokens']:,} tokens: the share of tokens whose top-1 expert is the final "
        "one, the mean overlap of the used experts, and the share whose used set is the final one.",
        "",
        "| step | training tokens | top-1 = final | set overlap | set = final |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["checkpoints"]:
        m = r["mean"]
        lines.append(
            f"| {fmt(r['step'], 's')} | {fmt(r['training_tokens'], ',')} | "
            f"{_pct(m['top1_agreement'])} | {_pct(m['set_overlap'])} | {_pct(m['set_agreement'])} |"
        )
    return lines


def _md_coactivation(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"P(j used | i used) over {doc['tokens']:,} tokens against independent choice "
        "of a token's other experts (lift 1); the most co-activated pairs of each layer:",
        "",
        "| layer | pair | tokens | P(j given i) | P(i given j) | lift |",
        "| ---: | :--- | ---: | ---: | ---: | ---: |",
    ]
    for lay in doc["layers"]:
        for p in lay["top_pairs"][:3]:
            lines.append(
                f"| {lay['layer']} | {p['i']}, {p['j']} | {p['tokens']:,} | "
                f"{p['p_j_given_i']:.3f} | {p['p_i_given_j']:.3f} | {p['lift']:.2f} |"
            )
    return lines


def _md_specialization(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"Vocabulary specialisation over {doc['tokens']:,} tokens (token ids seen at least "
        f"{doc['min_count']} times): the share of a token id's occurrences that reach its "
        "most frequent expert.",
        "",
        "| layer | token ids | mean | p10 | p50 | p90 | even spread |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in doc["vocabulary"]:
        lines.append(
            f"| {v['layer']} | {v['token_ids']:,} | {fmt(v['mean'], '.3f')} | "
            f"{fmt(v['p10'], '.3f')} | {fmt(v['p50'], '.3f')} | {fmt(v['p90'], '.3f')} | "
            f"{fmt(v['uniform'], '.3f')} |"
        )
    lines += ["", "Domain loads (max and min of load / uniform share over the experts):", ""]
    lines += [
        "| corpus | tokens | layer | max ratio | min ratio |",
        "| :--- | ---: | ---: | ---: | ---: |",
    ]
    for dom in doc["domains"]:
        for lay in dom["layers"]:
            r = lay["ratio_to_uniform"]
            name = Path(dom["data"]).name if dom["data"] else "validation split"
            lines.append(
                f"| {name} | {dom['tokens']:,} | {lay['layer']} | {max(r):.2f} | {min(r):.2f} |"
            )
    return lines


def _edge(v: Any) -> str:
    """A bin edge; JSON holds the infinite ones as null."""
    return "inf" if v is None or math.isinf(v) else f"{v:g}"


def _md_fragility(doc: dict[str, Any]) -> list[str]:
    what = {
        "bf16": "float32 against bfloat16 autocast",
        "kernels": "the fused map kernels against PyTorch's path",
        "perturb": "the router input against x + delta, ||delta|| = eps ||x|| "
        f"({doc['direction']})",
    }[doc["setting"]]
    lines = [
        f"{what}, {doc['tokens']:,} tokens per layer.",
        "",
        "| eps | used set changed | top-1 changed | tokens with r > delta "
        "| of them top-1 changed | claim |",
        "| ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for r in doc["results"]:
        c = r["certified"]
        claim = "n/a" if c is None else ("holds" if c["holds"] else "VIOLATED")
        lines.append(
            f"| {fmt(r['eps'], 'g')} | {_pct(r['set_changed'])} | {_pct(r['argmax_changed'])} | "
            f"{'-' if c is None else format(c['tokens'], ',')} | "
            f"{'-' if c is None else c['argmax_changed']} | {claim} |"
        )
    if doc.get("certified_reason"):
        lines += ["", f"The certified-radius claim does not apply: {doc['certified_reason']}."]
    first = doc["results"][0]
    bins = first["layers"][0]["by_gap"]
    tok = [sum(lay["by_gap"][i]["tokens"] for lay in first["layers"]) for i in range(len(bins))]
    chg = [
        sum(lay["by_gap"][i]["set_changed"] for lay in first["layers"]) for i in range(len(bins))
    ]
    lines += ["", "Changed used sets by top-2 logit gap (all layers, first row above):", ""]
    lines += ["| gap from | to | tokens | changed |", "| ---: | ---: | ---: | ---: |"]
    for b, n, c in zip(bins, tok, chg, strict=True):
        lines.append(
            f"| {_edge(b['lo'])} | {_edge(b['hi'])} | {n:,} | {_pct(c / n if n else None)} |"
        )
    return lines


def _md_margin(q: dict[str, Any]) -> str:
    """One group's margins: tokens | ties | p10 | median."""
    return f"{q['tokens']:,} | {q['ties']:,} | {fmt(q['p10'], '.3g')} | {fmt(q['p50'], '.3g')}"


def _md_agreement(doc: dict[str, Any]) -> list[str]:
    a, b = doc["records"]
    T, L = doc["tokens"], doc["n_layers"]

    def who(r: dict[str, Any]) -> str:
        k = r["K"][0] if len(set(r["K"])) == 1 else r["K"]
        return f"`{r['label']}` ({r['map'] or 'map not recorded'}, K={k})"

    null = f" (+{doc['n_null']} null)" if doc["n_null"] else ""
    lines = [
        f"A = {who(a)} against B = {who(b)}: {T:,} tokens, {L} MoE layers of "
        f"{doc['n_experts']} experts{null}. "
        "A token's expert set is what its chosen slots name (slot order ignored).",
        "",
        f"Tokens whose expert set differs in at least one layer: "
        f"**{_pct(doc['differ_any'])}** ({doc['differ_any_tokens']:,} of {T:,}); "
        f"token-layer states that differ: {_pct(doc['differ_states'])}.",
        "",
        "| layer | set differs | tokens | experts swapped (mean) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for lay in doc["layers"]:
        lines.append(
            f"| {lay['layer']} | {_pct(lay['differ'])} | {lay['differ_tokens']:,} | "
            f"{fmt(lay['swapped_mean'], '.2f')} |"
        )
    counts = doc["layers_differing"]
    lines += ["", "Tokens by the number of layers in which they differ: " + ", ".join(
        f"{n}: {c:,}" for n, c in enumerate(counts))]  # fmt: skip
    if doc["position_axis"] == "position":
        where = f"By position t mod S (S = {doc['seq_len']}, from the {doc['seq_len_from']}):"
    else:
        where = (
            "By row of the record (the sequence length is unknown: give --seq-len S for positions):"
        )
    lines += ["", where, "", "| from | to | tokens | differ in >= 1 layer | token-layer states |"]
    lines.append("| ---: | ---: | ---: | ---: | ---: |")
    for bk in doc["positions"]:
        lines.append(
            f"| {bk['lo']} | {bk['hi'] - 1} | {bk['tokens']:,} | {_pct(bk['differ_any'])} | "
            f"{_pct(bk['differ_states'])} |"
        )
    shown = _agreement_margins(doc)
    lines.append("")
    if shown is None:
        lines.append(f"Margins unavailable: {doc['margins_unavailable']}.")
        return lines
    label, margins = shown
    lines += [
        f"Margins from `{label}` (the gaps of the scores its selection rule ranked: "
        "s(1) - s(2) and s(K) - s(K+1); 0 is a tie), of the token-layer states that "
        "differ against the rest:",
        "",
        "| layer | margin | differing | ties | p10 | median | rest | ties | p10 | median |",
        "| ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = [*margins["layers"], {"layer": "all", **margins["all"]}]
    for lay in rows:
        for key, name in (("top1", "top-1/2"), ("topk", "top-K/K+1")):
            lines.append(
                f"| {lay['layer']} | {name} | {_md_margin(lay[key]['differing'])} | "
                f"{_md_margin(lay[key]['rest'])} |"
            )
    if doc["margins_unavailable"]:
        lines += ["", f"Only one record's margins: {doc['margins_unavailable']}."]
    d = margins["all"]["topk"]["differing"]
    if d["tokens"]:
        lines += [
            "",
            f"Ties: {d['ties']:,} of the {d['tokens']:,} differing token-layer states have a "
            f"top-K/K+1 margin of exactly 0 in `{label}`.",
        ]
    return lines


def _margin(m: Any) -> str:
    return "-" if m is None else f"{m['median']:.3g}"


def _md_invariance(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"{doc['texts']} texts of {doc['length']} tokens, each routed alone and then in each "
        "setting; per setting, the share of token-layer states whose computed experts "
        "changed; of those tokens, how many changed their selected experts and how many "
        "their capacity drops, how many sat at an exact tie (K/K+1 margin 0) and how many "
        "within reach of the change of their scores (margin <= 2 x that change); and the "
        "median K/K+1 margin of the changed tokens against the rest.",
        "",
        "| setting | level | changed | selection | drops | ties | near ties "
        "| K/K+1 margin, changed | rest | verdict |",
        "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    notes = []
    for r in doc["settings"]:
        if not r["applies"]:
            lines.append(f"| {r['setting']} | {r['level']} |" + " - |" * 7 + " n/a |")
            notes.append(f"- {r['setting']}: not applicable: {r['reason']}.")
            continue
        verdict = r["verdict"]
        if r["mechanisms"]:
            verdict += ": " + ", ".join(r["mechanisms"])
        elif verdict == "batch-dependent":
            verdict += ": no mechanism of the router config explains it"
        lines.append(
            f"| {r['setting']} | {r['level']} | {_pct(r['changed'])} ({r['changed_tokens']:,}) "
            f"| {r['selected_changed_tokens']:,} | {r['dropped_changed_tokens']:,} "
            f"| {r['ties']} | {r['near_ties']} | {_margin(r['margin_kk1']['changed'])} "
            f"| {_margin(r['margin_kk1']['rest'])} | {verdict} |"
        )
        if r["note"]:
            notes.append(f"- {r['setting']} (router level): {r['note']}.")
    lines += ["", "Per layer (changed share):", ""]
    L = doc["n_layers"]
    lines += ["| setting | " + " | ".join(f"layer {i}" for i in range(L)) + " |",
              "| :--- |" + " ---: |" * L]  # fmt: skip
    for r in doc["settings"]:
        if r["applies"]:
            cells = " | ".join(_pct(lay["changed"]) for lay in r["layers"])
            lines.append(f"| {r['setting']} | {cells} |")
    if notes:
        lines += ["", *notes]
    mech = doc["batch_mechanisms"]
    lines += ["", "Mechanisms of this router that read the batch:" if mech else
              "The router has no mechanism that reads the batch: it is batch-invariant by "
              "construction, and only arithmetic at near-ties can change a token's "
              "experts."]  # fmt: skip
    for m in mech:
        lines.append(f"- {m['mechanism']} (`{m['key']}={m['value']}`, {m['when']}): {m['why']}.")
    return lines


_MARKDOWN = {
    "saturation": _md_saturation,
    "coactivation": _md_coactivation,
    "specialization": _md_specialization,
    "fragility": _md_fragility,
    "agreement": _md_agreement,
    "invariance": _md_invariance,
}


def markdown(doc: dict[str, Any], figures: list[str], level: int = 2) -> str:
    """The Markdown section of an analysis document, naming its ``figures``."""
    name = doc["analysis"]
    head = "#" * level
    lines = [f"{head} {name.capitalize()}: {_title(doc)}", ""]
    if name != "agreement":  # two records: their text is what they recorded
        text = "validation split" if not doc.get("data") else doc["data"]
        if isinstance(text, list):
            text = ", ".join(t or "validation split" for t in text)
        lines += [f"Text: {text}.", ""]
    lines += _MARKDOWN[name](doc)
    lines.append("")
    lines += [f"![{name}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def _stem(doc: dict[str, Any]) -> str:
    """The files' name: the analysis, and for fragility its setting (fragility_bf16)."""
    name = doc["analysis"]
    return f"{name}_{doc['setting']}" if name == "fragility" else name


def write_analysis(doc: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``doc``'s figures, Markdown and JSON into ``out`` (created, checked with
    :func:`check_folder`); returns the paths, the JSON last.

    The set is written whole or not at all: every file goes to a staging folder in
    ``out`` first (:class:`moelab.runs.folders.Staging`) and is renamed into ``out`` once
    all are written, the JSON last; a failure (a full disk) removes the staging folder
    and leaves ``out`` as it was. A failed write is an OSError naming the file."""
    out = Path(out)
    check_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / MARKER, {"made_by": "moelab analyze", "moelab": __version__})
    name, stem = doc["analysis"], _stem(doc)
    staging = Staging(out)
    try:
        figures = _FIGURES[name](doc, staging.dir)
        md = staging.dir / f"{stem}.md"
        write_atomic(md, markdown(doc, [f.name for f in figures]).encode())
        doc = dict(doc, files=[f.name for f in figures] + [md.name])
        write_json(staging.dir / f"{stem}.json", doc)
        staging.commit(last=(md.name, f"{stem}.json"))
    finally:
        staging.discard()
    return [*(out / f.name for f in figures), out / md.name, out / f"{stem}.json"]


# -- the report's section ------------------------------------------------------------------


def read_analyses(run: str | Path) -> list[dict[str, Any]]:
    """The analysis documents in ``RUN/analyze/``, in :data:`ANALYSES` order (not
    agreement's, which compares two records rather than the run's checkpoint)."""
    folder = Path(run) / "analyze"
    docs = []
    for name in ANALYSES:
        if name == "agreement":
            continue
        for path in sorted(folder.glob(f"{name}*.json")):
            try:
                docs.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path} is not a readable moelab analyze result: {err}") from None
    return docs


def analysis_section(builder: Any) -> None:
    """report.md's "Routing analyses": each run's ``moelab analyze`` results, figures
    copied beside report.md; a result of another checkpoint is marked stale."""
    import shutil

    parts: list[str] = []
    for entry in builder.moe:
        docs = read_analyses(entry["run"])
        for doc in docs:
            stale = doc.get("checkpoint_step") != entry.get("checkpoint_step")
            figures = []
            for f in doc.get("files", []):
                if not f.endswith(".png"):
                    continue
                src = Path(entry["run"]) / "analyze" / f
                if src.is_file():
                    dst = builder.out / f"analyze_{Path(entry['run']).name}_{f}"
                    shutil.copyfile(src, dst)
                    builder.files.append(dst)
                    figures.append(dst.name)
            text = markdown(doc, figures, level=3)
            if stale:
                text = text.replace(
                    "\n\n",
                    f"\n\n**Stale**: measured on checkpoint step {doc.get('checkpoint_step')}; "
                    f"this report shows step {entry.get('checkpoint_step')}. Run "
                    f"`moelab analyze {doc['analysis']} {entry['run']}` again.\n\n",
                    1,
                )
            parts.append(text)
    if not parts:
        return
    builder.md += ["## Routing analyses", "", "From `moelab analyze` (docs/analysis.md).", ""]
    builder.md += parts
