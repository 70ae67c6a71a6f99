"""The kernels' build cache is keyed on the kernel source: two checkouts with different
sources get different extension names and build folders, checkouts with the same source
share one, and the loader compiles a copy staged in that folder. Nothing here compiles
(the build itself is replaced by a recorder)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from moelab.maps import _kernels

ARGS = (["-O3"], "flags : fpu sse2 avx2", "2.13.0\n/venv/lib/python3.11/site-packages/torch")


def _checkouts(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Three copies of the kernel source: a, b (one line changed) and c (same as a)."""
    paths = []
    for name in ("a", "b", "c"):
        dst = tmp_path / name / "csrc" / "maps_cpu.cpp"
        dst.parent.mkdir(parents=True)
        shutil.copyfile(_kernels._SOURCE, dst)
        paths.append(dst)
    paths[1].write_bytes(paths[1].read_bytes() + b"\n// edited in checkout b\n")
    return paths[0], paths[1], paths[2]


def test_extension_name_is_keyed_on_the_source(tmp_path: Path) -> None:
    a, b, c = _checkouts(tmp_path)
    name_a, name_b, name_c = (_kernels.extension_name(p.read_bytes(), *ARGS) for p in (a, b, c))
    assert name_a == name_c
    assert name_a != name_b
    assert re.fullmatch(r"moelab_maps_cpu_[0-9a-f]{16}", name_a)


def test_extension_name_is_keyed_on_flags_cpu_and_environment() -> None:
    source = _kernels._SOURCE.read_bytes()
    flags, cpu, env = ARGS
    base = _kernels.extension_name(source, flags, cpu, env)
    assert _kernels.extension_name(source, flags, cpu, env) == base
    assert _kernels.extension_name(source, ["-O2"], cpu, env) != base
    assert _kernels.extension_name(source, flags, cpu + " avx512f", env) != base
    # another torch version, or another virtual environment's torch
    assert _kernels.extension_name(source, flags, cpu, env.replace("2.13.0", "2.14.0")) != base
    assert _kernels.extension_name(source, flags, cpu, env.replace("/venv", "/venv2")) != base
    # the parts are delimited: moving bytes from one part to the next changes the name
    assert _kernels.extension_name(b"ab", ["c"], "", "") != _kernels.extension_name(
        b"a", ["bc"], "", ""
    )


def test_checkouts_get_their_own_build_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b, c = _checkouts(tmp_path)
    folders = [
        cpp_extension._get_build_directory(
            _kernels.extension_name(p.read_bytes(), *ARGS), verbose=False
        )
        for p in (a, b, c)
    ]
    assert folders[0] == folders[2]
    assert folders[0] != folders[1]


class _Recorder:
    """Stands in for cpp_extension.load: records its arguments, 'builds' the .so."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, name: str, sources: list[str], build_directory: str, **kw) -> None:
        self.calls.append(dict(name=name, sources=sources, build_directory=build_directory))
        (Path(build_directory) / f"{name}.so").write_bytes(b"")


def _load_from(source: Path, monkeypatch: pytest.MonkeyPatch, recorder: _Recorder) -> dict:
    monkeypatch.setattr(_kernels, "_SOURCE", source)
    monkeypatch.setitem(_kernels._state, "loaded", None)
    monkeypatch.setattr(_kernels, "_register_opaque", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", recorder)
    assert _kernels._load() is True
    return recorder.calls[-1]


def test_loader_builds_a_staged_copy_per_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the loader prepends ninja's folder
    monkeypatch.setenv("MOELAB_KERNELS", "1")
    a, b, c = _checkouts(tmp_path)
    rec = _Recorder()

    call_a = _load_from(a, monkeypatch, rec)
    assert "compiling the CPU kernels" in capsys.readouterr().err
    want = _kernels.extension_name(
        a.read_bytes(), _kernels.cflags(), _kernels._cpu_flags(), _kernels._environment()
    )
    assert call_a["name"] == want
    build = Path(call_a["build_directory"])
    assert build == tmp_path / "ext" / want  # TORCH_EXTENSIONS_DIR/<name>
    (staged,) = call_a["sources"]
    assert Path(staged).parent == build and Path(staged).read_bytes() == a.read_bytes()

    call_b = _load_from(b, monkeypatch, rec)
    assert "compiling the CPU kernels" in capsys.readouterr().err
    assert call_b["name"] != call_a["name"]
    assert call_b["build_directory"] != call_a["build_directory"]
    assert Path(call_b["sources"][0]).read_bytes() == b.read_bytes()

    # checkout c has a's source: a's build folder and staged file, already built
    call_c = _load_from(c, monkeypatch, rec)
    assert "compiling" not in capsys.readouterr().err
    assert call_c == call_a
    assert Path(staged).read_bytes() == a.read_bytes()
