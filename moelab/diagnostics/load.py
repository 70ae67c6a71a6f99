"""Load a trained run for the diagnostics: check a run folder without reading weights
(:func:`check_run`), rebuild the model and load the newest checkpoint or the one
``step`` names (:func:`load_run`; the folder is read through moelab.runs, which also
finds a step's checkpoint: :func:`step_folder`), and tokenise a second corpus
(:func:`corpus_shard`)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moelab.data import Tokenizer, TokenShard, data_fix, load_corpus, open_checked_shard
from moelab.model import ModelConfig, Transformer
from moelab.runs import CorpusMismatch, check_corpus, read_config
from moelab.runs.checkpoints import (
    CheckpointError,
    has_checkpoint,
    list_checkpoints,
    nonfinite_tensors,
)
from moelab.runs.layout import DATA, TOKENIZER
from moelab.runs.weights import load_weights, step_folder, steps_text
from moelab.train import TrainConfig

__all__ = ["LoadedRun", "check_run", "corpus_shard", "load_run", "step_folder"]


class LoadedRun:
    """A run's newest checkpoint: the model (eval mode, CPU), its TrainConfig, the
    run's tokenizer, the checkpoint's step and the run folder (unpacks as the five).

    The tokenizer is read when it is first used (:attr:`tokenizer`: a second corpus,
    decoding, export), after a check that it is the one the run trained with; the
    run's own validation split (:meth:`val_shard`) needs none where the run recorded
    its data's digests, so a damaged tokenizer.json does not stop an evaluation on it.
    """

    __slots__ = ("_tokenizer", "_warned", "config", "model", "run_dir", "step")

    def __init__(
        self,
        model: Transformer,
        config: TrainConfig,
        tokenizer: Tokenizer | None,
        step: int,
        run_dir: Path,
    ) -> None:
        self.model, self.config, self.step, self.run_dir = model, config, step, Path(run_dir)
        self._tokenizer = tokenizer
        self._warned = False  # the warning about an unused tokenizer.json, said once

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.config, self.tokenizer, self.step, self.run_dir))

    def __repr__(self) -> str:
        return f"LoadedRun(run_dir={str(self.run_dir)!r}, step={self.step})"

    def _model_vocab(self) -> int | None:
        """The model's vocabulary size (None for a model without a config)."""
        return getattr(getattr(self.model, "config", None), "vocab_size", None)

    @property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer.json, read once, after checking that it is the one the
        run trained with (:func:`moelab.runs.check_corpus`: CorpusMismatch otherwise)."""
        if self._tokenizer is None:
            run = self.run_dir
            check_corpus(run, ("tokenizer",))
            tokenizer = Tokenizer.load(run / TOKENIZER)
            vocab = self._model_vocab()
            if vocab is not None and tokenizer.vocab_size != vocab:
                # NOTE: a run without a record of its corpus can only be checked so
                raise CorpusMismatch(
                    f"{run / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but the "
                    f"model was trained with {vocab}: it is not the run's tokenizer",
                    data_fix(run),
                )
            self._tokenizer = tokenizer
        return self._tokenizer

    def val_shard(self) -> TokenShard:
        """The run's validation shard (``data/val.bin``), checked to be the split the
        run trained on (:func:`moelab.runs.check_corpus`), against its metadata (size,
        ids, sha256 once per version of the file) and against the model's vocabulary.
        It needs no tokenizer: a tokenizer.json that is damaged or not the run's is
        said in a warning (a run that recorded its data), or, in a run from before
        that record, where it loads, the shard is also checked against it
        (:func:`moelab.data.open_checked_shard`)."""
        run = self.run_dir
        path = run / DATA / "val.bin"
        recorded = check_corpus(run, ("val",))
        problem = tokenizer = None
        try:
            if recorded:
                check_corpus(run, ("tokenizer",))
            else:
                tokenizer = self.tokenizer
        except CorpusMismatch as err:
            problem = err.what
        except (OSError, ValueError) as err:
            problem = str(err).split("; ")[0]
        if tokenizer is not None:
            return open_checked_shard(path, tokenizer)
        if problem is not None and not self._warned:  # not needed here: said, not refused
            self._warned = True
            print(
                f"warning: {problem}; the run's own validation split is read without it, but "
                "a second corpus (--data), export and downstream refuse it until the run's own "
                "is back",
                file=sys.stderr,
                flush=True,
            )
        shard = TokenShard.open(path)
        shard.verify_hash_once()
        vocab = self._model_vocab()
        if vocab is not None and shard.vocab_size != vocab:
            raise CorpusMismatch(
                f"{shard.meta_path} says vocab_size = {shard.vocab_size} but the model has "
                f"{vocab}: {path} is not this run's validation split",
                data_fix(run),
            )
        return shard


def check_run(run_dir: str | Path) -> TrainConfig:
    """Check, without loading any weights, that ``run_dir`` is a trained run: a folder
    with a readable config.json (:func:`moelab.runs.read_config`) and a checkpoint
    (``checkpoints/latest`` or, where that pointer is gone, a step folder), whose
    validation split is the one it trained on (:func:`moelab.runs.check_corpus`).
    Returns its config. The tokenizer is checked where it is used
    (:attr:`LoadedRun.tokenizer`).

    Raises:
        FileNotFoundError: the folder, config.json or a checkpoint is missing (each
            message says which).
        NotADirectoryError: ``run_dir`` is a file.
        ValueError: config.json is not a valid run config, or the run's data are not
            those it trained on (:class:`moelab.runs.CorpusMismatch`).
    """
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"{run} is not a moelab run folder: it does not exist")
    if not run.is_dir():
        raise NotADirectoryError(f"{run} is a file, not a run folder")
    saved = read_config(run)
    if not has_checkpoint(run):
        raise FileNotFoundError(f"{run} holds no checkpoint (no checkpoints/latest, no step_*)")
    if (run / DATA / "val.json").is_file():
        check_corpus(run, ("val",))
    return TrainConfig.from_dict(saved)  # NOTE: without the run's run_info


def _vocab_size(run: Path, saved: dict[str, Any]) -> int:
    """The model's vocabulary size: config.json's resolved model holds it (the trained
    tokenizer's); a run written before config.json resolved the model has only the
    size it asked for, and the tokenizer's is read."""
    model = saved.get("model") or {}
    if _MODEL_FIELDS <= set(model) and isinstance(model.get("vocab_size"), int):
        return int(model["vocab_size"])
    return Tokenizer.load(run / TOKENIZER).vocab_size


_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def load_run(run_dir: str | Path, step: int | None = None) -> LoadedRun:
    """Rebuild the model of ``run_dir`` from config.json and load a checkpoint:
    ``step``'s, or the newest (see :func:`moelab.runs.weights.load_weights`; verified by
    :func:`moelab.runs.checkpoints.load_checkpoint`; the global RNGs are left alone). The
    tokenizer is read where it is used (:attr:`LoadedRun.tokenizer`). Raises what
    :func:`check_run` raises when the folder is not a complete run, FileNotFoundError
    for a ``step`` without checkpoint, and the checkpoint module's error for a damaged
    checkpoint (naming the intact older steps) or one that config.json does not fit."""
    run = Path(run_dir)
    config = check_run(run)
    vocab = _vocab_size(run, read_config(run))
    try:
        model = Transformer(config.model_config(vocab_size=vocab))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{run / 'config.json'}: its model cannot be built ({err})") from None
    state = load_weights(run, model, step)
    bad = nonfinite_tensors(dict(model.named_parameters()))
    if bad:
        # NOTE: written by a moelab that did not check (training now stops before it)
        raise CheckpointError(
            f"the checkpoint of step {int(state['step'])} in {run} holds weights that are "
            f"NaN or infinite ({', '.join(bad[:3])}): the run had diverged; pass --step N "
            f"(step=) for an earlier checkpoint (steps it has: {steps_text(list_checkpoints(run))})"
        )
    model.eval()
    return LoadedRun(model, config, None, int(state["step"]), run)


def as_loaded(run: str | Path | LoadedRun) -> LoadedRun:
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
