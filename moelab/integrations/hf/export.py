"""Export a moelab training run as a Hugging Face ``save_pretrained`` folder that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads (``moelab export``).

Two formats (:data:`FORMATS`):

``native``
    transformers' own ``qwen2_moe`` (``Qwen2MoeForCausalLM``), no custom code, exact
    when every router is a plain softmax top-k (:mod:`moelab.integrations.hf.export_native`:
    the mapping of every weight, and :func:`native_obstacle`, which names what prevents it).

``remote``
    any router: ``model_type: "moelab"``, with ``configuration_moelab.py`` and
    ``modeling_moelab.py`` (from :mod:`moelab.integrations.hf.remote`) copied in and named
    by ``auto_map``; the model is moelab's own Transformer rebuilt from the run's whole
    ModelConfig (``config.moelab_model``), its weights under the prefix ``model.``. It
    loads with ``trust_remote_code=True`` and needs moelab installed.

``auto`` (the default) takes native where it is exact, else remote.

Every folder gets the run's tokenizer as a ``PreTrainedTokenizerFast`` (the run's own
byte-level BPE ``tokenizer.json``, with ``<|endoftext|>`` as eos/bos/pad and
``split_special_tokens`` so that text containing that string encodes as bytes, as in
moelab), checked to encode sample texts to moelab's ids; a ``generation_config.json``;
a README.md; and the marker ``.moelab-export.json``.

Nothing is left half-written: the folder is built in a temporary sibling, reloaded with
transformers and its float32 logits on a fixed input compared with the run's model
(refused, and the temporary removed, beyond :data:`CHECK_ATOL`), then renamed to OUT.
OUT must be new, empty, or an earlier moelab export (its marker), which it replaces.

Shape suffixes: B, S, V (moelab.shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moelab import __version__
from moelab._io import usual_mode, write_json
from moelab.integrations.hf.export_native import native_obstacle, write_native
from moelab.runs.folders import staged_folder

__all__ = [
    "CHECK_ATOL",
    "FORMATS",
    "MARKER",
    "ExportCheckError",
    "ExportResult",
    "check_out",
    "export_run",
    "native_obstacle",
]

FORMATS = ("auto", "native", "remote")
MARKER = ".moelab-export.json"
CHECK_ATOL = 1e-4
"""The largest |logit difference| (float32) between the reloaded folder and the run's
model on the fixed check input that an export accepts."""

REMOTE_FILES = ("configuration_moelab.py", "modeling_moelab.py")

TOKENIZER_SAMPLES = (
    "The cat sees the book in the morning.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "ünïcödé, emoji 🙂 and 日本語",
    "a document that contains <|endoftext|> as text",
    "",
)
"""Texts whose ids the exported tokenizer must give as moelab's tokenizer does."""


class ExportCheckError(ValueError):
    """The folder written does not reproduce the run's model (a bug): nothing is kept."""


@dataclass
class ExportResult:
    """What :func:`export_run` wrote."""

    path: Path
    """The exported folder."""
    format: str
    """"native" or "remote"."""
    architecture: str
    """The transformers class: "Qwen2MoeForCausalLM" or "MoelabForCausalLM"."""
    step: int
    """The checkpoint step exported."""
    run: Path = Path()
    """The run folder."""
    files: list[str] = field(default_factory=list)
    """The files of the folder, by name."""
    max_abs_diff: float = 0.0
    """max |logits(reloaded folder) - logits(run)| on the check input, float32."""
    tokenizer: bool = True
    """Whether the folder holds the run's tokenizer."""
    reason: str | None = None
    """Why an "auto" export is remote (the router field that rules native out)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"], d["run"] = str(self.path), str(self.run)
        return d


# -- the native path's conditions ----------------------------------------------------


# -- the output folder ---------------------------------------------------------------


def check_out(out: Path) -> None:
    """FileExistsError unless ``out`` is missing, an empty folder, or an earlier moelab
    export (its marker :data:`MARKER`); NotADirectoryError for a file."""
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    if (out / MARKER).is_file():
        return
    names = sorted(p.name for p in out.iterdir())
    if names:
        raise FileExistsError(
            f"--out {out} is not empty and not a moelab export (no {MARKER}; it holds "
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); give a new or "
            "empty folder"
        )


# -- writing ---------------------------------------------------------------------------


def _write_remote(model: Any, tokenizer: Any, folder: Path) -> str:
    from safetensors.torch import save_file

    from moelab.integrations.hf.remote.configuration_moelab import MoelabConfig
    from moelab.runs.checkpoints import model_tensors

    tensors, extra = model_tensors(model)
    here = Path(__file__).parent / "remote"
    for name in REMOTE_FILES:
        shutil.copyfile(here / name, folder / name)
    c = model.config
    eos = int(tokenizer.eos_id)
    config = MoelabConfig(
        moelab_model=json.loads(json.dumps(dataclasses.asdict(c))),
        moelab_extra_state=json.loads(json.dumps(extra)),
        moelab_version=__version__,
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        max_position_embeddings=c.max_seq_len,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        architectures=["MoelabForCausalLM"],
    )
    config.auto_map = {
        "AutoConfig": "configuration_moelab.MoelabConfig",
        "AutoModelForCausalLM": "modeling_moelab.MoelabForCausalLM",
    }
    config.save_pretrained(folder)
    save_file(
        # floating tensors in float32; integer buffers (a hash table, step counters) as
        # they are
        {f"model.{k}": v.float() if v.is_floating_point() else v for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return "MoelabForCausalLM"


def _write_generation_config(tokenizer: Any, folder: Path) -> None:
    from transformers import GenerationConfig

    eos = int(tokenizer.eos_id)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(folder)


def _write_tokenizer(tokenizer: Any, max_len: int, folder: Path) -> None:
    """The run's byte-level BPE as a PreTrainedTokenizerFast, checked on
    :data:`TOKENIZER_SAMPLES` after reloading it from ``folder``."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    from moelab.data.tokenizer import EOS_TOKEN

    fast = PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(tokenizer.to_json()),
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        split_special_tokens=True,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(folder)
    back = PreTrainedTokenizerFast.from_pretrained(folder)
    for text in TOKENIZER_SAMPLES:
        want = tokenizer.encode(text)
        got = back(text, add_special_tokens=False)["input_ids"]
        if got != want or back.decode(got) != tokenizer.decode(want):
            raise ExportCheckError(
                f"the exported tokenizer encodes {text!r} to {got[:8]}..., moelab's to "
                f"{want[:8]}...; nothing was written (this is a bug in moelab export)"
            )
    if back.eos_token_id != tokenizer.eos_id:
        raise ExportCheckError("the exported tokenizer's eos id is not moelab's (a bug)")


def _readme(result: ExportResult, reason: str | None) -> str:
    name = result.path.name
    if result.format == "native":
        how = (
            f"transformers' own `qwen2_moe` architecture ({result.architecture}); it loads "
            "without custom code and without moelab."
        )
        trust = ""
    else:
        how = (
            "moelab's own model behind transformers' interface (`model_type: moelab`, "
            "`configuration_moelab.py` and `modeling_moelab.py` here). **It needs moelab "
            "installed** (`pip install moelab`) and `trust_remote_code=True`, which runs "
            "the Python files of this folder: read them first."
            + (f" Native export was ruled out by {reason}." if reason else "")
            + " Generation recomputes the whole prefix at each step (no KV cache) and "
            "accepts right padding only."
        )
        trust = ", trust_remote_code=True"
    return f"""# {name}

Exported by `moelab export` (moelab {__version__}) from the run `{result.run}`,
checkpoint step {result.step}, as {how}

Weights are float32 (`model.safetensors`); the tokenizer is the run's byte-level BPE
(`<|endoftext|>` is eos, bos and pad; text that contains that string encodes as bytes).
On export the folder was reloaded with transformers and its logits on a fixed input
matched the run's model to {result.max_abs_diff:.1e} (limit {CHECK_ATOL:g}).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}"{trust})
tokenizer = AutoTokenizer.from_pretrained("{name}"{trust})
ids = tokenizer("The cat sees", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0]))
```
"""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings and progress bars off while the exporter loads what it
    wrote (its own checks say what matters), restored after."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


@contextlib.contextmanager
def _write_errors(tmp: Path, out: Path) -> Iterator[None]:
    """A failed write while the folder is built in ``tmp`` (a full disk) as an OSError
    that names the file of ``out`` it was for: safetensors raises its own SafetensorError
    ("I/O error: No space left on device (os error 28)"), and an OSError names the
    staging folder's file, or none."""
    try:
        yield
    except OSError as err:
        name = None if err.filename is None else Path(os.fsdecode(err.filename))
        if isinstance(err, BrokenPipeError) or (name is not None and name.parent != tmp):
            raise
        where = out if name is None else out / name.name
        raise OSError(err.errno, err.strerror or str(err), str(where)) from err
    except Exception as err:
        found = re.search(r"os error (\d+)", str(err))
        if type(err).__name__ != "SafetensorError" or found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(out / "model.safetensors")) from err


# -- checking ----------------------------------------------------------------------


CHECK_LEN = 512
"""The check input's length cap: its sequences span positions 0 .. min(max_seq_len,
CHECK_LEN) - 1, where the rotary tables of qwen2_moe (float32) and moelab (float64) drift
apart the most that is checked."""


def check_input(vocab_size: int, max_seq_len: int) -> torch.Tensor:
    """The fixed check input: (2, min(max_seq_len, CHECK_LEN)) token ids from a seeded
    generator."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (2, min(max_seq_len, CHECK_LEN)), generator=gen)


def _forget_remote_module(folder: Path) -> None:
    """Remove the copy of ``folder``'s Python that loading it with trust_remote_code left
    in transformers' module cache (``HF_MODULES_CACHE/transformers_modules/NAME``): the
    temporary's name is never loaded again, so each export would leave one behind."""
    from transformers.utils import HF_MODULES_CACHE

    name = folder.name
    try:
        from transformers.dynamic_module_utils import _sanitize_module_name

        name = _sanitize_module_name(name)
    except ImportError:  # NOTE: a private helper; the plain name where it is gone
        pass
    shutil.rmtree(Path(HF_MODULES_CACHE) / "transformers_modules" / name, ignore_errors=True)


def _reload_diff(model: Any, folder: Path, remote: bool) -> float:
    """max |logits| difference of the folder reloaded by transformers and ``model``, in
    float32 on :func:`check_input`; ExportCheckError when transformers reports missing or
    unexpected weights."""
    from transformers import AutoModelForCausalLM

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            hf, info = AutoModelForCausalLM.from_pretrained(
                folder, trust_remote_code=remote, dtype=torch.float32, output_loading_info=True
            )
    finally:
        if remote:
            _forget_remote_module(folder)
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise ExportCheckError(
            f"transformers reloads the exported folder with {bad or info['error_msgs']}; "
            "nothing was written (this is a bug in moelab export)"
        )
    hf.eval()
    idx = check_input(model.config.vocab_size, model.config.max_seq_len)
    with torch.no_grad():
        want = model(idx, collect=False).logits_BSV.float()
        got = hf(input_ids=idx).logits.float()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max())


def _build(
    loaded: Any, model: Any, chosen: str, obstacle: str | None, run: Path, tmp: Path, out: Path
) -> ExportResult:
    """Write the whole folder for ``out`` into ``tmp``, reload it and check it (module
    docstring)."""
    writer = write_native if chosen == "native" else _write_remote
    arch = writer(model, loaded.tokenizer, tmp)
    _write_generation_config(loaded.tokenizer, tmp)
    _write_tokenizer(loaded.tokenizer, model.config.max_seq_len, tmp)
    diff = _reload_diff(model, tmp, remote=chosen == "remote")
    if not diff <= CHECK_ATOL:
        raise ExportCheckError(
            f"the exported {chosen} model's logits differ from the run's by {diff:.3g} "
            f"(> {CHECK_ATOL:g}) on a fixed input; nothing was written (this is a bug "
            "in moelab export; --format remote keeps moelab's own model)"
        )
    result = ExportResult(
        path=out,
        format=chosen,
        architecture=arch,
        step=loaded.step,
        run=run,
        max_abs_diff=diff,
        reason=obstacle if chosen == "remote" else None,
    )
    (tmp / "README.md").write_text(_readme(result, obstacle), encoding="utf-8")
    marker = {"made_by": "moelab export", "moelab": __version__, **result.to_dict()}
    marker.pop("files")
    write_json(tmp / MARKER, marker)
    return result


# -- the entry point -----------------------------------------------------------------


def export_run(
    run: str | Path,
    out: str | Path,
    step: int | None = None,
    format: str = "auto",
) -> ExportResult:
    """Write the run's checkpoint (the newest, or ``step``'s; the loader and errors of
    :func:`moelab.diagnostics.load_run`, as ``moelab stats --step``) to ``out`` as a
    transformers folder in ``format`` ("auto", "native" or "remote"; module docstring).

    Raises:
        ValueError: an unknown format; "native" for a run whose routers qwen2_moe cannot
            express (the message names the setting); ExportCheckError when the written
            folder does not reproduce the model (nothing is kept).
        FileExistsError / NotADirectoryError: ``out`` holds files and is no earlier
            export, or is a file.
        what ``load_run`` raises for a missing run, step or damaged checkpoint.
    """
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    out = Path(out)
    check_out(out)
    from moelab.diagnostics import load_run
    from moelab.integrations.hf.families import import_transformers

    import_transformers()
    loaded = load_run(run, step)
    model = loaded.model.float().eval()
    obstacle = native_obstacle(model)
    if format == "native" and obstacle is not None:
        raise ValueError(
            f"--format native needs softmax top-k routers that qwen2_moe reproduces "
            f"exactly; this run has {obstacle}: use --format remote (or auto)"
        )
    chosen = "native" if format == "native" or (format == "auto" and obstacle is None) else "remote"
    with staged_folder(out, f"{out.name}_moelab_export_tmp{os.getpid()}") as tmp:
        with _quiet(), _write_errors(tmp, out):
            result = _build(loaded, model, chosen, obstacle, Path(run), tmp, out)
        for path in tmp.iterdir():  # safetensors writes its file 0600: the usual mode
            usual_mode(path)
    result.files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    return result
