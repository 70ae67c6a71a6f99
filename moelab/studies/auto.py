"""``--seeds auto``: add paired seeds to a study until every claim is resolved or the
time budget ends (:func:`run_study_auto`).

The study runs first with ``start`` seeds (:data:`AUTO_START`). After each round every
finding that is neither *holds* nor *contradicted* says how many seeds it would need at
its measured mean and sd (:attr:`moelab.studies.paired.Finding.seeds_needed`, the paired
tables' estimate, measured against the claim's tolerance where it has one). The next
round trains seeds up to the largest of those estimates within ``max_seeds`` (a claim
estimated to need more does not ask for seeds: it is re-estimated after each round), at
most doubling the seeds of a round (an estimate from few seeds is rough), and only as
many as the budget has time for: a seed costs what the last round's new seeds took
(training and analysis, at least each run's recorded training time summed over the
arms). A claim that more seeds cannot resolve (an exact identity some seeds break, a
mean on its tolerance's boundary, a claim the runs gave nothing to act on) does not ask
for seeds. The loop stops when every claim is resolved, when no unresolved claim can be
resolved within ``max_seeds``, or when the budget has no time for another seed;
results.json (``"seeds_auto"``) and report.md then say which claims remain
unresolved and why.

Every round is an ordinary :func:`moelab.studies.run_study` into the one ``OUT``: runs
already trained are reused, and ``OUT/seeds_auto.json`` keeps the rounds, so the same
command run again resumes from the seeds it reached (the budget counts this call's
time only).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moelab._io import write_json
from moelab.runs.folders import atomic_write_text

__all__ = ["AUTO_START", "DEFAULT_BUDGET_MINUTES", "MAX_AUTO_SEEDS", "run_study_auto"]

AUTO_START = 3
"""The seeds of the first round (the studies' usual ``--seeds 3``)."""
DEFAULT_BUDGET_MINUTES = 120.0
"""The time budget of a call without ``--budget``: at the cpu scale a seed of a study
takes 4 to 8 minutes on two cores, so this is the first 3 seeds and about 10 to 25 more."""
MAX_AUTO_SEEDS = 32
"""The most seeds ``--seeds auto`` trains, whatever the estimates say."""
STATE = "seeds_auto.json"
"""The rounds so far, in the study's folder (read back to resume)."""


def _clock() -> float:
    return time.monotonic()


def _resolved(finding: Mapping[str, Any]) -> bool:
    return finding.get("verdict") in ("holds", "contradicted")


def _seed_cost(doc: Mapping[str, Any]) -> float:
    """What one more seed costs, in seconds: the mean over the seeds of the recorded
    training time summed over the arms, plus the round's analysis time per seed."""
    per_arm = doc.get("arm_seconds", {})
    n = len(doc.get("seeds", [])) or 1
    train = sum(sum(v) for v in per_arm.values()) / n
    analysis = max(0.0, float(doc.get("seconds", 0.0)) - float(doc.get("train_seconds", 0.0)))
    return train + analysis / n


def _read_state(out: Path, study: str, scale: str) -> list[dict[str, Any]]:
    try:
        state = json.loads((out / STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    if not isinstance(state, dict) or state.get("study") != study or state.get("scale") != scale:
        return []
    rounds = state.get("rounds")
    return [r for r in rounds if isinstance(r, dict)] if isinstance(rounds, list) else []


def run_study_auto(
    study: Any,
    out: str | Path,
    scale: str = "cpu",
    *,
    budget_minutes: float = DEFAULT_BUDGET_MINUTES,
    start: int = AUTO_START,
    max_seeds: int = MAX_AUTO_SEEDS,
    progress: bool = True,
    run: Callable[..., dict[str, Any]] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``study`` into ``out`` with as many paired seeds as its claims need (see the
    module's text), within ``budget_minutes`` of this call; return the last round's
    results document with ``"seeds_auto"`` added (also in results.json and report.md).
    ``kwargs`` go to :func:`moelab.studies.run_study` (data, threads, options, ...);
    ``run``: the study runner (default :func:`moelab.studies.run_study`)."""
    from moelab.studies import get_study
    from moelab.studies.driver import run_study

    study = get_study(study) if isinstance(study, str) else study
    if scale == "paper":
        raise ValueError("--seeds auto trains the study: use it at the quick or cpu scale")
    if not (isinstance(budget_minutes, (int, float)) and budget_minutes > 0):
        raise ValueError(f"the budget must be a number of minutes > 0, got {budget_minutes}")
    if int(start) != start or start < 2:
        raise ValueError(f"--seeds auto starts with 2 seeds or more, got {start}")
    if int(max_seeds) != max_seeds or max_seeds < start:
        raise ValueError(f"max_seeds must be a whole number >= {start}, got {max_seeds}")
    runner = run if run is not None else run_study
    out = Path(out)
    budget = float(budget_minutes) * 60.0
    rounds = _read_state(out, study.name, scale)
    n = max(int(start), max((int(r.get("seeds", 0)) for r in rounds), default=0))
    n = min(n, int(max_seeds))
    t0 = _clock()

    def say(text: str) -> None:
        if progress:
            print(f"seeds auto: {text}", file=sys.stderr, flush=True)

    if rounds:
        say(f"resuming from {n} seeds ({len(rounds)} earlier rounds in {out / STATE})")
    while True:
        say(f"round with {n} seeds ({(_clock() - t0) / 60:.1f} of {budget / 60:g} min spent)")
        t_round = _clock()
        doc = runner(study, out, scale=scale, seeds=n, progress=progress, **kwargs)
        spent = _clock() - t0
        findings = list(doc.get("findings", []))
        open_ = [f for f in findings if not _resolved(f)]
        asks = {f["key"]: f.get("seeds_needed") for f in open_}
        # a seed costs what this round's new seeds took (everything included, at least
        # what the runs recorded), or where it trained none, what the runs recorded
        states = list(doc.get("arm_states", {}).values())
        new_seeds = sum(any(arm[s] != "reused" for arm in states) for s in range(n))
        cost = _seed_cost(doc)
        if new_seeds:
            cost = max(cost, (spent - (t_round - t0)) / new_seeds)
        elif rounds:  # a resumed round: what a seed cost when one was last trained
            cost = max(cost, 60.0 * float(rounds[-1].get("seed_minutes", 0.0)))
        rounds.append(
            {
                "seeds": n,
                "minutes_spent": spent / 60.0,
                "seed_minutes": cost / 60.0,
                "unresolved": {k: v for k, v in asks.items()},
            }
        )
        write_json(out / STATE, {"study": study.name, "scale": scale, "rounds": rounds}, indent=1)
        say(
            f"{n} seeds: {len(findings) - len(open_)} of {len(findings)} claims resolved; "
            + (
                "unresolved: "
                + ", ".join(f"{k} ({'-' if v is None else v} seeds)" for k, v in asks.items())
                if open_
                else "every claim resolved"
            )
        )
        needs = [v for v in asks.values() if isinstance(v, int) and v > n]
        wanted = [v for v in needs if v <= max_seeds]
        if not open_:
            stop = "every claim is resolved"
            break
        if not needs:
            stop = "no unresolved claim can be resolved by more seeds"
            break
        if not wanted:
            stop = f"every unresolved claim needs more than the {max_seeds} seeds it may train"
            break
        target = min(max(wanted), 2 * n, int(max_seeds))
        left = budget - spent
        fit = n + math.floor(left / cost) if cost > 0 else target
        if fit <= n:
            stop = (
                f"the budget ends: {budget / 60:g} min, {spent / 60:.1f} spent, and a seed "
                f"costs about {cost / 60:.1f} min"
            )
            break
        n = min(target, fit)
    unresolved = [
        {
            "key": f["key"],
            "verdict": f.get("verdict"),
            "seeds_needed": f.get("seeds_needed"),
            "why": _why(f, stop, max_seeds),
        }
        for f in findings
        if not _resolved(f)
    ]
    summary = {
        "budget_minutes": budget / 60.0,
        "minutes": (_clock() - t0) / 60.0,
        "seeds": n,
        "stopped": stop,
        "resolved": [f["key"] for f in findings if _resolved(f)],
        "unresolved": unresolved,
        "rounds": rounds,
    }
    say(f"stopped with {n} seeds: {stop}")
    for u in unresolved:
        say(f"  unresolved: {u['key']}: {u['why']}")
    return _annotate(out, dict(doc), summary)


def _why(f: Mapping[str, Any], stop: str, max_seeds: int) -> str:
    """Why a claim is unresolved at the end of the rounds."""
    need = f.get("seeds_needed")
    if not isinstance(need, int):
        return str(f.get("why_unresolved") or "more seeds cannot resolve it")
    if need > max_seeds:
        return f"needs about {need} seeds, beyond the {max_seeds} that --seeds auto trains"
    if stop.startswith("the budget ends"):
        return f"needs about {need} seeds: {stop}"
    return f"needs about {need} seeds ({stop})"


def _annotate(out: Path, doc: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """results.json and report.md of the last round with what --seeds auto did."""
    doc["seeds_auto"] = summary
    results = out / "results.json"
    if results.is_file():
        write_json(results, doc, indent=1)
    report = out / "report.md"
    if report.is_file():
        lines = [
            "",
            "## Seeds chosen by --seeds auto",
            "",
            f"{summary['seeds']} seeds after {len(summary['rounds'])} rounds "
            f"({', '.join(str(r['seeds']) for r in summary['rounds'])} seeds) in "
            f"{summary['minutes']:.1f} of {summary['budget_minutes']:g} minutes: "
            f"stopped because {summary['stopped']}.",
            "",
        ]
        if summary["unresolved"]:
            lines += ["| claim | verdict | seeds needed | why |", "|---|---|---:|---|"]
            for u in summary["unresolved"]:
                need = "-" if u["seeds_needed"] is None else str(u["seeds_needed"])
                lines.append(f"| `{u['key']}` | {u['verdict']} | {need} | {u['why']} |")
        else:
            lines.append("Every claim is resolved.")
        text = report.read_text(encoding="utf-8").rstrip() + "\n" + "\n".join(lines) + "\n"
        atomic_write_text(report, text)
    return doc
