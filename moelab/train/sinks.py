"""Live sinks of training's metrics rows: TensorBoard and Weights & Biases, beside
``RUN/metrics.jsonl``, which is always written and stays the source of truth.

``TrainConfig.log`` (``moelab train --log tensorboard,wandb``) names them; both are in
the track extra (``pip install 'moelab[track]'``) and imported only when asked for.
Only rank 0 opens them (:func:`open_sinks` gives the other ranks an empty
:class:`Sinks`); the rows they get are the global ones of metrics.jsonl.

What each sink receives of a row (:func:`scalars`, :func:`histograms`):

* every number of the row under its own name, at the row's step (``step`` itself and
  the per-layer copies ``active_experts.<i>`` excepted: ``active/min|median|max``
  summarise them, so the number of scalars does not grow with the depth);
* ``load_share/layer<i>``: a histogram of the experts' shares of layer i's load over
  the logging window (``load_share_layers``);
* ``warnings``: each warning line of the row (moelab.train.health.Watch) as text;
* ``load_heatmap/layer<i>``: an image, experts by logged step, of the load shares
  since the run began (:meth:`Sinks.heatmaps`, every ``eval_every`` steps).

TensorBoard: a ``SummaryWriter`` on ``RUN/tensorboard/``. A resumed run opens a new
event file in the same folder with ``purge_step`` at its first step, so TensorBoard's
reader drops what an interrupted part logged after its checkpoint: every step appears
once, with the values of metrics.jsonl.

Weights & Biases: ``wandb.init(dir=RUN, mode=...)`` with the mode of the environment's
``WANDB_MODE`` and ``"offline"`` without one (``RUN/wandb/offline-run-*``, sent later
with ``wandb sync``). The run id is kept in ``RUN/wandb/moelab-run.json`` with the last
step sent, so a resumed run continues the same W&B run and skips the steps that run
already holds (W&B keeps a run's steps increasing).

A sink that fails while the run trains (a full disk, a crashed W&B service) is closed
with one warning line and the run goes on: metrics.jsonl holds every row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EXTRA",
    "Sinks",
    "check_available",
    "histograms",
    "open_sinks",
    "scalars",
]

EXTRA = "pip install 'moelab[track]'"

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_available(names: Sequence[str]) -> None:
    """Raise ValueError (one line naming the extra) when a sink's package is missing."""
    for name in names:
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"--log {name} needs the {package} package, which is not installed: {EXTRA}"
            )


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``row`` that the sinks write as scalars (see the module)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("active_experts.") and key[len("active_experts.") :].isdigit():
            continue
        out[key] = float(value)
    return out


def histograms(row: dict[str, Any]) -> dict[str, list[float]]:
    """``load_share/layer<i>``: the load shares of each MoE layer in ``row``."""
    return {
        f"load_share/layer{i}": [float(v) for v in shares]
        for i, shares in enumerate(row.get("load_share_layers") or [])
    }


def heatmap_image(steps: Sequence[int], shares: np.ndarray, title: str) -> np.ndarray:
    """An RGB image (height, width, 3; uint8) of load shares ``shares`` (logged steps x
    experts): experts down, logged steps across."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    n, e = shares.shape
    im = ax.imshow(
        shares.T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap="viridis",
        vmin=0.0,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, e - 0.5) if n > 1 else None,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="share of the layer's load")
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, run: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # NOTE: purge_step makes TensorBoard's reader drop the events at and after it
        # from the earlier files of the folder: what a part logged past its checkpoint
        self.writer = SummaryWriter(
            log_dir=str(run / "tensorboard"),
            purge_step=start + 1 if start > 0 else None,
            flush_secs=10,
        )

    def write(self, step: int, numbers: dict[str, float], hists: dict[str, list[float]]) -> None:
        for tag, value in numbers.items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in hists.items():
            self.writer.add_histogram(tag, np.asarray(values, dtype=np.float64), step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def image(self, step: int, tag: str, rgb: np.ndarray) -> None:
        self.writer.add_image(tag, rgb, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, run: Path, config: dict[str, Any], start: int) -> None:
        import wandb

        self.wandb = wandb
        folder = run / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.state_path = folder / "moelab-run.json"
        state = _read_state(self.state_path) if start > 0 else {}
        run_id = state.get("id") or secrets.token_hex(4)
        # NOTE: what this run already holds: W&B keeps a run's steps increasing
        self.last_step = int(state.get("last_step", -1)) if state.get("id") else -1
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "moelab",
            name=run.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(run),
            mode=mode,
            config=config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.mode = mode
        self._save(self.last_step)

    def _save(self, last_step: int) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run.id, "last_step": last_step}) + "\n")
        os.replace(tmp, self.state_path)

    def write(self, step: int, numbers: dict[str, float], hists: dict[str, list[float]]) -> None:
        if step <= self.last_step:
            return
        data: dict[str, Any] = dict(numbers)
        for tag, values in hists.items():
            data[tag] = self.wandb.Histogram(np.asarray(values, dtype=np.float64))
        self.run.log(data, step=step)
        self.last_step = step
        self._save(step)

    def text(self, step: int, tag: str, text: str) -> None:
        if step > self.last_step:
            self.run.log({tag: text}, step=step)
            self.last_step = step
            self._save(step)

    def image(self, step: int, tag: str, rgb: np.ndarray) -> None:
        if step >= self.last_step:  # an image of the step just written joins its row
            self.run.log({tag: self.wandb.Image(rgb)}, step=step)
            self.last_step = step

    def close(self) -> None:
        self.run.finish()


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class Sinks:
    """The open sinks of a run (none on ranks other than 0, or without ``--log``)."""

    def __init__(
        self,
        sinks: Sequence[Any] = (),
        say: Callable[[str], None] = print,
        history: dict[int, list[list[float]]] | None = None,
    ) -> None:
        self._sinks = list(sinks)
        self._say = say
        self._history = dict(history or {})  # step -> load_share_layers

    def __bool__(self) -> bool:
        return bool(self._sinks)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._sinks]

    def _each(self, what: Callable[[Any], None]) -> None:
        for sink in list(self._sinks):
            try:
                what(sink)
            except Exception as err:  # NOTE: a sink must not stop training
                self._sinks.remove(sink)
                self._say(
                    f"warning: the {sink.name} sink failed ({type(err).__name__}: {err}) and "
                    "is closed; metrics.jsonl keeps every row"
                )
                try:
                    sink.close()
                except Exception:
                    pass

    def write(self, row: dict[str, Any]) -> None:
        """Send one metrics row (and its warnings) to every sink."""
        if not self._sinks:
            return
        step = int(row["step"])
        if row.get("load_share_layers"):
            self._history[step] = row["load_share_layers"]
        numbers, hists = scalars(row), histograms(row)
        self._each(lambda s: s.write(step, numbers, hists))
        for line in row.get("warnings") or []:
            self._each(lambda s, line=line: s.text(step, "warnings", line))

    def event(self, step: int, text: str) -> None:
        """A warning outside a row (a loss that is not finite, before training stops)."""
        self._each(lambda s: s.text(step, "warnings", text))

    def heatmaps(self, step: int) -> None:
        """Per MoE layer, the expert-by-step image of the load shares logged so far."""
        if not self._sinks or not self._history:
            return
        steps = sorted(self._history)
        n_layers = len(self._history[steps[-1]])
        for i in range(n_layers):
            rows = [(s, self._history[s][i]) for s in steps if len(self._history[s]) > i]
            width = len(rows[-1][1])
            rows = [(s, r) for s, r in rows if len(r) == width]
            shares = np.asarray([r for _, r in rows], dtype=np.float64)
            image = heatmap_image([s for s, _ in rows], shares, f"MoE layer {i}: load share")
            self._each(lambda s, i=i, image=image: s.image(step, f"load_heatmap/layer{i}", image))

    def close(self) -> None:
        self._each(lambda s: s.close())
        self._sinks = []


def open_sinks(
    names: Sequence[str],
    run: Path,
    config: dict[str, Any],
    start: int,
    is_main: bool,
    say: Callable[[str], None],
    rows: Sequence[dict[str, Any]] = (),
) -> Sinks:
    """The sinks ``names`` of run folder ``run`` (rank 0 only: ``is_main``), the part
    starting after step ``start``; ``rows`` are the metrics rows already in the run (the
    heatmaps' history), ``config`` the run's config (W&B's run config)."""
    if not names or not is_main:
        return Sinks(say=say)
    check_available(names)
    opened: list[Any] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(_TensorBoard(run, start))
                say(f"tensorboard: {run / 'tensorboard'} (tensorboard --logdir {run})")
            elif name == "wandb":
                sink = _Wandb(run, config, start)
                opened.append(sink)
                where = (
                    f"offline in {run / 'wandb'} (send it with: wandb sync "
                    f"{run / 'wandb'}/offline-run-*)"
                    if sink.mode == "offline"
                    else f"mode {sink.mode}"
                )
                say(f"wandb: run {sink.run.id}, {where}")
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    history = {
        int(r["step"]): r["load_share_layers"]
        for r in rows
        if r.get("load_share_layers") and r["step"] <= start
    }
    return Sinks(opened, say, history)
