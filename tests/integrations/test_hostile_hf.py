"""Hostile model and task folders: moelab never runs a folder's code (unless
--trust-remote-code) and reads only formats that cannot run code.

Each folder plants something that would run Python or read outside the folder: an
``auto_map`` naming a ``.py`` of the folder that writes a marker file when imported, a
pickle ``pytorch_model.bin`` whose unpickling writes one, a weights index or a tokenizer
config naming a file outside the folder, task YAMLs with ``!function``, a template that
reaches Python through Jinja, a metric that HF ``evaluate`` would load from a script,
an ``include:`` of a YAML outside the folder. The commands are run in-process with a
stdin (and ``input``) that would answer "y" to transformers' custom-code prompt; the
prompt must never be shown, the marker never written, and the refusal is one line."""

from __future__ import annotations

import builtins
import io
import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from moelab import cli
from moelab.integrations.hf.stats import load_hf
from tests.integrations import save_tiny, tiny_text


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def prompts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Every call of ``input`` (each answered "y"); stdin is a TTY full of "y". Also
    keeps transformers' copies of custom modules under tmp_path, in case one ran."""
    calls: list[Any] = []

    def answer(*args: Any) -> str:
        calls.append(args)  # recorded, not raised: transformers catches what input raises
        return "y"

    monkeypatch.setattr(builtins, "input", answer)
    monkeypatch.setattr(sys, "stdin", _Tty("y\n" * 100))
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    return calls


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(tiny_text(), encoding="utf-8")
    return path


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI: exit 2 and one line ``moelab COMMAND: error: ...`` on stderr."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if "examples/s]" not in line]  # datasets' progress bar
    assert len(err) == 1, err
    assert err[0].startswith(f"moelab {argv[0]}: error: ")
    assert "Traceback" not in err[0]
    return err[0]


def _edit_json(path: Path, **keys: Any) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc.update(keys)
    path.write_text(json.dumps(doc), encoding="utf-8")


_CODE = """\
import pathlib
pathlib.Path({marker!r}).write_text("the folder's code ran")
from transformers import PreTrainedConfig, PreTrainedTokenizerFast


class HostileConfig(PreTrainedConfig):
    model_type = "hostile_moe"


class HostileTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _plant_code(folder: Path, marker: Path) -> None:
    (folder / "hostile.py").write_text(_CODE.format(marker=str(marker)), encoding="utf-8")


# -- code named by the folder (auto_map) ------------------------------------------------


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_auto_map_is_refused_without_prompt(
    where: str,
    tmp_path: Path,
    text: Path,
    prompts: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A folder whose config names its own Python: refused before transformers reads it,
    whatever stdin would answer; the code never runs."""
    folder = save_tiny("qwen3_moe", tmp_path / "hostile")
    marker = tmp_path / "marker"
    _plant_code(folder, marker)
    if where == "config.json":  # a model type transformers does not know: only the code has it
        _edit_json(
            folder / "config.json",
            model_type="hostile_moe",
            auto_map={
                "AutoConfig": "hostile.HostileConfig",
                "AutoModelForCausalLM": "hostile.HostileModel",
            },
        )
    else:
        _edit_json(
            folder / "tokenizer_config.json",
            auto_map={"AutoTokenizer": ["hostile.HostileTokenizer", "hostile.HostileTokenizer"]},
        )
    capsys.readouterr()
    data = ["--data", str(text)]
    for argv in (
        ["stats", "--hf", str(folder), *data],
        ["eval", "--hf", str(folder), *data, "--top-k", "1"],
        ["downstream", "--hf", str(folder), "--tasks", "moelab_cloze"],
    ):
        msg = _one_error(capsys, argv)
        assert f"{where} names custom code (auto_map: " in msg and "hostile." in msg
        assert "--trust-remote-code" in msg
    assert prompts == []
    assert not marker.exists()
    with pytest.raises(ValueError, match="trust-remote-code"):  # the library too
        load_hf(folder)
    assert prompts == [] and not marker.exists()


def test_trust_remote_code_is_passed_through(
    tmp_path: Path,
    text: Path,
    prompts: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --trust-remote-code every from_pretrained gets trust_remote_code=True (the
    loaders are wrapped to record it and load without the code, so nothing runs here);
    without it every one gets False, and the weights use_safetensors=True."""
    import transformers as tf

    folder = save_tiny("qwen3_moe", tmp_path / "custom")
    marker = tmp_path / "marker"
    _plant_code(folder, marker)
    _edit_json(folder / "config.json", auto_map={"AutoConfig": "hostile.HostileConfig"})
    seen: list[tuple[str, dict[str, Any]]] = []
    depth = [0]  # the calls moelab makes, not those transformers makes inside them

    def recording(cls: Any, name: str) -> None:
        original = cls.from_pretrained.__func__

        def wrapped(klass: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                seen.append((name, dict(kwargs)))
                kwargs["trust_remote_code"] = False
            depth[0] += 1
            try:
                return original(klass, *args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(cls, "from_pretrained", classmethod(wrapped))

    capsys.readouterr()
    msg = _one_error(capsys, ["stats", "--hf", str(folder), "--data", str(text)])
    assert "config.json names custom code" in msg  # not without the flag
    assert "transformers has its own 'qwen3_moe' code: delete auto_map" in msg
    recording(tf.AutoConfig, "config")
    recording(tf.AutoTokenizer, "tokenizer")
    recording(tf.AutoModelForCausalLM, "model")
    capsys.readouterr()
    argv = ["stats", "--hf", str(folder), "--data", str(text), "--json", "--trust-remote-code"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "qwen3_moe"
    assert {n for n, _ in seen} == {"config", "tokenizer", "model"}
    assert all(kw.get("trust_remote_code") is True for _, kw in seen), seen
    assert all(kw.get("use_safetensors") is True for n, kw in seen if n == "model"), seen
    # the flag is on eval and in the help of both commands
    seen.clear()
    argv = ["eval", "--hf", str(folder), "--data", str(text), "--top-k", "2", "--json"]
    assert cli.main([*argv, "--trust-remote-code"]) == 0
    capsys.readouterr()
    assert seen and all(kw.get("trust_remote_code") is True for _, kw in seen), seen
    for cmd in ("stats", "eval", "downstream"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        assert "--trust-remote-code" in capsys.readouterr().out
    # a folder without auto_map: every loader is told False, explicitly
    plain = save_tiny("qwen3_moe", tmp_path / "plain")
    seen.clear()
    assert cli.main(["stats", "--hf", str(plain), "--data", str(text), "--json"]) == 0
    capsys.readouterr()
    assert {n for n, _ in seen} == {"config", "tokenizer", "model"}
    assert all(kw.get("trust_remote_code") is False for _, kw in seen), seen
    assert prompts == [] and not marker.exists()


# -- weights: safetensors only ------------------------------------------------------------


class _Planted:
    """Unpickling this writes the marker (what a hostile pytorch_model.bin does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "unpickled"))


@pytest.mark.parametrize("kind", ["hostile", "state_dict"])
def test_pickle_weights_are_refused(
    kind: str,
    tmp_path: Path,
    text: Path,
    prompts: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """pytorch_model.bin without a safetensors file: refused in one line before it is
    opened, whether it is a hostile pickle or a plain state dict."""
    import torch
    from safetensors.torch import load_file

    folder = save_tiny("mixtral", tmp_path / "pickled")
    marker = tmp_path / "marker"
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if kind == "hostile":
        with (folder / "pytorch_model.bin").open("wb") as f:
            pickle.dump({"payload": _Planted(marker), **state}, f)
    else:
        torch.save(state, folder / "pytorch_model.bin")
    capsys.readouterr()
    msg = _one_error(capsys, ["stats", "--hf", str(folder), "--data", str(text)])
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "pickle" in msg
    assert not marker.exists() and prompts == []


def test_index_naming_files_outside_the_folder_is_refused(
    tmp_path: Path, text: Path, prompts: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A model.safetensors.index.json whose weight_map names ../ (or an absolute path):
    refused; the shard outside is never read."""
    folder = save_tiny("mixtral", tmp_path / "m")
    shutil.move(folder / "model.safetensors", tmp_path / "outside.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "outside.safetensors"), "pt") as f:
        keys = list(f.keys())
    for shard in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index = {"metadata": {}, "weight_map": {k: shard for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
        capsys.readouterr()
        msg = _one_error(capsys, ["stats", "--hf", str(folder), "--data", str(text)])
        assert "model.safetensors.index.json" in msg and shard in msg and "inside" in msg


# -- tokenizer: tokenizer.json only ----------------------------------------------------------


def test_tokenizer_outside_json_or_folder_is_refused(
    tmp_path: Path, text: Path, prompts: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """No tokenizer.json (only a slow tokenizer's vocabulary files): refused; a
    tokenizer_config.json whose fast_tokenizer_files names a file outside: refused."""
    folder = save_tiny("mixtral", tmp_path / "m")
    # a slow byte-level BPE's files (vocab.json + merges.txt) instead of tokenizer.json
    model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    shutil.move(folder / "tokenizer.json", tmp_path / "tokenizer.4.0.json")
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer")
    capsys.readouterr()
    msg = _one_error(capsys, ["stats", "--hf", str(folder), "--data", str(text)])
    assert "no tokenizer" in msg and "tokenizer.json" in msg
    # the tokenizer config points transformers at a tokenizer.json outside the folder
    _edit_json(
        folder / "tokenizer_config.json",
        tokenizer_class="PreTrainedTokenizerFast",
        fast_tokenizer_files=["../tokenizer.4.0.json"],
    )
    (folder / "tokenizer.json").write_text("{}", encoding="utf-8")  # moelab's check passes
    msg = _one_error(capsys, ["stats", "--hf", str(folder), "--data", str(text)])
    assert "fast_tokenizer_files" in msg and "../tokenizer.4.0.json" in msg and "inside" in msg


@pytest.mark.parametrize(
    "name", ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
)
def test_a_file_that_is_not_utf8_is_named(
    tmp_path: Path, text: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Issue 39, item 9: a file of the --hf folder that is not UTF-8 (a byte 0xff in
    it) is named in the one-line error (tokenizer.json and special_tokens_map.json were
    not: "no tokenizer there ('utf-8' codec can't decode ...)")."""
    folder = save_tiny("mixtral", tmp_path / "m")
    path = folder / name
    body = path.read_bytes() if path.exists() else b'{"pad_token": "<|endoftext|>"}'
    path.write_bytes(body[:1] + b" \xff " + body[1:])
    with pytest.raises(UnicodeDecodeError):
        path.read_text(encoding="utf-8")
    capsys.readouterr()
    for argv in (
        ["stats", "--hf", str(folder), "--data", str(text)],
        ["eval", "--hf", str(folder), "--data", str(text), "--top-k", "2"],
    ):
        msg = _one_error(capsys, argv)
        assert str(path) in msg and "UTF-8" in msg, msg


def test_a_data_file_that_is_not_utf8_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--data with --hf: a text file that is not UTF-8 is named (the error was the bare
    "'utf-8' codec can't decode byte 0xff in position 6")."""
    folder = save_tiny("mixtral", tmp_path / "m")
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text(tiny_text(), encoding="utf-8")
    (data / "b.txt").write_bytes(b"caf\xe9 au lait\n" * 3)  # latin-1
    capsys.readouterr()
    for argv in (
        ["stats", "--hf", str(folder), "--data", str(data)],
        ["eval", "--hf", str(folder), "--data", str(data), "--top-k", "2"],
    ):
        msg = _one_error(capsys, argv)
        assert str(data / "b.txt") in msg and "UTF-8" in msg, msg


# -- lm-evaluation-harness task folders ---------------------------------------------------


_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: multiple_choice
test_split: test
doc_to_text: {text}
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
{extra}"""


def _task_folder(folder: Path, name: str, *, text: str = '"{{question}}"', metric: str = "acc",
                 extra: str = "") -> Path:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    docs = [
        {"question": "The quick brown fox jumps over the", "choices": ["dog", "sun"], "label": 0},
        {"question": "A mixture of experts routes each", "choices": ["token", "cloud"], "label": 0},
    ]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        _TASK.format(
            name=name,
            data=json.dumps(str(data)),
            cache=json.dumps(str(folder / "cache")),
            text=text,
            metric=metric,
            extra=extra,
        ),
        encoding="utf-8",
    )
    return folder


_TASK_CODE = """\
import pathlib
pathlib.Path({marker!r}).write_text("the task folder's code ran")


def process_docs(dataset):
    return dataset
"""


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("mixtral", tmp_path_factory.mktemp("hf") / "mixtral")


def _downstream(folder: Path, model: Path, task: str, *more: str) -> list[str]:
    return ["downstream", "--hf", str(model), "--tasks", task, "--include-path", str(folder),
            "--limit", "2", "--json", *more]  # fmt: skip


def test_task_function_code_is_refused_unless_trusted(
    tiny_hf: Path,
    tmp_path: Path,
    prompts: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A task YAML with ``!function`` (the harness imports the .py beside it): refused in
    one line, the .py never imported; with --trust-remote-code the harness runs it."""
    pytest.importorskip("lm_eval")
    marker = tmp_path / "marker"
    code = "process_docs: !function utils.process_docs\n"
    folder = _task_folder(tmp_path / "tasks", "evil", extra=code)
    (folder / "utils.py").write_text(_TASK_CODE.format(marker=str(marker)), encoding="utf-8")
    capsys.readouterr()
    msg = _one_error(capsys, _downstream(folder, tiny_hf, "evil"))
    assert "evil.yaml" in msg and "!function utils.process_docs" in msg
    assert "--trust-remote-code" in msg
    assert not marker.exists()
    # a task YAML included from outside the folder: refused, even without code in it
    outside = _task_folder(tmp_path / "elsewhere", "base")
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "child.yaml").write_text(f"include: {outside / 'base.yaml'}\ntask: child\n")
    msg = _one_error(capsys, _downstream(inc, tiny_hf, "child"))
    assert "child.yaml" in msg and "include" in msg and "inside" in msg
    # trusted: the harness imports utils.py, as the user asked
    assert cli.main(_downstream(folder, tiny_hf, "evil", "--trust-remote-code")) == 0
    capsys.readouterr()
    assert marker.exists()
    assert prompts == []


def test_task_template_cannot_reach_python(
    tiny_hf: Path,
    tmp_path: Path,
    prompts: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A doc_to_text template that climbs from a Jinja global to Python's builtins
    (template injection): the harness renders task templates in a sandbox under
    moelab, so the attempt fails in one line and writes nothing."""
    pytest.importorskip("lm_eval")
    marker = tmp_path / "marker"
    reach = f"lipsum.__globals__.__builtins__.open({str(marker)!r}, 'w').write('ran')"
    text = json.dumps("{{ " + reach + " }}{{question}}")
    folder = _task_folder(tmp_path / "tasks", "inject", text=text)
    capsys.readouterr()
    msg = _one_error(capsys, _downstream(folder, tiny_hf, "inject"))
    assert "inject" in msg and "unsafe" in msg
    assert not marker.exists()
    assert prompts == []


def test_task_metric_from_a_script_is_refused(
    tiny_hf: Path,
    tmp_path: Path,
    prompts: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A metric the harness does not define is loaded by HF evaluate, which runs a local
    metric script: refused before the harness builds the task."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    marker = tmp_path / "marker"
    script = tmp_path / "evilmetric.py"
    script.write_text(_TASK_CODE.format(marker=str(marker)), encoding="utf-8")
    folder = _task_folder(tmp_path / "tasks", "scripted", metric=json.dumps(str(script)))
    capsys.readouterr()
    msg = _one_error(capsys, _downstream(folder, tiny_hf, "scripted"))
    assert "scripted.yaml" in msg and "evilmetric.py" in msg and "metric" in msg
    assert not marker.exists()
    assert prompts == []
