"""Two gloo ranks with ``--log tensorboard,wandb``: only rank 0 writes to the sinks, and
the health numbers are global: equal to one process on the same global batch."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from moelab.runs.metrics import read_rows
from moelab.train import train

from . import free_port, make_corpus, rank_env, rank_exact_config, spawn_ranks

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

_HEALTH = ("maxvio_layers", "load_cv_layers", "entropy_layers", "seq_imbalance_layers")
_HEALTH += ("top2_gap_q50_layers", "load_share_layers", "dead_layers", "active_layers")


def _flat(values: list) -> list[float]:
    return [x for v in values for x in (_flat(v) if isinstance(v, list) else [v])]


def _config(corpus: Path, out: Path):
    model = {**rank_exact_config(corpus, out).model, "moe_layers": "all"}
    return rank_exact_config(
        corpus, out, steps=4, log_every=2, eval_batches=1, model=model, log=("tensorboard", "wandb")
    )


def _worker(rank: int, world: int, port: int, corpus: str, out: str) -> None:
    rank_env(rank, world, port)
    os.environ.pop("WANDB_MODE", None)
    train(_config(Path(corpus), Path(out)))


@pytest.mark.multiprocess
def test_two_ranks_write_once_with_global_numbers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    os.environ.pop("WANDB_MODE", None)
    corpus = make_corpus(tmp_path / "corpus")
    single = tmp_path / "single"
    train(_config(corpus, single))
    run = tmp_path / "ddp" / "run"
    spawn_ranks(_worker, (2, free_port(), str(corpus), str(run)))
    # rank 1 wrote nothing: one event file, one W&B offline run
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert len(glob.glob(str(run / "wandb" / "offline-run-*"))) == 1
    two, one = read_rows(run / "metrics.jsonl"), read_rows(single / "metrics.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [2, 4]
    for a, b in zip(two, one, strict=True):
        for key in _HEALTH:
            assert _flat(a[key]) == pytest.approx(_flat(b[key]), abs=1e-5), key
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.value for e in ea.Scalars("maxvio/max")] == pytest.approx(
        [r["maxvio/max"] for r in two], rel=1e-6
    )
