"""What every study shares: arms, scales, seeds, resumable training, mean ± sd tables and
the report files.

A study (one paper's experiment grid) is a :class:`Study` subclass registered in
``moelab.studies.STUDIES``. It names

- the settings its arms share at each scale (:meth:`Study.common`: TrainConfig fields),
- its arms (:meth:`Study.arms`: each an :class:`Arm`, the fields and ``--set`` overrides
  that differ),
- at the ``paper`` scale, where each value comes from (:meth:`Study.paper_sources`),
- and what it measures on the trained runs (:meth:`Study.analyse`, given a
  :class:`Context`): :class:`Section` objects holding text, :class:`StudyTable` objects
  (one value per seed in each numeric cell) and figures.

:func:`run_study` trains every arm with every seed under ``OUT/runs/ARM/seedS`` (a run
that finished is reused, one that was interrupted resumes), calls the analysis, and
writes ``OUT/report.md``, the figures, ``OUT/tables.tex`` and ``OUT/results.json`` (drawn
aside and renamed into OUT at the end). With two seeds or more every numeric cell shows
mean ± sd (the sample standard deviation, ddof = 1); results.json keeps the per-seed
values beside them. ``OUT`` is new, empty or the study's own folder
(``.moelab-study.json`` marks it); another moelab command's folder needs ``overwrite``
and anything else is refused (:mod:`moelab.runs.folders`).
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from moelab._io import write_json
from moelab._strict_json import json_safe
from moelab.report.table import cell_text, summarize
from moelab.runs.folders import Staging, atomic_write_text
from moelab.studies.audit import audit, source_record
from moelab.studies.paired import Finding, paired_tables
from moelab.studies.tables import Section, StudyTable

__all__ = [
    "SCALES",
    "Arm",
    "Context",
    "Section",
    "SeedCurve",
    "Study",
    "StudyTable",
    "cell_text",
    "summarize",
    "train_command",
]

SCALES = ("quick", "cpu", "paper")
"""quick: a smoke run (under a minute per study); cpu: the tiny preset on the default
corpus (the default); paper: the paper's own scale (configs and torchrun commands)."""

PAIRED_DATA_SEED = 0
"""Every run of a study splits its corpus (and trains its tokenizer) with this seed
(TrainConfig.data_seed), whatever its own seed: paired seeds, one corpus per study and
scale, so that a seed varies the initialisation, the data order and sampling noise
only, and two arms' runs with one seed differ by their arms alone."""

MOELAB_CHOICE = "moelab's choice"
"""How :meth:`Study.paper_sources` marks a value the paper does not state."""


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """One arm of a study: a name (its run folder, ``OUT/runs/NAME/seedS``), the label
    its table rows show, and the TrainConfig fields (``config``) and dotted ``key=value``
    overrides (``sets``, as ``moelab train --set`` takes them) that differ from the
    study's common settings. ``config["model"]`` merges key by key into the common
    ``model`` (and its ``router`` into the common router table). ``tags`` say what kind
    of arm it is, for the analysis."""

    name: str
    label: str
    config: Mapping[str, Any] = field(default_factory=dict)
    sets: tuple[str, ...] = ()
    note: str = ""
    tags: Mapping[str, Any] = field(default_factory=dict)
    """What kind of arm it is, for the analysis (e.g. ``{"kind": "dense"}``, the map,
    the K, a fixed or scheduled tau): stated where the arm is made rather than worked
    out again from its config. Not part of the config."""

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"arm name {self.name!r}: use letters, digits, '-', '_' or '.'")


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def arm_config(common: Mapping[str, Any], arm: Arm, seed: int, out: Path, **extra: Any):
    """The validated TrainConfig of ``arm`` with ``seed``, written to ``out``."""
    from moelab.train import apply_overrides

    fields = _merge(common, arm.config)
    fields = {"data_seed": PAIRED_DATA_SEED, **fields, **extra, "seed": seed, "out": str(out)}
    return apply_overrides(fields, arm.sets)


# Fields `moelab train` takes as options; every other field is passed as --set.
_FLAGS = {
    "preset": "--preset",
    "map": "--map",
    "alpha": "--alpha",
    "top_k": "--top-k",
    "steps": "--steps",
    "out": "--out",
    "data": "--data",
    "parallel": "--parallel",
    "ep": "--ep",
}
_BOOL_FLAGS = {"compile": "--compile", "checkpoint_activations": "--checkpoint-activations"}


def _set_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_set_value(v) for v in value)
    return str(value)


def _flatten(prefix: str, d: Mapping[str, Any]) -> list[str]:
    out = []
    for key, value in d.items():
        if isinstance(value, Mapping):
            out += _flatten(f"{prefix}{key}.", value)
        else:  # None too: it overrides the preset's value
            out.append(f"{prefix}{key}={'none' if value is None else _set_value(value)}")
    return out


def train_command(
    common: Mapping[str, Any], arm: Arm, seed: int, out: str, launcher: str = "moelab"
) -> str:
    """The shell command that trains ``arm`` with ``seed`` into ``out``: ``launcher``
    followed by ``train`` and its options (``launcher`` may be e.g.
    ``torchrun --nproc-per-node 8 -m moelab``)."""
    fields = _merge(common, arm.config)
    fields = {"data_seed": PAIRED_DATA_SEED, **fields, "seed": seed, "out": out}
    words = [*shlex.split(launcher), "train"]
    sets: list[str] = []
    for key, value in fields.items():
        if value is None:
            continue
        if key in _FLAGS:
            words += [_FLAGS[key], str(value)]
        elif key in _BOOL_FLAGS:
            if value:
                words.append(_BOOL_FLAGS[key])
        elif key == "model":
            model = dict(value)
            router = model.pop("router", {}) or {}
            sets += _flatten("model.", model) + _flatten("router.", router)
        else:
            sets.append(f"{key}={_set_value(value)}")
    sets += list(arm.sets)
    for s in sets:
        words += ["--set", s]
    return " ".join(shlex.quote(w) for w in words)


# --------------------------------------------------------------------------- context


@dataclass
class Context:
    """What :meth:`Study.analyse` gets: the trained runs of every arm (one per seed, in
    seed order), where figures go, and the options of the command."""

    study: Study
    scale: str
    seeds: list[int]
    out: Path
    arms: list[Arm]
    runs: dict[str, list[Path]]
    common: dict[str, Any]
    max_batches: int | None = None
    eval_data: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    corpus: str | None = None
    """The identity of the one corpus every run read (moelab.runs.corpus_id)."""
    stage: Path | None = None
    """Where the figures are drawn before :func:`write_outputs` moves them into ``out``
    (None: straight into ``out``)."""

    def figure(self, name: str) -> Path:
        """The path of the PNG figure ``name`` (``OUT/NAME.png``, drawn first in the
        staging folder when there is one)."""
        return (self.stage or self.out) / f"{name}.png"

    def per_seed(self, arm: str, fn: Callable[[Path], Any]) -> list[Any]:
        """``fn(run)`` for each seed's run of ``arm``."""
        return [fn(run) for run in self.runs[arm]]

    def cached(self, run: Path, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, saved as ``RUN/analysis/KEY.json`` for the run's current checkpoint
        so that running the study again does not recompute it (a retrained or extended
        run recomputes)."""
        from moelab.runs import cached

        return cached(run, key, fn)

    def say(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------- curves over seeds


def metric_curve(
    rows: Sequence[Mapping[str, Any]], key: str, x: str = "tokens"
) -> tuple[list[float], list[float]]:
    """``key`` over ``x`` from the rows of a run's metrics.jsonl: the rows where it is a
    finite number (a later row at the same ``x`` replaces an earlier one). ``x``:
    ``"tokens"`` (training tokens; rows logged after more than 0 tokens, for a log axis)
    or ``"step"`` (the training step, step 0 included)."""
    if x not in ("tokens", "step"):
        raise ValueError(f"x must be 'tokens' or 'step', got {x!r}")
    curve: dict[float, float] = {}
    for row in rows:
        v, t = row.get(key), row.get(x)
        if isinstance(v, (int, float)) and isinstance(t, (int, float)) and (t > 0 or x == "step"):
            if math.isfinite(float(v)):
                curve[float(t) if x == "tokens" else int(t)] = float(v)
    return list(curve), list(curve.values())


class SeedCurve(NamedTuple):
    """One curve over the seeds of an arm: at each ``x``, the mean, the lowest and the
    highest value of the seeds."""

    x: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]


def seed_mean(curves: Sequence[tuple[Sequence[float], Sequence[float]]]) -> SeedCurve:
    """Curves ``(x, y)``, one per seed, as one :class:`SeedCurve` over the seeds at the
    x values every seed has."""
    maps_ = [dict(zip(x, y, strict=True)) for x, y in curves]
    if not maps_:
        return SeedCurve([], [], [], [])
    xs = sorted(set.intersection(*(set(m) for m in maps_)))
    mean = [sum(m[x] for m in maps_) / len(maps_) for x in xs]
    low, high = [min(m[x] for m in maps_) for x in xs], [max(m[x] for m in maps_) for x in xs]
    return SeedCurve(xs, mean, low, high)


# ----------------------------------------------------------------------------- study


class Study:
    """Base class of a study. Subclasses set ``name``, ``title``, ``paper`` and
    override :meth:`common`, :meth:`arms`, :meth:`analyse` (and
    :meth:`paper_sources` unless they refuse the paper scale with ``paper_refusal``)."""

    name: str = ""
    title: str = ""
    paper: str = ""
    """The paper the study reproduces (title, as the report cites it)."""
    paper_refusal: str | None = None
    """Set when the study has no paper-scale experiment: the message the paper scale
    is refused with."""
    launcher: str = "torchrun --nproc-per-node 8 -m moelab"
    """How the paper scale's commands start training."""
    reference: str | None = None
    """The arm every other arm is compared with, seed by seed (the report's paired
    differences, moelab.studies.paired): its name (tables may show its label)."""
    claims: tuple[str, ...] = ()
    """The keys of the paper's claims the study tests: its analysis returns a
    :func:`moelab.studies.paired.findings_section` with one Finding for each."""

    def common(self, scale: str) -> dict[str, Any]:
        """TrainConfig fields every arm shares at ``scale``."""
        raise NotImplementedError

    def arms(self, scale: str, options: Mapping[str, Any]) -> list[Arm]:
        """The arms at ``scale`` (``options``: the command's study options)."""
        raise NotImplementedError

    def paper_sources(self) -> dict[str, str]:
        """For the paper scale: each value's source, keyed by the dotted field (as
        ``--set`` names it: ``lr``, ``model.d_model``, ``router.top_k``) or by
        ``ARM:field`` for a value of one arm. A source is "stated: WHERE" (the paper's
        section or table) or starts with ``MOELAB_CHOICE``."""
        return {}

    def analyse(self, ctx: Context) -> list[Section]:
        """Measure the trained runs and return the report's sections."""
        raise NotImplementedError


def _command_line(study: Study, scale: str, seeds: int, out: Path) -> str:
    words = ["moelab", "study", study.name, "--scale", scale, "--seeds", str(seeds)]
    return " ".join(shlex.quote(w) for w in [*words, "--out", str(out)])


def _report_head(study: Study, ctx: Context, timing: dict[str, Any]) -> list[str]:
    """The lines of report.md before its sections: the title, the seeds, the command,
    the time taken and each arm's runs."""
    out = ctx.out
    n = len(ctx.seeds)
    md = [
        f"# Study: {study.title}",
        "",
        f"Reproduces: *{study.paper}*." if study.paper else "",
        "",
        f"Scale `{ctx.scale}`, {n} seed{'s' if n != 1 else ''} "
        f"({', '.join(map(str, ctx.seeds))}); "
        + (
            "every number is mean ± sd over the seeds (sample sd)."
            if n >= 2
            else "one seed: differences smaller than seed-to-seed variation cannot be told "
            "apart (run with --seeds 3)."
        ),
        "",
        (
            f"Paired seeds: every run read corpus `{ctx.corpus}` (one tokenizer, one "
            "split); a seed changes the initialisation, the data order and sampling noise "
            "only, and differences between arms are taken seed by seed."
            if ctx.corpus
            else ""
        ),
        "",
        f"Command: `{_command_line(study, ctx.scale, n, out)}`. Training took "
        f"{sum(map(sum, timing['arm_seconds'].values())) / 60:.1f} min in all (as recorded "
        f"when each run was trained); this call took {timing['seconds'] / 60:.1f} min, "
        f"{timing['train_seconds'] / 60:.1f} of them training or checking runs.",
        "",
        "| arm | label | runs (this call) | training (s, per seed) |",
        "|---|---|---|---|",
    ]
    for arm in ctx.arms:
        secs = ", ".join(f"{t:.0f}" for t in timing["arm_seconds"][arm.name])
        states = ", ".join(timing["arm_states"][arm.name])
        md.append(f"| `{arm.name}` | {arm.label} | {states} | {secs} |")
    return md


def write_outputs(
    study: Study,
    ctx: Context,
    sections: list[Section],
    timing: dict[str, Any],
    staging: Staging | None = None,
) -> dict[str, Any]:
    """Write report.md, tables.tex and results.json of a trained study; return the
    results document. With ``staging`` (where ``ctx.stage`` drew the figures) every
    file is written there first and then renamed into ``ctx.out``, report.md last."""
    if staging is None:
        staging = Staging(ctx.out)
        try:
            return write_outputs(study, ctx, sections, timing, staging)
        finally:
            staging.discard()
    out = ctx.out
    here = staging.dir
    sections, findings = _with_findings_first(study, ctx, sections)
    md = _report_head(study, ctx, timing)
    md.append("")
    tables: list[StudyTable] = []
    figures: list[str] = []
    for sec in sections:
        md += [f"## {sec.title}", ""]
        if sec.text:
            md += [sec.text.strip(), ""]
        for table in sec.tables:
            tables.append(table)
            md += [f"**{table.title}**", "", table.markdown(), ""]
            if table.note:
                md += [table.note.strip(), ""]
        for fig in sec.figures:
            fig = Path(fig)
            if fig.is_relative_to(here):
                rel = fig.relative_to(here)
            else:
                rel = fig.relative_to(out) if fig.is_relative_to(out) else fig
            figures.append(str(rel))
            md += [f"![{fig.stem}]({rel})", ""]
    keys = [t.key for t in tables]
    if len(set(keys)) != len(keys):
        raise ValueError(f"study {study.name}: table keys repeat: {keys}")
    report, latex = out / "report.md", out / "tables.tex"
    (here / "report.md").write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    (here / "tables.tex").write_text(
        "% tables of moelab study "
        + study.name
        + " (needs \\usepackage{booktabs,graphicx})\n\n"
        + "\n\n".join(t.latex() for t in tables)
        + "\n",
        encoding="utf-8",
    )
    arm_labels = {a.name: a.label for a in ctx.arms}
    doc = json_safe(
        {
            "study": study.name,
            "title": study.title,
            "scale": ctx.scale,
            "seeds": ctx.seeds,
            "arms": [
                {"name": a.name, "label": a.label, "runs": [str(r) for r in ctx.runs[a.name]]}
                for a in ctx.arms
            ],
            "corpus": ctx.corpus,
            "reference": study.reference,
            "findings": [
                f.to_json(lambda src: source_record(src, tables, arm_labels)) for f in findings
            ],
            "tables": [t.to_json() for t in tables],
            "figures": figures,
            "report": str(report),
            "latex": str(latex),
            **timing,
        }
    )
    write_json(here / "results.json", doc, indent=1)
    staging.commit(last=("tables.tex", "results.json", "report.md"))
    for problem in audit(doc):  # a study whose records another reader could not check
        ctx.say(f"warning: results.json: {problem}")
    return doc


def _with_findings_first(
    study: Study, ctx: Context, sections: list[Section]
) -> tuple[list[Section], list[Finding]]:
    """The sections with the Findings section first and the paired differences from
    the reference arm last; the findings, checked to be one per claim of the study."""
    first = [s for s in sections if any(t.key == "findings" for t in s.tables)]
    rest = [s for s in sections if s not in first]
    findings = [f for s in first for t in s.tables for f in getattr(t, "findings", [])]
    keys = [f.key for f in findings]
    if study.claims and sorted(keys) != sorted(study.claims):
        missing = sorted(set(study.claims) - set(keys))
        extra = sorted(set(keys) - set(study.claims))
        raise ValueError(
            f"study {study.name}: its findings must test each of its claims once "
            f"(missing {missing}, not claims {extra}, given {keys})"
        )
    out = first + rest
    if study.reference is not None:
        arm = next((a for a in ctx.arms if a.name == study.reference), None)
        if arm is not None:
            tables = [t for s in rest for t in s.tables]
            labels = {a.name: a.label for a in ctx.arms}
            paired = paired_tables(tables, arm.name, len(ctx.seeds), arms=labels)
            if paired:
                n = len(ctx.seeds)
                out.append(
                    Section(
                        f"Paired differences from {arm.label}",
                        text=(
                            f"Every arm minus the reference arm `{arm.name}`, seed by seed, "
                            f"over {n} seed{'s' if n != 1 else ''} that share one corpus"
                            + (" (one seed: nothing can be resolved)." if n < 2 else ".")
                        ),
                        tables=paired,
                    )
                )
    return out, findings


def write_paper(
    study: Study, common: dict[str, Any], arms: list[Arm], seeds: list[int], out: Path
) -> dict[str, Any]:
    """The paper scale: ``OUT/paper/ARM.json`` (the full TrainConfig of each arm and
    the source of each stated value), ``OUT/paper/commands.sh`` and ``OUT/report.md``
    listing the commands and the parameter counts of each arm's model."""
    sources = study.paper_sources()
    folder = out / "paper"
    folder.mkdir(parents=True, exist_ok=True)
    commands = []
    configs = []
    for arm in arms:
        for s in seeds:
            run = f"{out}/runs/{arm.name}/seed{s}"
            config = arm_config(common, arm, s, Path(run))
            cmd = train_command(common, arm, s, run, launcher=study.launcher)
            commands.append(cmd)
            if s == seeds[0]:
                counts = _param_counts(config)
                doc = {
                    "arm": arm.name,
                    "label": arm.label,
                    "config": config.to_dict(),
                    "params": counts,
                    "sources": _arm_sources(sources, arm.name),
                    "command": cmd,
                }
                write_json(folder / f"{arm.name}.json", doc, indent=1)
                configs.append(doc)
    (folder / "commands.sh").write_text(
        "#!/bin/sh\n# moelab study "
        + study.name
        + " at the paper's scale\nset -e\n"
        + "\n".join(commands)
        + "\n",
        encoding="utf-8",
    )
    md = [
        f"# Study: {study.title} (paper scale)",
        "",
        f"Reproduces: *{study.paper}*. Nothing was trained; `commands.sh` trains every arm "
        "(or run this study again with `--run`).",
        "",
        "| arm | label | total params | active params | command |",
        "|---|---|---:|---:|---|",
    ]
    for doc in configs:
        p = doc["params"]
        md.append(
            f"| `{doc['arm']}` | {doc['label']} | {p['total']:,} | {p['active']:,} | "
            f"`{doc['command']}` |"
        )
    md += ["", "## Where each value comes from", "", "| value | source |", "|---|---|"]
    md += [f"| `{k}` | {v} |" for k, v in sources.items()]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(md) + "\n")
    return json_safe(
        {
            "study": study.name,
            "title": study.title,
            "scale": "paper",
            "seeds": seeds,
            "configs": configs,
            "sources": sources,
            "commands": commands,
            "report": str(report),
            "trained": False,
        }
    )


def _arm_sources(sources: Mapping[str, str], arm: str) -> dict[str, str]:
    out = {}
    for key, value in sources.items():
        owner, sep, rest = key.partition(":")
        if not sep:
            out[key] = value
        elif owner == arm:
            out[rest] = value
    return out


def _param_counts(config: Any) -> dict[str, int]:
    """Total, active and router parameters of the arm's model (as `moelab params`)."""
    from moelab.model.config import param_counts

    return {k: int(v) for k, v in param_counts(config.model_config()).items()}
