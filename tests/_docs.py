"""The code blocks of the docs, for the tests that run a page's code as it is written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def page_code(page: str, first_line: str) -> str:
    """The ```python block of ``docs/PAGE`` whose first line is ``first_line``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(first_line)]
    if len(blocks) != 1:
        raise AssertionError(f"docs/{page}: {len(blocks)} code blocks start with {first_line!r}")
    return blocks[0]
