"""``python -m moelab``: the same command line as the ``moelab`` script."""

from __future__ import annotations

import sys

from moelab.cli import main

if __name__ == "__main__":
    sys.exit(main())
