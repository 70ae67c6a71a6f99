from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The `backend` fixture sets a context for the whole test, so holding it across
# generated inputs is intended.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("moelab", max_examples=60, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moelab"))


@pytest.fixture
def one_thread():
    """torch on one thread for the test (timings and reductions as on a quiet core),
    restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory):
    """moelab's cache of the prepared default corpus (moelab.data.cache) in a folder of
    the test session's own, never the user's ~/.cache (subprocesses inherit it)."""
    old = os.environ.get("MOELAB_CACHE_DIR")
    os.environ["MOELAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("moelab-cache"))
    yield
    if old is None:
        os.environ.pop("MOELAB_CACHE_DIR", None)
    else:
        os.environ["MOELAB_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated corpus of 16 documents (tests.train.make_corpus)."""
    from tests.train import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=16)


@pytest.fixture(scope="session")
def four_step_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run of 4 steps on ``small_corpus`` with checkpoints at 2 and 4.
    Shared by every test module: copy it before changing anything in it."""
    from moelab.train import train
    from tests.train import tiny_config

    run = tmp_path_factory.mktemp("base") / "run"
    train(tiny_config(small_corpus, run, steps=4, checkpoint_every=2))
    return run
