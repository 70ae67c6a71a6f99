"""moelab.runs: what other packages read of a run folder (metrics, summary, the analysis
cache)."""

from __future__ import annotations

import json

from moelab import runs


def test_read_summary_and_metrics(tmp_path):
    assert runs.read_summary(tmp_path) == {}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    assert runs.read_summary(tmp_path) == {"steps": 3}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert runs.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_cached_is_stamped_with_the_checkpoint(tmp_path):
    calls = []

    def fn():
        calls.append(1)
        return {"x": float("nan"), "n": len(calls)}

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    first = runs.cached(tmp_path, "k", fn)
    assert first["n"] == 1 and first["x"] is None
    assert runs.cached(tmp_path, "k", fn) == first and len(calls) == 1
    saved = json.loads((tmp_path / "analysis" / "k.json").read_text())
    assert saved["checkpoint"] == "3"
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4}))
    assert runs.cached(tmp_path, "k", fn)["n"] == 2
