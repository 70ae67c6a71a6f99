"""Load a trained run for the diagnostics: check a run folder without reading weights
(:func:`check_run`), find a step's checkpoint (:func:`step_folder`), rebuild the model
and load the newest checkpoint or the one ``step`` names (:func:`load_run`), and
tokenise a second corpus (:func:`corpus_shard`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from moelab.data import Tokenizer, TokenShard, load_corpus, open_checked_shard
from moelab.model import Transformer
from moelab.train import TrainConfig, latest_checkpoint, load_checkpoint
from moelab.train.checkpoint import (
    CheckpointError,
    checkpoint_folder,
    list_checkpoints,
    nonfinite_tensors,
    verify_checkpoint,
)

__all__ = ["LoadedRun", "check_run", "corpus_shard", "load_run", "step_folder"]


class LoadedRun(NamedTuple):
    """A run's newest checkpoint: the model (eval mode, CPU), its TrainConfig, the
    run's tokenizer, the checkpoint's step and the run folder."""

    model: Transformer
    config: TrainConfig
    tokenizer: Tokenizer
    step: int
    run_dir: Path

    def val_shard(self) -> TokenShard:
        """The run's validation shard, checked against the run's tokenizer (see
        :func:`moelab.data.open_checked_shard`)."""
        return open_checked_shard(self.run_dir / "data" / "val.bin", self.tokenizer)


def check_run(run_dir: str | Path) -> TrainConfig:
    """Check, without loading any weights, that ``run_dir`` is a trained run: a folder
    with a readable config.json, a tokenizer.json and a checkpoint (``checkpoints/latest``
    or, where that pointer is gone, a step folder). Returns its config.

    Raises:
        FileNotFoundError: the folder, config.json, tokenizer.json or a checkpoint is
            missing (each message says which).
        NotADirectoryError: ``run_dir`` is a file.
        ValueError: config.json is not a valid run config.
    """
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"{run} is not a moelab run folder: it does not exist")
    if not run.is_dir():
        raise NotADirectoryError(f"{run} is a file, not a run folder")
    config_path = run / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run} is not a moelab run folder (no config.json)")
    if not (run / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{run} has no tokenizer.json; was its training interrupted?")
    if latest_checkpoint(run) is None and not list_checkpoints(run):
        raise FileNotFoundError(f"{run} holds no checkpoint (no checkpoints/latest, no step_*)")
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8"))
        return TrainConfig.from_dict(saved)  # NOTE: without the run's run_info
    except (ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{config_path} is not a valid run config: {err}") from None


def _steps(folders: Sequence[Path]) -> str:
    return ", ".join(str(int(p.name[5:])) for p in folders) or "none"


def step_folder(run_dir: str | Path, step: int) -> Path:
    """The checkpoint folder of ``step`` in ``run_dir``; FileNotFoundError, listing the
    steps the run has, when there is none (checked without reading it)."""
    folder = checkpoint_folder(run_dir, step)
    if not folder.is_dir():
        have = _steps(list_checkpoints(run_dir))
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint of step {step} (steps it has: {have})"
        )
    return folder


def _load_weights(run: Path, model: Transformer, step: int | None) -> dict[str, Any]:
    """Load the checkpoint of ``step`` into ``model``, or the newest one: the folder
    ``checkpoints/latest`` names or, where that pointer is gone, the newest step folder
    that loads. Returns its state.json.

    Raises:
        FileNotFoundError: no checkpoint of ``step`` (the message lists the steps there).
        CheckpointError: the checkpoint asked for, or the one ``latest`` names, is damaged;
            the message names it and the intact older steps to pass as ``step``
            (``--step N``). An older checkpoint is never taken in its place unasked: its
            results would be another model's.
    """
    folders = list_checkpoints(run)
    if step is not None:
        return load_checkpoint(step_folder(run, step), model, restore_rng=False)
    newest = latest_checkpoint(run)
    if newest is None:  # the pointer is gone: the newest step folder that loads
        for folder in reversed(folders):
            try:
                return load_checkpoint(folder, model, restore_rng=False)
            except CheckpointError:
                continue
        raise CheckpointError(
            f"{run} has no checkpoints/latest and none of its step folders ({_steps(folders)}) "
            "holds an intact checkpoint"
        )
    try:
        return load_checkpoint(newest, model, restore_rng=False)
    except CheckpointError as err:
        older = []
        for folder in reversed([f for f in folders if f.name < newest.name]):
            try:
                verify_checkpoint(folder)
                older.append(folder)
            except CheckpointError:
                continue
        hint = (
            f"intact older checkpoints: steps {_steps(older[::-1])}; pass --step "
            f"{int(older[0].name[5:])} (step=) to use one"
            if older
            else "no older checkpoint is intact"
        )
        raise CheckpointError(f"the newest checkpoint {newest} is damaged ({err}); {hint}") from err


def load_run(run_dir: str | Path, step: int | None = None) -> LoadedRun:
    """Rebuild the model of ``run_dir`` from config.json and tokenizer.json and load a
    checkpoint: ``step``'s, or the newest (see :func:`_load_weights`; verified by
    :func:`moelab.train.load_checkpoint`; the global RNGs are left alone). Raises what
    :func:`check_run` raises when the folder is not a complete run, FileNotFoundError
    for a ``step`` without checkpoint, and the checkpoint module's error for a damaged
    checkpoint (naming the intact older steps)."""
    run = Path(run_dir)
    config = check_run(run)
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    model = Transformer(config.model_config(vocab_size=tokenizer.vocab_size))
    state = _load_weights(run, model, step)
    bad = nonfinite_tensors(dict(model.named_parameters()))
    if bad:
        # NOTE: written by a moelab that did not check (training now stops before it)
        raise CheckpointError(
            f"the checkpoint of step {int(state['step'])} in {run} holds weights that are "
            f"NaN or infinite ({', '.join(bad[:3])}): the run had diverged; pass --step N "
            f"(step=) for an earlier checkpoint (steps it has: {_steps(list_checkpoints(run))})"
        )
    model.eval()
    return LoadedRun(model, config, tokenizer, int(state["step"]), run)


def _loaded(run: str | Path | LoadedRun) -> LoadedRun:
    """A run folder loaded, or an already loaded run as it is (no second load)."""
    return run if isinstance(run, LoadedRun) else load_run(run)


def corpus_shard(source: str | Path, tokenizer: Tokenizer) -> TokenShard:
    """An in-memory TokenShard of the corpus ``source`` tokenised with ``tokenizer``
    (each document followed by EOS, as :func:`moelab.data.write_shard` does)."""
    docs = load_corpus(source)
    if not docs:
        raise ValueError(f"the corpus {source} holds no documents")
    ids: list[int] = []
    for doc_ids in tokenizer.encode_batch(docs):
        ids.extend(doc_ids)
        ids.append(tokenizer.eos_id)
    tokens = np.asarray(ids, dtype=np.int64)
    meta = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "source": str(source)}
    return TokenShard(path=Path(source), tokens=tokens, meta=meta)
