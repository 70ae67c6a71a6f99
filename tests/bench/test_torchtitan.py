"""`moelab bench torchtitan`: torchtitan's MoE module with its own router against the
swapped moelab Routers; the figures follow from the timings and say where they ran (no
timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from moelab import cli
from moelab.bench import torchtitan as bench
from moelab.integrations.torchtitan import moelab_routers

SHAPE = (64, 16, 24, 4, 2)


def test_the_arms_share_the_engine_weights_and_the_softmax_swap_changes_nothing() -> None:
    arms = bench._arms(*SHAPE[1:])
    assert list(arms) == [name for name, _ in bench.ARMS]
    assert not moelab_routers(arms["engine"])
    x = torch.randn(2, 8, SHAPE[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine, softmax = arms["engine"](x), arms["moelab softmax"](x)
    torch.testing.assert_close(softmax, engine, rtol=0, atol=1e-6)
    ((_, router),) = moelab_routers(arms["moelab entmax 1.5"])
    assert (router.router.config.map, router.router.config.alpha) == ("entmax", 1.5)


def test_figures_follow_from_the_timings(capsys) -> None:
    argv = ["bench", "torchtitan", "--shapes", ",".join(map(str, SHAPE)), "--repeats", "2"]
    assert cli.main([*argv, "--warmup", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["threads"] == 1 and r["repeats"] == 2 and r["torchtitan"] == "0.3.0"
    assert {"model", "arch", "flags"} <= set(r["cpu"])
    rows = {(x["impl"], x["pass"]): x for x in r["rows"]}
    assert len(rows) == len(bench.PASSES) * len(bench.ARMS)
    for (_, p), row in rows.items():
        ref = rows[(bench.REFERENCE, p)]["ms"]
        assert row["ratio"] == pytest.approx(row["ms"] / ref, rel=2e-3)
    table = bench.format_table(r)
    assert "moelab entmax 1.5" in table and "forward+backward" in table
    assert "the router alone" in table
    assert table.startswith("cpu: ")


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="K <= E"):
        bench.run(shapes=[(64, 16, 24, 2, 4)], progress=False)
    with pytest.raises(ValueError, match="512-token sequences"):
        bench.run(shapes=[(600, 16, 24, 4, 2)], progress=False)
