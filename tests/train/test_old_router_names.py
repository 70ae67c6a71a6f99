"""A run folder written before the router keys were renamed (``threshold``,
``threshold_relative``, ``cap_factor`` in config.json; the calibrated cut saved as
``"threshold"`` in the checkpoints) still loads, evaluates and resumes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from moelab.diagnostics import evaluate_truncation, load_run, stats
from moelab.routing.config import ALIASES
from moelab.train import train
from tests.train import TINY_MODEL, make_corpus, tiny_config

ROUTER = {"map": "lapsum", "lapsum_k": 1.5, "selection": "threshold", "cap_factor": 2.0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=12)


def _old_names(obj: Any) -> Any:
    """``obj`` with every key renamed back to its name before the rename."""
    back = {new: old for old, new in ALIASES.items()}
    if isinstance(obj, dict):
        return {back.get(k, k): _old_names(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_old_names(v) for v in obj]
    return obj


def _write_old_format(run: Path) -> None:
    """Rewrite config.json and every checkpoint's state.json (and its manifest entry)
    with the old key names, as a run written before the rename has them."""
    path = run / "config.json"
    path.write_text(json.dumps(_old_names(json.loads(path.read_text()))))
    for folder in (run / "checkpoints").glob("step_*"):
        data = json.dumps(_old_names(json.loads((folder / "state.json").read_text()))).encode()
        (folder / "state.json").write_bytes(data)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"]["state.json"] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_run_written_with_the_old_names_loads_evaluates_and_resumes(
    corpus: Path, tmp_path: Path
) -> None:
    model = {**TINY_MODEL, "router": ROUTER}
    straight = train(tiny_config(corpus, tmp_path / "straight", steps=4, model=model))
    run = tmp_path / "old"
    cfg = tiny_config(corpus, run, steps=4, model=model)
    train(cfg, stop_after=2)
    cuts = [layer.router.truncation for layer in load_run(run).model.moe_layers]
    assert all(c > 0 for c in cuts)  # calibrated on the first batches

    _write_old_format(run)
    saved = json.loads((run / "config.json").read_text())["model"]["router"]
    assert {"threshold", "threshold_relative", "cap_factor"} <= set(saved)
    assert not {"truncation", "truncation_relative", "token_cap_factor"} & set(saved)
    state = (next((run / "checkpoints").glob("step_*")) / "state.json").read_text()
    assert '"threshold":' in state and '"truncation":' not in state

    loaded = load_run(run)
    assert loaded.step == 2
    assert [layer.router.truncation for layer in loaded.model.moe_layers] == cuts
    assert loaded.model.config.router_config().token_cap_factor == 2.0
    sweep = evaluate_truncation(loaded, [1.0], max_batches=1)
    assert sweep["thresholds"] == cuts and sweep["results"][0]["nll"] > 0
    st = stats(loaded, max_batches=1)
    assert st["truncating"] and [lay["truncation"] for lay in st["layers"]] == cuts
    assert train(cfg, resume=True)["train_loss"] == straight["train_loss"]
