"""The run folder (``config.out``, laid out as moelab.train.loop describes): the checks
before a run writes into it (``overwrite`` only on a moelab run folder, ``resume`` only
with the run's own settings), the data it prepares, its config record (config.json),
the command that resumes it, and the clean-up of a start that failed before its first
step; at the end, the summary (summary.json, what train() returns), also of a run found
finished.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from moelab._io import json_bytes, write_atomic, write_json
from moelab._strict_json import json_safe
from moelab.data import (
    TokenShard,
    load_corpus,
    split_documents,
    train_tokenizer,
    unigram_entropy,
    write_shards,
)
from moelab.data.corpus import corpus_warnings_as_lines
from moelab.model import ModelConfig, Transformer, param_counts
from moelab.routing.config import CHANGED_DEFAULTS
from moelab.runs.checkpoints import has_checkpoint
from moelab.runs.config import flat, read_config
from moelab.runs.layout import CONFIG, DATA, METRICS, RUN_ENTRIES, SUMMARY, TOKENIZER
from moelab.runs.metrics import read_rows

from . import distributed as D
from . import parallel as P
from .config import TrainConfig
from .lock import LOCK
from .metrics import router_state
from .provenance import run_info
from .records import CALIBRATED, PREPARED_KEYS, calibration_record, prepared_settings
from .validation import count_val_batches


def say_main(info: D.DistInfo, message: str) -> None:
    """A line for the user on stderr (rank 0 only)."""
    if info.is_main:
        print(message, file=sys.stderr, flush=True)


def _foreign(run: Path) -> list[str]:
    """What ``run`` holds that a moelab run folder does not (dot files are moelab's lock
    and the temporaries of an interrupted atomic write)."""
    if not run.is_dir():
        return []
    return sorted(p.name for p in run.iterdir() if p.name not in RUN_ENTRIES and p.name[0] != ".")


def prepare_run_dir(run: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an existing run unless told how (checked on every rank, before
    any rank writes). Each message names a way out that works: ``resume`` on a run that
    failed before its first checkpoint starts it again from step 0; ``overwrite`` is
    offered, and done, only for a folder that holds nothing but a moelab run's entries
    (never a folder with files of the user's)."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other; pick one")
    if run.exists() and not run.is_dir():
        raise FileExistsError(
            f"{run} is a file, not a run folder; pass the run's folder (--out), or another "
            "path for a new run"
        )
    entries = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    visible = [name for name in entries if name[0] != "."]
    foreign = _foreign(run)
    mine = (
        f"it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which "
        "moelab did not write"
    )
    if overwrite:
        if foreign:
            raise FileExistsError(
                f"refusing to overwrite {run}: it is not a moelab run folder ({mine}); "
                "overwrite deletes only a folder moelab made: choose another folder"
            )
        return
    if resume:
        if not visible:
            raise FileNotFoundError(
                f"cannot resume: {run} does not exist or is empty; drop resume (--resume) "
                "to start a new run there"
            )
        if foreign and not has_checkpoint(run):
            raise FileExistsError(
                f"cannot resume: {run} holds no checkpoint and is not a moelab run folder "
                f"({mine}); choose another folder"
            )
    elif visible:
        if foreign:
            way = f"it is not a moelab run folder ({mine}): choose another folder"
        elif has_checkpoint(run):
            way = (
                "pass resume=True (--resume) to continue it or overwrite=True (--overwrite) "
                "to delete it and start over"
            )
        else:
            way = (
                "it holds no checkpoint yet: pass resume=True (--resume) to start it again "
                "from step 0 (keeping its prepared data), or overwrite=True (--overwrite) to "
                "delete it"
            )
        raise FileExistsError(f"run folder {run} already exists; {way}")


def clear_run(run: Path, keep: str | None = LOCK) -> None:
    """Delete what a run folder holds, but ``keep`` (its lock, held by this process)."""
    for p in run.iterdir():
        if p.name == keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


_RESUME_FREE = (
    "progress",
    "device",
    "out",
    "steps",
    "threads",
    "run_info",
    CALIBRATED,
    "parallel",
    "ep",
    "compile",
    "checkpoint_activations",
    "log",
    "dead_fraction",
    "keep_every",
)
"""Settings a resumed run may change (the sinks, the dead-expert fraction and the
checkpoints kept, which change what is reported or kept, not what is trained; ``out``
may name the same folder another way; ``steps`` may grow, not shrink, see
:func:`lr_at`; ``threads`` with a warning; the parallel mode, compilation and
activation checkpointing, which the checkpoint does not depend on: see
moelab.train.parallel); the model is compared as resolved (_MODEL_KEYS), every other
setting must match config.json."""
_MODEL_KEYS = ("preset", "model", "map", "alpha", "top_k")


def _keep_changed_defaults(
    config: TrainConfig, saved: TrainConfig, info: D.DistInfo
) -> TrainConfig:
    """``config`` with the saved run's values of the router keys whose default changed
    (:data:`moelab.routing.config.CHANGED_DEFAULTS`) where ``config`` does not set them
    (neither its router overrides nor its preset name them, so today's default would
    apply): the run goes on as it was trained, and says so once. A key ``config`` does
    set is compared as any other setting (a different value is refused)."""
    ours, theirs = config.model_config().router_config(), saved.model_config().router_config()
    given = config.router_keys_set()
    kept = {
        key: getattr(theirs, key)
        for key in CHANGED_DEFAULTS
        if key not in given and getattr(ours, key) != getattr(theirs, key)
    }
    if not kept:
        return config
    say_main(
        info,
        "resuming with the run's own "
        + ", ".join(f"router.{k}={v!r}" for k, v in kept.items())
        + " (today's default differs; pass --set router.KEY=VALUE to change it)",
    )
    router = {**config.model.get("router", {}), **kept}
    return dataclasses.replace(config, model={**config.model, "router": router})


def _read_run_config(path: Path) -> dict[str, Any]:
    """A run's config.json (``path``) as :func:`moelab.runs.read_config` reads it."""
    return read_config(path.parent)


def check_resume_config(
    config: TrainConfig, run: Path, threads: int, info: D.DistInfo
) -> TrainConfig:
    """A resumed run continues the run it finds: refuse settings that differ from the
    saved ones (a different schedule, model or data would silently mix two runs). The
    model is compared field by field as resolved from each side, so a run written before
    config.json held the resolved model ("model": {}) is compared the same way. A
    different thread count is allowed with a warning. Returns ``config``, with the run's
    values of router keys whose default changed since it was written
    (:func:`_keep_changed_defaults`)."""
    path = run / CONFIG
    if not path.is_file():
        return config
    saved = _read_run_config(path)
    config = _keep_changed_defaults(config, TrainConfig.from_dict(saved), info)
    given = config.to_dict()
    # NOTE: prepared data fix vocab_size and val_fraction (config holds the folder's);
    # a run written before that was recorded may hold other values
    free = _RESUME_FREE + _MODEL_KEYS + (PREPARED_KEYS if prepared_settings(config.data) else ())
    diff = [
        f"{key}: {saved.get(key)!r} in the run, {given.get(key)!r} given"
        # NOTE: only the saved keys: a run written before a setting existed ran without it
        for key in sorted(saved)
        if key not in free and saved[key] != given.get(key)
    ]
    vocab = (saved.get("model") or {}).get("vocab_size")
    theirs = flat(TrainConfig.from_dict(saved).resolved_model(vocab), "model.")
    ours = flat(config.resolved_model(vocab), "model.")
    diff += [
        f"{key}: {theirs.get(key)!r} in the run, {ours.get(key)!r} given"
        for key in sorted(set(theirs) | set(ours))
        if theirs.get(key) != ours.get(key)
    ]
    # NOTE: a run written before data_seed existed split its data with its seed
    if not prepared_settings(config.data):
        theirs_split = saved.get("data_seed")
        theirs_split = saved.get("seed") if theirs_split is None else theirs_split
        if "data_seed" not in saved and theirs_split != config.split_seed:
            diff.append(
                f"data_seed: the run split its data with seed {theirs_split!r} (it predates "
                f"data_seed), {config.split_seed!r} given"
            )
    if config.steps < saved.get("steps", 0):
        diff.append(
            f"steps: {saved['steps']} in the run, {config.steps} given (a resumed run can "
            f"only be extended: steps >= {saved['steps']})"
        )
    if diff:
        raise ValueError(
            f"cannot resume {run} with other settings ({'; '.join(diff)}); pass the "
            "settings of its config.json, or start a new run"
        )
    if saved.get("threads") is not None and saved["threads"] != threads:
        say_main(
            info,
            f"warning: the run trained with {saved['threads']} thread(s), this part uses "
            f"{threads}: float results, hence the trajectory, can differ from a run that "
            f"did not stop (pass threads={saved['threads']} / --threads {saved['threads']} "
            "to keep them)",
        )
    return config


def record_config(
    config: TrainConfig,
    run: Path,
    vocab_size: int,
    threads: int,
    start: int,
    info: D.DistInfo,
    calibrated: dict[str, Any] | None = None,
) -> None:
    """config.json: a new run's settings (model resolved), thread count, run_info and
    the cuts calibration set (``calibrated``, see moelab.train.records); a resumed run's
    new ``steps`` and its own provenance under ``run_info["resumes"]``."""
    path = run / CONFIG
    provenance = run_info(info.device, threads, info.world_size)
    if start == 0 or not path.is_file():
        from moelab.data import corpus_identity

        # NOTE: the data's identity (tokenizer and split), so that runs meant to read
        # the same corpus (a study's paired seeds) can be checked to have
        corpus = corpus_identity(run / TOKENIZER, run / DATA)
        saved = {
            **config.to_dict(),
            "model": config.resolved_model(vocab_size),
            "threads": threads,
            "run_info": {**provenance, "corpus": corpus},
        }
        if calibrated is not None:
            saved[CALIBRATED] = calibrated
    else:
        saved = _read_run_config(path)
        saved["steps"] = config.steps
        if prepared_settings(config.data):  # the folder's values, which the run uses
            saved.update({key: getattr(config, key) for key in PREPARED_KEYS})
        saved.setdefault("run_info", {}).setdefault("resumes", []).append(
            {"step": start, **provenance}
        )
    write_json(path, saved)


def prepare_data(config: TrainConfig, run: Path) -> None:
    """Tokenizer (trained on the training documents only) and the train/val shards; a
    folder of ``moelab data prepare`` gives its own (linked, not tokenised again). In a
    run folder that records the data it trained on (config.json: a resumed run), what
    is there, or was prepared again, must be that data (:func:`moelab.runs.check_corpus`:
    a run never goes on with another corpus)."""
    _make_data(config, run)
    if (run / CONFIG).is_file():
        from moelab.data.run_corpus import check_corpus, corpus_record

        check_corpus(run)
        record = corpus_record(run)
        if record is not None and "sha256" not in record:
            # NOTE: a record of one digest over the three files (an older moelab), just
            # found right: each file's own is added, so that a later check names the file
            from moelab.data import corpus_identity

            saved = _read_run_config(run / CONFIG)
            now = corpus_identity(run / TOKENIZER, run / DATA)
            saved["run_info"]["corpus"]["sha256"] = now["sha256"]
            write_json(run / CONFIG, saved)


def _make_data(config: TrainConfig, run: Path) -> None:
    """The run's tokenizer and shards, where they are not there yet."""
    if (run / TOKENIZER).is_file() and (run / DATA / "val.json").is_file():
        return
    from moelab.data.prepare import is_prepared, link_prepared

    if is_prepared(config.data):
        link_prepared(config.data, run)  # type: ignore[arg-type]
        return
    entry = None
    if config.data is None:  # the default corpus: as an earlier run prepared it, if cached
        from moelab.data.cache import default_corpus_entry, restore_default_corpus

        entry = default_corpus_entry(config.vocab_size, config.val_fraction, config.split_seed)
        if restore_default_corpus(entry, run):
            return
    # NOTE: skipped files of a corpus folder: one line, not Python's warning display
    with corpus_warnings_as_lines(lambda line: print(line, file=sys.stderr, flush=True)):
        docs = load_corpus(config.data)
    if len(docs) < 2:
        raise ValueError(f"the corpus has {len(docs)} document(s); need at least 2")
    seed = config.split_seed
    train_ids, _ = split_documents(len(docs), config.val_fraction, seed)
    tok = train_tokenizer((docs[i] for i in train_ids), config.vocab_size)
    source = str(config.data) if config.data is not None else "default"
    write_shards(docs, tok, run / DATA, val_fraction=config.val_fraction, seed=seed, source=source)
    # NOTE: written last: its presence marks the data as complete
    write_atomic(run / TOKENIZER, tok.to_json().encode())
    if entry is not None:  # kept for the next run on the default corpus
        from moelab.data.cache import store_default_corpus

        store_default_corpus(entry, run)


def resume_command(config: TrainConfig) -> str:
    """The ``moelab train`` command that resumes the run of ``config``: its settings as
    flags and ``--set`` overrides (those that differ from the defaults), and ``--resume``.
    The progress bar is left out (it may change on resume)."""
    args = ["moelab", "train", "--preset", config.preset, "--steps", str(config.steps)]
    for name, flag in (("map", "--map"), ("alpha", "--alpha"), ("top_k", "--top-k")):
        if getattr(config, name) is not None:
            args += [flag, str(getattr(config, name))]
    args += ["--out", config.out]
    if config.data is not None:
        args += ["--data", config.data]
    if config.threads is not None:
        args += ["--threads", str(config.threads)]

    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    skip = {"preset", "steps", "map", "alpha", "top_k", "out", "data", "threads", "model"}
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if f.name in skip or f.name == "progress" or value == default:
            continue
        args += ["--set", f"{f.name}={text(list(value) if isinstance(value, tuple) else value)}"]
    for key, value in config.model.items():
        if key == "router":
            args += [arg for k, v in value.items() for arg in ("--set", f"router.{k}={text(v)}")]
        else:
            args += ["--set", f"model.{key}={text(value)}"]
    return shlex.join([*args, "--resume"])


def remove_failed_start(run: Path, existed: bool) -> None:
    """What a start that failed before its first step made: the folder itself when it
    did not exist before, else its contents (it held nothing of the user's)."""
    if not existed:
        shutil.rmtree(run, ignore_errors=True)
    elif run.is_dir():
        clear_run(run, keep=None)


def trim_metrics(run: Path, step: int, info: D.DistInfo) -> None:
    """Drop lines logged after the checkpoint a resumed run continues from (and a last
    line cut off by an interrupted write, with a warning)."""
    path = run / METRICS
    if not path.is_file():
        return
    rows = read_rows(path, lambda line: say_main(info, line))
    keep = b"".join(json_bytes(r, indent=None) for r in rows if r["step"] <= step)
    write_atomic(path, keep)


def build_summary(
    config: TrainConfig,
    run: Path,
    steps: int,
    result: dict[str, Any],
    val_shard: TokenShard,
    mc: ModelConfig,
    par: P.Parallel,
    threads: int,
) -> dict[str, Any]:
    """What train() returns and writes to summary.json (not finite numbers as None)."""
    info, model = par.info, par.model
    assert isinstance(model, Transformer)
    with par.routers_gathered():
        state = router_state(model)
    rc = mc.router_config()
    per_rank = config.batch_size // info.world_size
    calibrated = calibration_record(model, config)
    if calibrated is not None:
        state = {CALIBRATED: calibrated, **state}
    if result.get("dead_layers"):  # the final evaluation's (a run with MoE layers)
        dead = result["dead_layers"]
        state = {"dead_experts": sum(dead), "dead_layers": dead, **state}
    return json_safe(
        {
            "run": str(run),
            "steps": steps,
            "train_loss": result["loss"],
            "val_loss": result["val_loss"],
            "tokens": steps * config.batch_size * config.seq_len,
            # the last logging window's rate; the average since the first step of this
            # part of the run; the run's wall time over all its parts
            "tokens_per_s": result["tokens_per_s"],
            "tokens_per_s_avg": result.get("tokens_per_s_avg", float("nan")),
            "wall_s": result.get("wall_s", float("nan")),
            "unigram_entropy": unigram_entropy(val_shard),
            # what val_loss covers: the first val_batches global batches, in file order
            "val_batches": (n_val := count_val_batches(val_shard, per_rank, config, info)),
            "val_tokens": n_val * config.batch_size * config.seq_len,
            "world_size": info.world_size,
            "device": str(info.device),
            "threads": threads,
            "params": param_counts(mc),
            "model": {"map": rc.map, "top_k": rc.top_k},
            **result["routing"],
            **state,
        }
    )


def finished_summary(
    config: TrainConfig,
    run: Path,
    state: dict[str, Any] | None,
    val_shard: TokenShard,
    mc: ModelConfig,
    par: P.Parallel,
    threads: int,
) -> dict[str, Any]:
    """Resuming a run whose checkpoint is at (or past) ``config.steps``: nothing to
    train, nothing written. Returns its summary.json; one that is missing or holds
    numbers that are not finite (written by an older moelab) is rebuilt from the final
    checkpoint (``model`` holds its weights) and the last line of metrics.jsonl."""
    assert state is not None
    info = par.info
    step = int(state["step"])
    if step > config.steps:
        raise ValueError(
            f"{run} is at step {step}, past steps = {config.steps}; pass steps >= {step} "
            "(--steps) to continue it"
        )
    say_main(info, f"run already finished at step {step}; pass a larger --steps to extend it")
    path = run / SUMMARY
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        saved = None
    if isinstance(saved, dict) and saved == json_safe(saved) and saved.get("steps") == step:
        return saved
    rows = read_rows(run / METRICS, lambda line: say_main(info, line))
    row = next((r for r in reversed(rows) if r["step"] == step and "loss" in r), {})
    # NOTE: state.json is strict JSON: a loss that was NaN (no evaluation yet) reads null
    extra = {k: float("nan") if v is None else v for k, v in state.get("extra", {}).items()}
    result = {
        "loss": extra.get("loss", row.get("loss", float("nan"))),
        "val_loss": extra.get("val_loss", row.get("val_loss", float("nan"))),
        "tokens_per_s": row.get("tokens_per_s", float("nan")),
        "tokens_per_s_avg": row.get("tokens_per_s_avg", float("nan")),
        "wall_s": extra.get("elapsed_s", row.get("elapsed_s", float("nan"))),
        "dead_layers": extra.get("dead_layers", []),
        "routing": {k: row[k] for k in _ROUTING_KEYS if k in row},
    }
    summary = build_summary(config, run, step, result, val_shard, mc, par, threads)
    D.barrier(info)
    if info.is_main:
        write_json(path, summary)
    return summary


_ROUTING_KEYS = ("discarded_mass", "contributors", "singleton_rate", "load_cv", "active_experts")
"""The keys of :func:`routing_numbers` that the summary carries."""
