"""``moelab downstream``: evaluate runs on lm-evaluation-harness tasks, for each K, with
the routing statistics of every task.

    result = run_downstream(["runs/softmax"], ["moelab_cloze"], top_ks=[1, 2, 4, 8])
    print(format_downstream(result))

For each run (and each ``--hf`` model) and each K, one
:func:`lm_eval.simple_evaluate` of a :class:`~moelab.integrations.lm_eval.model.MoelabLM`
over all the tasks (zero-shot unless ``num_fewshot``; ``limit`` documents per task). The
result holds one row per (run, K, task): ``acc`` / ``acc_norm`` and their standard errors
where the task has them, every other metric under ``"metrics"``, ``"samples"`` (the
documents evaluated); and one routing row per (run, K, task)
(:mod:`~moelab.integrations.lm_eval.routing`). Every row records the checkpoint step
it was scored at (the step of the checkpoint loaded), ``limit`` and the task's
version (the harness's ``versions``). With ``save``, each run folder gets
``RUN/downstream.json``, written after every K so that an interrupted call keeps what it
finished; one file holds one setting (checkpoint step, limit, few-shot, task versions):
a call of the same setting merges into it (a new (task, K) replaces the old one), a
call of another setting moves the old file whole to ``RUN/downstream/`` first
(:mod:`~moelab.integrations.lm_eval.saved`). ``moelab report`` reads it.

Offline: unless ``network``, the Hugging Face libraries' offline switches are set before
the harness (and with it ``datasets``) is imported, so tasks must come from local files:
the ready task ``moelab_cloze`` (:mod:`~moelab.integrations.lm_eval.cloze`, written into
each run folder and found without an include path) and YAML tasks under
``include_path`` (``dataset_path: json`` with local ``data_files``). With ``network``, the
harness's own task names (hellaswag, piqa, arc_easy, lambada_openai, ...) download their
data as usual. Offline, a task whose data is not in the local cache raises ValueError
naming ``--network`` (the libraries' offline error, caught by class name and message).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from moelab.integrations.lm_eval.cloze import CLOZE_TASK, write_cloze_task
from moelab.integrations.lm_eval.text import format_downstream

__all__ = ["format_downstream", "import_lm_eval", "run_downstream"]

_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def import_lm_eval(network: bool = False) -> Any:
    """``lm_eval`` (>= 0.4.13), imported after the offline switches are set (unless
    ``network``); ImportError naming the extra when it is missing."""
    if not network:
        for key in _OFFLINE:
            os.environ[key] = "1"
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import lm_eval
        from lm_eval import evaluator  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "downstream evaluation needs lm-evaluation-harness: pip install 'moelab[eval]' "
            "(or pip install 'lm-eval>=0.4.13')"
        ) from err
    if not network:
        # NOTE: the libraries read the switches when first imported; set them again in
        # case they were imported before this call
        with contextlib.suppress(ImportError, AttributeError):
            import datasets

            datasets.config.HF_DATASETS_OFFLINE = True
            datasets.config.HF_HUB_OFFLINE = True
        with contextlib.suppress(ImportError, AttributeError):
            import huggingface_hub.constants

            huggingface_hub.constants.HF_HUB_OFFLINE = True
    import moelab.integrations.lm_eval.model  # noqa: F401  (registers "moelab")

    return lm_eval


@contextlib.contextmanager
def _quiet_harness(evaluator: Any) -> Iterator[None]:
    """Skip the harness's environment report (pip list, torch's collect_env, git: some
    seconds per evaluation that moelab's result does not keep), and send what it prints
    to stderr, so that stdout holds moelab's output only (one JSON document with
    --json)."""
    saved = evaluator.add_env_info, evaluator.get_git_commit_hash
    evaluator.add_env_info = lambda *a, **k: None
    evaluator.get_git_commit_hash = lambda *a, **k: None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        evaluator.add_env_info, evaluator.get_git_commit_hash = saved


def _labels(paths: Sequence[str]) -> list[str]:
    """Each path's shortest tail of folder names that no other path shares
    (``runs/softmax/seed0``, ``runs/sparsemax/seed0`` -> ``softmax/seed0``,
    ``sparsemax/seed0``)."""
    parts = [Path(p).resolve().parts for p in paths]
    labels = []
    for i, mine in enumerate(parts):
        for n in range(1, len(mine) + 1):
            tail = mine[-n:]
            if all(other[-n:] != tail for j, other in enumerate(parts) if j != i):
                break
        labels.append("/".join(tail) if tail else str(paths[i]))
    return labels


def _as_list(x: str | Path | Sequence[str | Path] | None) -> list[str]:
    if x is None:
        return []
    if isinstance(x, (str, Path)):
        return [str(x)]
    return [str(v) for v in x]


def _task_manager(include: list[str], tasks: Sequence[str]) -> Any:
    """A TaskManager that knows every task of ``tasks``: the local include paths alone
    when they hold them all (fast), else with the harness's own tasks; ValueError naming
    the unknown ones."""
    from lm_eval.tasks import TaskManager

    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    tm = TaskManager(include_path=include or None)
    unknown = [t for t in tasks if not tm.match_tasks([t])]
    if unknown:
        where = f" or under --include-path ({', '.join(include)})" if include else ""
        raise ValueError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not a task "
            f"of lm-evaluation-harness{where}; give a folder of task YAMLs with "
            f"--include-path, or use {CLOZE_TASK!r}, the ready offline task"
        )
    return tm


def _rows(res: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    samples = res.get("n-samples", {})
    versions = res.get("versions") or {}
    for task, metrics in res.get("results", {}).items():
        row = dict(base, task=task, task_version=versions.get(task))
        clean: dict[str, Any] = {}
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name, _, flt = key.partition(",")
            clean[name if flt in ("", "none") else key] = float(value)
        for name in ("acc", "acc_norm"):
            row[name] = clean.pop(name, None)
            row[f"{name}_stderr"] = clean.pop(f"{name}_stderr", None)
        row["metrics"] = clean
        n = samples.get(task, {})
        row["samples"] = n.get("effective") if isinstance(n, dict) else None
        rows.append(row)
    return rows


def _offline_miss(err: BaseException) -> str | None:
    """What offline mode kept ``err`` from downloading (the dataset's name, or "" when
    the message names none), or None when ``err`` is not the datasets / Hugging Face Hub
    libraries refusing to go online. Matched by class name and message, since the class
    (``OfflineModeIsEnabled``) moved between those libraries' versions and ``datasets``
    re-raises it as a ConnectionError without its cause."""
    hit, name, seen = False, "", set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if any(c.__name__ == "OfflineModeIsEnabled" for c in type(e).__mro__) or (
            "OfflineModeIsEnabled" in text or "offline mode is enabled" in text.lower()
        ):
            hit = True
        if not name and isinstance(e, ConnectionError):
            found = re.search(r"'([^'\s]+)'", text)
            name = found.group(1) if found else ""
        e = e.__cause__ or e.__context__
    return name if hit else None


def _offline_error(err: BaseException, tasks: Sequence[str]) -> ValueError | None:
    """The one-line error for a task whose data is not cached while offline, or None."""
    name = _offline_miss(err)
    if name is None:
        return None
    what = f"the dataset {name!r}" if name else "a task's dataset"
    return ValueError(
        f"{what} (for --tasks {', '.join(tasks)}) is not in the local cache, and moelab "
        "downstream is offline unless --network is given: add --network to let "
        "lm-evaluation-harness and datasets download the tasks' data from the Hugging Face "
        "Hub into the local cache (later calls then find it there), or use a local task "
        f"(--include-path DIR, or {CLOZE_TASK})"
    )


def _evaluate(
    evaluator: Any,
    lm: Any,
    tm: Any,
    tasks: Sequence[str],
    setting: dict[str, Any],
    network: bool,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """One ``simple_evaluate`` of ``lm`` on ``tasks``, the templates rendered in Jinja's
    sandbox unless ``trust_remote_code`` (:func:`~.trust.sandboxed_templates`); a task
    whose data offline mode kept from being downloaded raises ValueError naming
    --network, a template that reached past the sandbox one naming the tasks."""
    from jinja2.exceptions import SecurityError

    from moelab.integrations.lm_eval.trust import sandboxed_templates

    sandbox = contextlib.nullcontext() if trust_remote_code else sandboxed_templates()
    try:
        with sandbox:
            res = evaluator.simple_evaluate(
                model=lm,
                tasks=list(tasks),
                task_manager=tm,
                limit=setting["limit"],
                num_fewshot=setting["num_fewshot"],
                log_samples=False,
                bootstrap_iters=1000,
                verbosity="ERROR",
            )
    except SecurityError as err:
        raise ValueError(
            f"a template of --tasks {', '.join(tasks)} reached past Jinja's sandbox "
            f"({' '.join(str(err).split())}); moelab renders task templates in the sandbox, "
            "so that a task folder's template cannot run Python, unless you pass "
            "--trust-remote-code (it runs that Python with your permissions)"
        ) from None
    except Exception as err:
        offline = None if network else _offline_error(err, tasks)
        if offline is None:
            raise
        raise offline from None
    if res is None:
        raise ValueError("the harness returned no results")
    return res


def _save(result: dict[str, Any], run: str, label: str, doc: dict[str, Any]) -> None:
    """Save one K's document of ``run`` (:func:`~.saved.save_downstream`) and say in
    ``result`` where the file went and where an earlier setting's file was moved."""
    from moelab.integrations.lm_eval.saved import save_downstream

    saved = save_downstream(run, doc, label)
    if str(saved["path"]) not in result["saved"]:
        result["saved"].append(str(saved["path"]))
    if saved["archived"] is not None:
        result["archived"].append(str(saved["archived"]))
        result["notes"].append(saved["note"])


def _check_arguments(
    runs: list[str],
    tasks: list[str],
    hfs: list[str],
    limit: int | float | None,
    batch_size: int,
    include_path: str | Path | Sequence[str | Path] | None,
) -> tuple[int | float | None, list[str]]:
    """``limit`` as given to the harness (a count of documents from 1 up) and the include
    paths; ValueError for no task, no source, a bad limit or batch size, a missing
    include path."""
    if not tasks:
        raise ValueError("give at least one task (--tasks NAME ...), e.g. moelab_cloze")
    if not runs and not hfs:
        raise ValueError("give at least one run folder, or --hf DIR")
    if limit is not None and not limit > 0:
        raise ValueError(f"--limit must be > 0, got {limit}")
    if limit is not None and limit >= 1:
        limit = int(limit)  # a count of documents (below 1: a fraction of them)
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    include = _as_list(include_path)
    for p in include:
        if not Path(p).is_dir():
            raise ValueError(f"--include-path {p}: no such folder of task YAMLs")
    return limit, include


def _check_sources(
    runs: list[str],
    hfs: list[str],
    top_ks: Sequence[int] | None,
    step: int | None,
    trust_remote_code: bool,
) -> None:
    """One ValueError naming every run folder that is not a run (or lacks ``step``), every
    K outside [1, E] and every ``hf`` folder moelab does not read."""
    from moelab.diagnostics.evaluate import check_run, step_folder

    problems = []
    for r in runs:
        try:
            cfg = check_run(r)
            if step is not None:
                step_folder(r, step)
        except (OSError, ValueError) as err:
            problems.append(str(err))
            continue
        if top_ks:
            n_e = cfg.model_config(vocab_size=2).n_experts
            bad = [k for k in top_ks if not 1 <= k <= n_e]
            if bad:
                problems.append(f"{r}: top_k {bad} outside [1, {n_e}]")
    if hfs:
        from moelab.integrations.hf.folder import check_folder

        for h in hfs:
            try:
                check_folder(h, trust_remote_code)
            except ValueError as err:
                problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


def _cloze_folder(
    result: dict[str, Any],
    kind: str,
    src: str,
    label: str,
    tmp: tempfile.TemporaryDirectory[str] | None,
    cloze_items: int | None,
    trust_remote_code: bool,
) -> list[str]:
    """The folder of the cloze task written for ``src`` (in a run folder, or for an ``hf``
    model under ``tmp``) as a one-item list, with a note in ``result``; [] when the tasks
    do not include it."""
    if CLOZE_TASK not in result["tasks"]:
        return []
    kw = {} if cloze_items is None else {"n": cloze_items}
    if kind == "run":
        cz = write_cloze_task(src, **kw)
    else:
        assert tmp is not None
        cz = write_cloze_task(out=Path(tmp.name) / label / CLOZE_TASK, **kw)
    cloze_dir = [cz["dir"]]
    if not trust_remote_code:  # what else a run's task folder may hold
        from moelab.integrations.lm_eval.trust import check_task_folders

        check_task_folders(cloze_dir)
    result["notes"].append(
        f"{label}: {CLOZE_TASK} has {cz['items']} items from the {cz['source']} (seed {cz['seed']})"
    )
    return cloze_dir


def _load_model(
    kind: str,
    src: str,
    step: int | None,
    batch_size: int,
    device: str,
    progress: bool,
    trust_remote_code: bool,
) -> tuple[Any, int | None]:
    """The harness model of a run (at ``step``, None: its newest checkpoint) or of an
    ``hf`` folder, and the checkpoint step loaded (None for ``hf``)."""
    from moelab.integrations.lm_eval.model import MoelabLM

    if kind == "run":
        from moelab.diagnostics.evaluate import load_run

        loaded = load_run(src, step)
        lm = MoelabLM(loaded=loaded, batch_size=batch_size, device=device,
                      progress=progress)  # fmt: skip
        return lm, loaded.step
    lm = MoelabLM(hf=src, batch_size=batch_size, device=device, progress=progress,
                  trust_remote_code=trust_remote_code)  # fmt: skip
    return lm, None


def _run_info(lm: Any, kind: str, src: str, label: str, step: int | None) -> dict[str, Any]:
    """The ``runs`` entry of one source."""
    return {
        "run": src,
        "label": label,
        "kind": kind,
        "checkpoint_step": step,
        "trained_top_k": lm.top_k,
        "n_experts": lm.backend.n_experts or None,
        "map": lm.backend.map_name if lm.routing is not None else None,
        "max_length": lm.max_length,
    }


def _routing_rows(lm: Any, tasks: Sequence[str], base: dict[str, Any]) -> list[dict[str, Any]]:
    """One routing row per task of the evaluation just done (``tasks``' order first, then
    by name); [] for a model without routing."""
    routing = []
    if lm.routing is not None:
        order = {t: i for i, t in enumerate(tasks)}
        by_task = lm.routing.result().items()
        for task, r in sorted(by_task, key=lambda x: (order.get(x[0], len(order)), x[0])):
            routing.append({**base, "task": task, **r})
    return routing


def _note_truncated(result: dict[str, Any], lm: Any, label: str) -> None:
    """Note in ``result`` how many requests were left-truncated (once per run)."""
    if lm.truncated:  # the same requests at every K: one note per run
        note = (
            f"{label}: {lm.truncated} of {lm.scored} requests were longer "
            f"than max_length = {lm.max_length} tokens and were left-truncated"
        )
        if note not in result["notes"]:
            result["notes"].append(note)


def _empty_result(tasks: list[str], limit: int | float | None) -> dict[str, Any]:
    """The result of :func:`run_downstream` before any source is evaluated."""
    return {
        "tasks": tasks,
        "limit": limit,
        "runs": [],
        "rows": [],
        "routing": [],
        "notes": [],
        "saved": [],
        "archived": [],
    }


def _score_source(
    result: dict[str, Any],
    evaluator: Any,
    kind: str,
    src: str,
    label: str,
    *,
    tmp: tempfile.TemporaryDirectory[str] | None,
    include: list[str],
    top_ks: Sequence[int] | None,
    step: int | None,
    setting: dict[str, Any],
    batch_size: int,
    device: str,
    progress: bool,
    network: bool,
    save: bool,
    trust_remote_code: bool,
) -> int | None:
    """Evaluate one run (``kind`` "run") or ``hf`` folder on ``result["tasks"]`` at each K,
    adding its entry, rows, routing rows and notes to ``result`` (and, with ``save``, a
    run's file after every K); returns the checkpoint step loaded (None for ``hf``)."""
    cloze_dir = _cloze_folder(
        result, kind, src, label, tmp, setting["cloze_items"], trust_remote_code
    )
    tm = _task_manager(include + cloze_dir, result["tasks"])
    lm, step = _load_model(kind, src, step, batch_size, device, progress, trust_remote_code)
    trained = lm.top_k
    result["runs"].append(_run_info(lm, kind, src, label, step))
    result["notes"] += [n for n in lm.notes if n not in result["notes"]]
    ks: list[int | None] = list(top_ks) if top_ks else [trained]
    for k in ks:
        lm.reset()
        with lm.using_top_k(k if top_ks else None), _quiet_harness(evaluator):
            res = _evaluate(evaluator, lm, tm, result["tasks"], setting, network, trust_remote_code)
        base = {"run": src, "label": label, "top_k": k, "checkpoint_step": step,
                "limit": setting["limit"]}  # fmt: skip
        rows = _rows(res, base)
        routing = _routing_rows(lm, result["tasks"], base)
        _note_truncated(result, lm, label)
        result["rows"] += rows
        result["routing"] += routing
        if save and kind == "run":
            doc = {
                "run": src,
                "checkpoint_step": step,  # the checkpoint loaded above
                **setting,
                "trained_top_k": trained,
                "task_versions": {r["task"]: r["task_version"] for r in rows},
                "rows": rows,
                "routing": routing,
                "notes": [n for n in result["notes"] if n.startswith(label)] + lm.notes,
            }
            _save(result, src, label, doc)
    return step


def run_downstream(
    runs: Sequence[str | Path],
    tasks: Sequence[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    top_ks: Sequence[int] | None = None,
    limit: int | float | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    hf: str | Path | Sequence[str | Path] | None = None,
    network: bool = False,
    progress: bool = True,
    save: bool = True,
    num_fewshot: int | None = None,
    cloze_items: int | None = None,
    step: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Evaluate ``runs`` (and the ``hf`` models) on ``tasks`` for each K of ``top_ks``
    (None: the trained K); see the module docstring. ``step``: each run's checkpoint of
    that step instead of its newest (``--step N``). A run's ``label`` is the shortest
    tail of its path that no other run shares (``softmax/seed0``).

    ``trust_remote_code``: let the ``hf`` folders run the code they name
    (:func:`moelab.integrations.hf.stats.load_hf`) and the harness run the Python of
    the task YAMLs under ``include_path`` and render their templates unsandboxed
    (:mod:`~moelab.integrations.lm_eval.trust`); it runs that Python with your
    permissions. Without it such a folder or task is refused before any evaluation.

    Returns ``{"tasks", "limit", "runs": [{"run", "label", "kind" ("run" or "hf"),
    "checkpoint_step", "trained_top_k", "n_experts", "map", "max_length"}], "rows":
    [{"run", "label", "top_k", "task", "task_version", "acc", "acc_stderr", "acc_norm",
    "acc_norm_stderr", "metrics", "samples", "checkpoint_step", "limit"}], "routing":
    [{"run", "label", "top_k", "task", "checkpoint_step", "limit", "tokens", "requests",
    "active_experts", "discarded_mass", "contributors", "load_cv", "layers": [...]}],
    "notes": [str, ...], "saved": [paths], "archived": [paths of earlier files moved
    to RUN/downstream/]}``.

    Raises:
        ValueError: no task, no run, a run folder that is not a run, an ``hf`` folder
            moelab does not read, a missing include path, a task file that would run
            code, an unknown task, a K outside [1, E] (checked before any evaluation);
            offline, a task whose data is not cached (the message names --network).
        ImportError: lm-eval is not installed (the message names the extra).
    """
    tasks = [str(t) for t in tasks]
    hfs = _as_list(hf)
    runs = [str(r) for r in runs]
    limit, include = _check_arguments(runs, tasks, hfs, limit, batch_size, include_path)
    _check_sources(runs, hfs, top_ks, step, trust_remote_code)
    import_lm_eval(network)
    from lm_eval import evaluator

    from moelab.integrations.lm_eval.trust import check_task_folders

    if not trust_remote_code:
        check_task_folders(include)

    result = _empty_result(tasks, limit)
    setting = {"limit": limit, "num_fewshot": num_fewshot, "cloze_items": cloze_items}
    tmp = tempfile.TemporaryDirectory(prefix="moelab-downstream-") if hfs else None
    try:
        sources: list[tuple[str, str]] = [("run", r) for r in runs] + [("hf", h) for h in hfs]
        labels = _labels([src for _, src in sources])
        for (kind, src), label in zip(sources, labels, strict=True):
            # NOTE: each run at ``step`` as given (None: its own newest checkpoint)
            _score_source(
                result, evaluator, kind, src, label, tmp=tmp, include=include, top_ks=top_ks,
                step=step, setting=setting, batch_size=batch_size, device=device,
                progress=progress, network=network, save=save,
                trust_remote_code=trust_remote_code,
            )  # fmt: skip
    finally:
        if tmp is not None:
            tmp.cleanup()
    return result
