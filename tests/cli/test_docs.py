"""What README.md and docs/analysis.md say, checked against the code: the README's
Python snippets run as written, and co-activation's diagonal is what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("needle", ["maps.sparsemax(z)", "MoE(MoEConfig("])
def test_readme_snippet_runs_as_written(needle: str) -> None:
    blocks = [b for b in _python_blocks(ROOT / "README.md") if needle in b]
    assert len(blocks) == 1, needle
    exec(compile(blocks[0], "README.md", "exec"), {})  # every name it uses is defined


def test_coactivation_diagonal_is_as_documented() -> None:
    from moelab.diagnostics.analysis import CoactivationCounts

    # 3 experts, 3 tokens: {0, 1}, {0}, {0, 1}; expert 2 is never used
    acc = CoactivationCounts(3)
    acc.update_mask(torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool))
    r = acc.result(min_count=1)
    assert [r["counts"][i][i] for i in range(3)] == r["load"] == [3, 2, 0]
    assert [r["conditional"][i][i] for i in range(2)] == [1.0, 1.0]
    assert r["conditional"][2] == r["expected"][2] == r["lift"][2] == [None] * 3
    assert [r["expected"][i][i] for i in range(3)] == [None] * 3
    assert [r["lift"][i][i] for i in range(3)] == [None] * 3
    # the one pair: P(1 | 0) = 2/3; a token using 0 uses k_0 - 1 = 2/3 others, and all of
    # them are 1 (S - n_0 = 2 slots, all expert 1's): expected 2/3, lift 1
    assert r["lift_max"] == pytest.approx(1.0) and r["lift_min"] == pytest.approx(1.0)
    assert [(p["i"], p["j"]) for p in r["top_pairs"]] == [(0, 1)]
    text = (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    section = text.split("## Co-activation", 1)[1].split("\n## ", 1)[0]
    assert "diagonal" in section
    assert "`expected[i][i]` and `lift[i][i]` are null" in section
    assert "`conditional[i][i]` = 1" in section
