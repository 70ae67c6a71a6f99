"""Driving a study: every arm trained with every seed (a finished run reused, an
interrupted one resumed, one prepared corpus shared by every arm and seed: paired
seeds), then the analysis and the report files (:func:`run_study`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moelab._io import write_json
from moelab.runs.folders import Staging, check_out, write_marker
from moelab.runs.layout import CONFIG, DATA, SUMMARY, TOKENIZER
from moelab.studies.core import (
    SCALES,
    Arm,
    Context,
    Study,
    arm_config,
    write_outputs,
    write_paper,
)

__all__ = ["run_study"]


def _data_key(config: Any) -> tuple[Any, ...] | None:
    """What a run's prepared data (tokenizer and shards) depend on; None where the run
    reads a `moelab data prepare` folder (linked, nothing to share)."""
    from moelab.data.prepare import is_prepared

    if is_prepared(config.data):
        return None
    return (config.data, config.vocab_size, config.val_fraction, config.split_seed)


def _share_data(donor: Path, run: Path) -> None:
    """Give the new run folder ``run`` the tokenizer and shards that ``donor`` prepared
    from the same corpus, vocabulary size, split and seed (exactly what training would
    prepare again): hard links where the file system allows, else copies;
    tokenizer.json last, since train reads its presence as "data complete"."""
    import os
    import shutil

    (run / DATA).mkdir(parents=True, exist_ok=True)
    files = [p.relative_to(donor) for p in sorted((donor / DATA).iterdir()) if p.is_file()]
    for rel in [*files, Path("tokenizer.json")]:
        target = run / rel
        try:
            os.link(donor / rel, target)
        except OSError:
            shutil.copy2(donor / rel, target)


def _train_one(config: Any, progress: bool, donor: Path | None = None) -> tuple[str, float]:
    """Train one run, reusing what its folder holds: a finished run is read back, an
    interrupted one resumes (a run whose settings differ is refused by train()).
    Returns ``("reused" | "resumed" | "trained", seconds)``: the seconds that training
    the run took over all the calls that trained it (kept in ``RUN/study_time.json``),
    so that a reused run reports the time it took when it was trained."""
    from moelab.train import train

    run = Path(config.out)
    t0 = time.perf_counter()
    summary = run / SUMMARY
    state = "trained"
    if summary.is_file():
        try:
            done = json.loads(summary.read_text(encoding="utf-8")).get("steps") == config.steps
        except (OSError, json.JSONDecodeError, AttributeError):
            done = False
        if done:
            train(config, resume=True)  # checks the settings; trains nothing
            return "reused", _recorded_seconds(run)
    if (run / CONFIG).is_file():
        state = "resumed"
        before = _recorded_seconds(run)
        try:
            train(config, resume=True)
        finally:
            _record_seconds(run, before + time.perf_counter() - t0)
    else:
        try:
            if donor is not None and not run.exists():
                _share_data(donor, run)
                train(config, resume=True)  # no checkpoint: step 0 on the shared data
            else:
                train(config)
        finally:
            if (run / CONFIG).is_file():  # training started (not a refused config)
                _record_seconds(run, time.perf_counter() - t0)
    return state, _recorded_seconds(run)


def _recorded_seconds(run: Path) -> float:
    try:
        return float(json.loads((run / "study_time.json").read_text(encoding="utf-8"))["seconds"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0.0


def _record_seconds(run: Path, seconds: float) -> None:
    write_json(run / "study_time.json", {"seconds": seconds}, indent=None)


def _check_scale(study: Study, scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if scale == "paper" and study.paper_refusal:
        raise ValueError(study.paper_refusal)


def run_study(
    study: Study | str,
    out: str | Path,
    scale: str = "cpu",
    seeds: int = 1,
    *,
    data: str | None = None,
    eval_data: str | None = None,
    threads: int | None = None,
    run: bool = False,
    max_batches: int | None = None,
    options: Mapping[str, Any] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run ``study`` at ``scale`` with ``seeds`` seeds (0 .. seeds-1) into ``out`` and
    return the results document (also written to ``OUT/results.json``).

    ``out`` must be new, empty or this study's own folder (``.moelab-study.json`` marks
    it; its runs are reused or resumed); ``overwrite``: also another study's or a
    report's folder. A run folder, a corpus or a folder holding anything else raises
    FileExistsError before anything is trained (see :mod:`moelab.runs.folders`).

    At the paper scale the configs and commands are written and nothing is trained
    unless ``run``. ``data``: the training corpus (None: the default one);
    ``eval_data``: a second corpus for out-of-domain routing statistics (studies that
    use it); ``threads``: each training's torch threads (None: the free cores);
    ``max_batches``: validation batches for the analysis (None: the scale's own)."""
    from moelab.studies import get_study

    study = get_study(study) if isinstance(study, str) else study
    _check_scale(study, scale)
    if int(seeds) != seeds or seeds < 1:
        raise ValueError(f"seeds must be a whole number >= 1, got {seeds}")
    options = dict(options or {})
    out = Path(out)
    check_out(out, "study", overwrite=overwrite, study=study.name)
    common = _common(study, scale, data, threads, progress)
    arms = _arms(study, scale, options)
    seed_list = list(range(int(seeds)))
    t0 = time.perf_counter()
    if scale == "paper":
        # the commands run on other machines: this one's threads and progress bar stay out
        shared = {k: v for k, v in common.items() if k not in ("threads", "progress")}
        write_marker(out, "study", study=study.name, scale=scale)
        written = write_paper(study, shared, arms, seed_list, out)
        if not run:
            return written
    configs = _configs(common, arms, seed_list, out)
    _refuse_unpaired(configs, out)
    write_marker(out, "study", study=study.name, scale=scale)  # the folder is the study's
    timings, states = _train_all(study, arms, configs, progress)
    train_seconds = time.perf_counter() - t0
    runs = {a.name: [out / "runs" / a.name / f"seed{s}" for s in seed_list] for a in arms}
    corpus = _one_corpus(runs)
    ctx = Context(
        study=study,
        scale=scale,
        seeds=seed_list,
        out=out,
        arms=arms,
        runs=runs,
        common=common,
        max_batches=max_batches,
        eval_data=eval_data,
        options=options,
        progress=progress,
        corpus=corpus,
    )
    return _analyse(study, ctx, t0, train_seconds, timings, states)


def _common(
    study: Study, scale: str, data: str | None, threads: int | None, progress: bool
) -> dict[str, Any]:
    """The study's common settings at ``scale`` with the command's corpus and threads."""
    common = dict(study.common(scale))
    if data is not None:
        common["data"] = data
    if threads is not None:
        common["threads"] = threads
    common.setdefault("progress", progress)
    return common


def _arms(study: Study, scale: str, options: Mapping[str, Any]) -> list[Arm]:
    arms = study.arms(scale, options)
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"study {study.name}: arm names repeat: {names}")
    return arms


def _configs(
    common: Mapping[str, Any], arms: list[Arm], seed_list: list[int], out: Path
) -> dict[tuple[str, int], Any]:
    """Every arm's config for every seed, validated before anything trains."""
    # validate every config before anything trains
    configs = {
        (a.name, s): arm_config(common, a, s, out / "runs" / a.name / f"seed{s}")
        for a in arms
        for s in seed_list
    }
    # a missing corpus fails here, before any run folder is made
    from moelab.data import is_prepared, iter_documents

    for source in {c.data for c in configs.values()}:
        if not is_prepared(source):
            iter_documents(source)
    return configs


def _refuse_unpaired(configs: Mapping[tuple[str, int], Any], out: Path) -> None:
    """Refuse, before anything trains, a run folder under ``OUT/runs`` that split its
    data another way than the study's runs do (a run made before paired seeds split it
    with its own seed, so its seeds differ in their data too): pairing it with the
    others would compare two corpora."""
    for config in configs.values():
        path = Path(config.out) / CONFIG
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue  # train() refuses it with its own message
        if not isinstance(saved, dict) or saved.get("data_seed") == config.data_seed:
            continue
        how = (
            "before paired seeds (its seed chose its own data split and tokenizer)"
            if saved.get("data_seed") is None
            else f"with data_seed = {saved.get('data_seed')!r}"
        )
        raise ValueError(
            f"{path.parent} was trained {how}, but this study's runs all split the corpus "
            f"with data_seed = {config.data_seed}: its results cannot be paired with theirs; "
            f"run the study into a new --out, or remove {out / 'runs'} to train again"
        )


def _one_corpus(runs: Mapping[str, list[Path]]) -> str | None:
    """The identity of the corpus every run read (moelab.runs.corpus_id); a study whose
    runs read different data is refused, naming two of them."""
    from moelab.runs import corpus_id

    seen: dict[str, Path] = {}
    for paths in runs.values():
        for run in paths:
            ident = corpus_id(run)
            if ident is not None:
                seen.setdefault(ident, run)
    if len(seen) > 1:
        (a, ra), (b, rb) = list(seen.items())[:2]
        raise ValueError(
            f"the runs of this study read different data: {ra} read corpus {a}, {rb} read "
            f"{b}; a paired comparison needs one corpus: remove the runs of the other "
            "corpus (or use a new --out) and run the study again"
        )
    return next(iter(seen), None)


def _train_all(
    study: Study, arms: list[Arm], configs: Mapping[tuple[str, int], Any], progress: bool
) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """Train (or reuse, or resume) every run; each arm's seconds and states per seed."""
    # arms of one seed read the same corpus: the first prepares it, the others share it
    prepared: dict[tuple[Any, ...], Path] = {}
    timings: dict[str, list[float]] = {a.name: [] for a in arms}
    states: dict[str, list[str]] = {a.name: [] for a in arms}
    total = len(configs)
    for i, ((name, s), config) in enumerate(configs.items(), 1):
        if progress:
            print(f"[{i}/{total}] {study.name}: arm {name}, seed {s}", file=sys.stderr, flush=True)
        key = _data_key(config)
        donor = prepared.get(key) if key is not None else None
        if progress and donor is not None and not Path(config.out).exists():
            print(f"  (data prepared for {donor.parent.name} shared)", file=sys.stderr, flush=True)
        state, seconds = _train_one(config, progress, donor)
        if key is not None and (Path(config.out) / TOKENIZER).is_file():
            prepared.setdefault(key, Path(config.out))
        states[name].append(state)
        timings[name].append(seconds)
    return timings, states


def _analyse(
    study: Study,
    ctx: Context,
    t0: float,
    train_seconds: float,
    timings: dict[str, list[float]],
    states: dict[str, list[str]],
) -> dict[str, Any]:
    """The study's analysis of the trained runs, and its report files written."""
    if ctx.progress:
        print(f"{study.name}: analysing the runs", file=sys.stderr, flush=True)
    staging = Staging(ctx.out)  # the figures and report files, renamed into out at the end
    ctx.stage = staging.dir
    try:
        sections = study.analyse(ctx)
        seconds = time.perf_counter() - t0
        return write_outputs(
            study,
            ctx,
            sections,
            {
                "seconds": seconds,
                "train_seconds": train_seconds,
                "arm_seconds": timings,
                "arm_states": states,
            },
            staging,
        )
    finally:
        staging.discard()
