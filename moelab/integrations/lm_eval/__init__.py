"""Downstream tasks through lm-evaluation-harness (extra ``eval``), with routing
statistics per task.

- :mod:`.model`: :class:`~moelab.integrations.lm_eval.model.MoelabLM`, the harness model
  of a moelab run (or a local Hugging Face MoE model), registered as ``"moelab"``;
- :mod:`.routing`: the routing statistics of the tokens each task's requests fed;
- :mod:`.cloze`: the ready offline cloze task ``moelab_cloze`` (:func:`write_cloze_task`);
- :mod:`.run`: :func:`run_downstream`, what ``moelab downstream`` calls;
- :mod:`.saved`: ``RUN/downstream.json`` (one checkpoint step, limit and task version
  per file) and how the report and the studies tell current scores from stale ones.
- :mod:`.trust`: what the harness may run from a task folder (no ``!function``, metric
  script or outside include unless ``trust_remote_code``; templates in Jinja's sandbox).

The harness and the Hugging Face libraries are imported lazily, after the offline
switches are set (:func:`import_lm_eval`); importing this package needs neither, and
:func:`write_cloze_task` works without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moelab.integrations.lm_eval.cloze import CLOZE_TASK, write_cloze_task
from moelab.integrations.lm_eval.run import import_lm_eval, run_downstream

if TYPE_CHECKING:
    from moelab.integrations.lm_eval.model import MoelabLM

__all__ = ["CLOZE_TASK", "MoelabLM", "import_lm_eval", "run_downstream", "write_cloze_task"]


def __getattr__(name: str) -> Any:
    if name == "MoelabLM":  # imports the harness (ImportError naming the extra if missing)
        import_lm_eval()
        from moelab.integrations.lm_eval.model import MoelabLM

        return MoelabLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
