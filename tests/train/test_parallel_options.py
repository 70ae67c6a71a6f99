"""The parallelism settings (parallel, ep, compile, checkpoint_activations): flags,
typed overrides, validation, activation checkpointing, and the stop request's handling
of one signal delivered twice under a launcher."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from safetensors.torch import load_file

from moelab.cli import main
from moelab.model import Transformer
from moelab.train import TrainConfig, apply_overrides, latest_checkpoint, train
from moelab.train import distributed as D
from moelab.train.distributed import DistInfo
from moelab.train.loop import StopRequest
from moelab.train.parallel import choose_mode, setup

from . import TINY_MODEL, free_port, logged_losses, make_corpus, rank_env, spawn_ranks, tiny_config


def test_defaults_are_todays_behaviour() -> None:
    c = TrainConfig()
    assert (c.parallel, c.ep, c.compile, c.checkpoint_activations) == (None, 1, False, False)
    assert choose_mode(c.parallel, c.ep, world=2) == ("ddp", None)  # DDP under torchrun
    assert choose_mode(c.parallel, c.ep, world=1) == ("single", None)


def test_expert_parallelism_without_a_mode_takes_fsdp_and_says_so() -> None:
    mode, why = choose_mode(None, 2, world=4)
    assert mode == "fsdp"
    assert why is not None and why.startswith("ep = 2: expert parallelism composes with FSDP")
    assert choose_mode("fsdp", 2, world=4) == ("fsdp", None)  # asked for: nothing to say
    assert choose_mode("ddp", 1, world=4) == ("ddp", None)
    assert choose_mode("fsdp", 1, world=1) == ("single", None)


def _setup_worker(rank: int, port: int, root: str) -> None:
    rank_env(rank, 2, port)
    info = D.init_distributed("cpu")
    try:
        cfg = TrainConfig(ep=2, model=dict(TINY_MODEL), seq_len=32)  # no parallel given
        model = Transformer(cfg.model_config(vocab_size=64))
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            par = setup(model, cfg, info)
        result = {"mode": par.mode, "ep": par.ep, "said": said.getvalue()}
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        D.shutdown(info)


@pytest.mark.multiprocess
def test_ep_under_torchrun_without_a_mode_runs_fsdp_and_says_so_once(tmp_path: Path) -> None:
    spawn_ranks(_setup_worker, (free_port(), str(tmp_path)), world=2, timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["mode"], r["ep"]) for r in ranks] == [("fsdp", 2), ("fsdp", 2)]
    assert ranks[0]["said"].splitlines() == [choose_mode(None, 2, 2)[1]]  # once, on rank 0
    assert ranks[1]["said"] == ""


def test_typed_overrides_and_validation() -> None:
    base = {"model": dict(TINY_MODEL), "seq_len": 32}
    c = apply_overrides(base, ["parallel=fsdp", "ep=2", "compile=yes", "checkpoint_activations=1"])
    assert (c.parallel, c.ep, c.compile, c.checkpoint_activations) == ("fsdp", 2, True, True)
    with pytest.raises(ValueError, match="parallel must be one of"):
        apply_overrides(base, ["parallel=tp"])
    with pytest.raises(ValueError, match="ep takes an int"):
        apply_overrides(base, ["ep=1.5"])
    with pytest.raises(ValueError, match="ep must be a whole number >= 1"):
        apply_overrides(base, ["ep=0"])
    with pytest.raises(ValueError, match="needs parallel = 'fsdp'"):
        apply_overrides(base, ["parallel=ddp", "ep=2"])
    assert apply_overrides(base, ["ep=2"]).parallel is None  # FSDP, chosen at setup
    with pytest.raises(ValueError, match="does not divide the model's n_experts = 4"):
        apply_overrides(base, ["parallel=fsdp", "ep=3"])


def test_cli_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[TrainConfig] = []

    def fake_train(config: TrainConfig, **kw: Any) -> dict:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("moelab.train.train", fake_train)
    corpus = make_corpus(tmp_path / "corpus", n_docs=2)
    args = ["train", "--out", str(tmp_path / "run"), "--data", str(corpus), "--set", "n_experts=4"]
    with pytest.raises(SystemExit):
        main([*args, "--parallel", "fsdp", "--ep", "2", "--compile", "--checkpoint-activations"])
    c = seen[0]
    assert (c.parallel, c.ep, c.compile, c.checkpoint_activations) == ("fsdp", 2, True, True)
    with pytest.raises(SystemExit):
        main([*args, "--ep", "2"])
    assert (seen[1].parallel, seen[1].ep) == (None, 2)  # fsdp under torchrun, said once
    # ep with ddp: a user error, not a traceback
    assert main([*args, "--parallel", "ddp", "--ep", "2"]) == 2


def test_expert_parallelism_needs_ranks() -> None:
    model = torch.nn.Module()
    cfg = TrainConfig(parallel="fsdp", ep=2, model=dict(TINY_MODEL), seq_len=32)
    with pytest.raises(ValueError, match="ep = 2 does not divide the 1 rank"):
        setup(model, cfg, DistInfo())


def test_checkpointed_activations_train_like_plain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    corpus = make_corpus(tmp_path / "corpus")
    train(tiny_config(corpus, tmp_path / "plain", steps=3))
    assert not calls
    train(tiny_config(corpus, tmp_path / "ac", steps=3, checkpoint_activations=True))
    assert len(calls) >= 3 * 2  # each block of each training step (and evaluation)
    assert logged_losses(tmp_path / "ac") == pytest.approx(
        logged_losses(tmp_path / "plain"), abs=1e-6
    )
    a = load_file(latest_checkpoint(tmp_path / "plain") / "model.safetensors")  # type: ignore[operator]
    b = load_file(latest_checkpoint(tmp_path / "ac") / "model.safetensors")  # type: ignore[operator]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("repeat_after", "stops_at_once"), [(60.0, False), (0.0, True)])
def test_one_signal_delivered_twice_under_a_launcher(
    repeat_after: float, stops_at_once: bool
) -> None:
    """torchrun's ranks can get the terminal's Ctrl-C and the launcher's copy of it:
    within ``repeat_after`` s the copy is not the user's second, stop-at-once signal."""
    with StopRequest(repeat_after=repeat_after) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        if stops_at_once:
            with pytest.raises(KeyboardInterrupt, match="twice"):
                os.kill(os.getpid(), signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT
