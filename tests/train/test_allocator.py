"""moelab.train.allocator: freed tensor memory stays in the process (counted as the page
faults of re-allocating it), the opt-outs, and the `moelab` command applying it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Allocate and free 40 tensors of 2 MiB five times, after one warm-up round; print
# whether the thresholds are in force and the minor page faults of the five rounds.
CHURN = """
import resource, sys, torch
from moelab.train.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else False
def churn():
    ts = [torch.ones(512, 1024) for _ in range(40)]
    del ts
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    churn()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc only",
)


def _churn(apply: bool, **env: str) -> tuple[bool, int]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    run_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", CHURN, "1" if apply else "0"],
        capture_output=True, text=True, env=run_env, check=True, timeout=120,
    ).stdout.split()
    return out[0] == "True", int(out[1])


@glibc
def test_freed_memory_is_reused_without_faults() -> None:
    applied, faults = _churn(True)
    _, faults_default = _churn(False)
    assert applied
    # 5 rounds x 80 MiB = 102,400 pages: by default glibc hands back and faults in
    # again about 21,000 or all 102,000 of them (its thresholds move as it goes)
    assert faults_default > 10_000
    assert faults < 5_000


@glibc
@pytest.mark.parametrize(
    "env", [{"MOELAB_KEEP_FREED_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}]
)
def test_opt_out_and_the_users_own_setting(env: dict[str, str]) -> None:
    applied, faults = _churn(True, **env)
    assert not applied
    assert faults > 10_000


def test_the_command_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from moelab import cli
    from moelab.train import allocator

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit):
        cli.main(["params", "--preset", "tiny", "--nonsense"])
    assert calls == []  # a parse error stops before any command runs
    assert cli.main(["params", "--preset", "tiny", "--json"]) == 0
    assert calls == [1]
