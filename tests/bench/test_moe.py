"""`moelab bench moe` times the layer with the loop and with grouped-GEMM experts."""

from __future__ import annotations

import pytest
import torch

from moelab.bench import moe


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
def test_grouped_row_beside_the_loop() -> None:
    result = moe.run(
        shapes=[(32, 16, 32, 4, 2)],
        repeats=1,
        warmup=0,
        progress=False,
        mixtral=False,
        routers=False,
    )
    impls = [r["impl"] for r in result["rows"] if r["pass"] == "fwdbwd"]
    assert impls == ["moelab.MoE", moe.GROUPED, moe.REFERENCE]
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert "moelab.MoE (grouped)" in moe.format_table(result)


def test_misaligned_width_gives_a_note_not_a_row() -> None:
    result = moe.run(
        shapes=[(32, 6, 32, 4, 2)],
        repeats=1,
        warmup=0,
        progress=False,
        mixtral=False,
        routers=False,
    )
    assert moe.GROUPED not in {r["impl"] for r in result["rows"]}
    assert any("no grouped row" in n for n in result["notes"])
