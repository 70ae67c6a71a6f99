"""What an output folder holds, and whether ``moelab report`` or ``moelab study`` may write
into it.

    folder = inspect_folder("studies/sparse-maps-cpu")
    folder.kinds          # ("study",): a folder moelab made, and of what kind
    check_out(path, "report", overwrite=False)   # FileExistsError unless it may write there

Both commands write into a folder only when it

- does not exist, or is empty (dot files aside: they are temporaries and markers);
- was made by the same command: a report's folder for ``report`` (it refreshes the
  report), the same study's folder for ``study`` (it reuses and resumes its arms);
- was made by another moelab command and ``overwrite`` is given (a report's, a study's
  or a run's folder; a study never writes into a run folder).

A folder holding anything moelab does not write there (a user's ``thesis.tex``, a
corpus, the prepared data of ``moelab data prepare``) is refused even with
``overwrite``.

Each command marks the folder it makes with a small JSON file, written before anything
else: ``.moelab-report.json`` (``{"made_by": "moelab report", "moelab": VERSION, "runs":
[...], "files": [the files of the newest report]}``) and ``.moelab-study.json``
(``{"made_by": "moelab study", "moelab": VERSION, "study": NAME, "scale": SCALE}``).
Folders made before the markers existed are recognised by what they hold: a report.md
that starts with ``# moelab report``; a study's ``results.json``, ``paper/commands.sh``,
report.md starting with ``# Study:`` or ``runs/ARM/seedS`` run folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab._io import write_atomic, write_json
from moelab.runs.layout import CONFIG, RUN_ENTRIES

__all__ = [
    "REPORT_MARKER",
    "STUDY_MARKER",
    "Folder",
    "Staging",
    "atomic_write_text",
    "check_out",
    "inspect_folder",
    "read_marker",
    "write_marker",
]

REPORT_MARKER = ".moelab-report.json"
STUDY_MARKER = ".moelab-study.json"
_MARKERS = {"report": REPORT_MARKER, "study": STUDY_MARKER}
STAGING_PREFIX = ".moelab-staging-"
"""The temporary folder inside OUT where a report's new files are built (see Staging)."""

_REPORT_ENTRIES = frozenset({"report.md", "tables.tex"})
_STUDY_ENTRIES = frozenset(
    {"runs", "paper", "report.md", "tables.tex", "results.json", "seeds_auto.json"}
)
_PREPARED = "prepare.json"  # moelab.data.prepare.MANIFEST
_CORPUS_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".jsonl.gz", ".parquet", ".arrow")
"""Files a corpus reads (moelab.data: text files, JSON lines, parquet and arrow)."""


def _first_line(path: Path) -> str:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _names(path: Path) -> list[str]:
    """The entries of ``path`` a user sees: dot files left out."""
    return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))


def read_marker(path: str | Path, command: str) -> dict[str, Any] | None:
    """The marker ``command`` ("report" or "study") left in ``path``, or None."""
    doc = _json(Path(path) / _MARKERS[command])
    return doc if isinstance(doc, dict) else None


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with moelab._io.write_atomic (temporary, fsync,
    rename; the temporary removed and the file named on failure), so that a crash leaves
    either the old file or the new one, whole."""
    write_atomic(Path(path), text.encode("utf-8"))


def write_marker(path: str | Path, command: str, **fields: Any) -> None:
    """Mark ``path`` (created if missing) as made by ``moelab COMMAND``."""
    from moelab import __version__

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    doc = {"made_by": f"moelab {command}", "moelab": __version__, **fields}
    write_json(path / _MARKERS[command], doc, indent=1)


def _is_seed_runs(runs: Path) -> bool:
    """``runs`` is laid out as a study's: ARM/seedS folders, at least one a run."""
    found = False
    for arm in runs.iterdir():
        if arm.name.startswith("."):
            continue
        if not arm.is_dir():
            return False
        for seed in arm.iterdir():
            if seed.name.startswith("."):
                continue
            if not (seed.is_dir() and re.fullmatch(r"seed\d+", seed.name)):
                return False
            found = found or (seed / CONFIG).is_file()
    return found


@dataclass(frozen=True)
class Folder:
    """What a folder holds. ``kinds``: the moelab outputs found in it ("run", "study",
    "report", "data": a ``moelab data prepare`` folder); ``study``: the study's name
    where it says; ``foreign``: the entries no moelab command writes there (dot files
    aside; ``name/`` for a folder); ``nested``: subfolders that are moelab outputs of
    their own (a report folder inside a study's, run folders)."""

    path: Path
    exists: bool
    empty: bool
    kinds: tuple[str, ...] = ()
    study: str | None = None
    foreign: tuple[str, ...] = ()
    nested: tuple[str, ...] = ()
    corpus: bool = False

    @property
    def made_by_moelab(self) -> bool:
        """Every entry is one a moelab command wrote (and the folder is not prepared data)."""
        return bool(self.kinds) and not self.foreign and "data" not in self.kinds

    def describe(self) -> str:
        """What it holds, as the refusals say it ("a moelab run", ...)."""
        if "data" in self.kinds:
            return f"the prepared data of `moelab data prepare` ({_PREPARED})"
        if self.foreign:
            shown = ", ".join(self.foreign[:4]) + (", ..." if len(self.foreign) > 4 else "")
            if self.corpus:
                what = f"a corpus (files a corpus reads: {shown})"
            elif not self.kinds and all(n.rstrip("/") in self.nested for n in self.foreign):
                what = f"moelab outputs in folders of their own: {shown}"
            else:
                what = f"files moelab did not write: {shown}"
            return what + (f", beside {self._kinds_text()}" if self.kinds else "")
        return self._kinds_text()

    def _kinds_text(self) -> str:
        parts = []
        if "study" in self.kinds:
            parts.append(
                f"the runs and report of the study {self.study}" if self.study else "a study's runs"
            )
        if "run" in self.kinds:
            parts.append("a moelab run")
        if "report" in self.kinds:
            parts.append("a moelab report")
        return ", and ".join(parts)


def inspect_folder(path: str | Path, _nested: bool = True) -> Folder:
    """What ``path`` holds (see :class:`Folder`). Raises NotADirectoryError for a file."""
    path = Path(path)
    if not path.exists():
        return Folder(path, exists=False, empty=True)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a folder; choose a folder")
    names = _names(path)
    if (path / _PREPARED).is_file():
        return Folder(path, True, not names, kinds=("data",))
    kinds: list[str] = []
    allowed: set[str] = set()
    study: str | None = None
    if (path / CONFIG).is_file():
        kinds.append("run")
        allowed |= RUN_ENTRIES
    report_md = _first_line(path / "report.md")
    results = _json(path / "results.json")
    marker = read_marker(path, "study")
    if (
        marker is not None
        or (isinstance(results, dict) and "study" in results and "tables" in results)
        or (path / "paper" / "commands.sh").is_file()
        or report_md.startswith("# Study:")
        or ((path / "runs").is_dir() and _is_seed_runs(path / "runs"))
    ):
        kinds.append("study")
        allowed |= _STUDY_ENTRIES
        if marker is not None:
            study = marker.get("study")
        elif isinstance(results, dict):
            study = results.get("study")
        study = study if isinstance(study, str) else None
    # the marker counts while report.md (once written) is the report's: a study written
    # over a report folder (overwrite) makes it the study's
    if report_md.startswith("# moelab report") or (
        read_marker(path, "report") is not None and not (path / "report.md").exists()
    ):
        kinds.append("report")
        allowed |= _REPORT_ENTRIES
    if "report" in kinds or "study" in kinds:
        allowed |= {n for n in names if n.endswith(".png")}
    nested = []
    if _nested:
        for n in names:
            if n not in allowed and (path / n).is_dir():
                if inspect_folder(path / n, _nested=False).made_by_moelab:
                    nested.append(n)
    foreign = [f"{n}/" if (path / n).is_dir() else n for n in names if n not in allowed]
    if kinds:
        foreign = [n for n in foreign if n.rstrip("/") not in nested]
    corpus_files = [n for n in foreign if n.endswith(_CORPUS_SUFFIXES)]
    corpus = bool(corpus_files) and all(n in corpus_files or n.endswith("/") for n in foreign)
    return Folder(
        path,
        exists=True,
        empty=not names,
        kinds=tuple(kinds),
        study=study,
        foreign=tuple(foreign),
        nested=tuple(nested),
        corpus=corpus,
    )


def check_out(
    path: str | Path, command: str, *, overwrite: bool = False, study: str | None = None
) -> Folder:
    """Whether ``moelab COMMAND`` ("report" or "study"; ``study``: the study's name) may
    write into ``path``: returns what it holds, or raises FileExistsError with one line
    that says what the folder holds and what to do (see the module docstring)."""
    folder = inspect_folder(path)
    if folder.empty:
        return folder
    what = folder.describe()
    where = f"output folder {folder.path}"
    elsewhere = "choose another (new or empty) folder"
    if not folder.made_by_moelab:
        raise FileExistsError(
            f"{where} holds {what}; {elsewhere} (--overwrite writes only over a folder that "
            "moelab made)"
        )
    if command == "study" and "run" in folder.kinds:
        raise FileExistsError(
            f"{where} holds {what}; a study writes its runs under OUT/runs and its report "
            f"beside them, never into a run folder: {elsewhere}"
        )
    own = folder.kinds == (command,) and (
        command != "study" or folder.study is None or folder.study == study
    )
    if own or overwrite:
        return folder
    maker = "`moelab report`" if command == "report" else f"the study {study}"
    whose = (
        f": not {maker}'s alone"
        if command in folder.kinds and (command != "study" or folder.study in (None, study))
        else f", which {maker} did not make"
    )
    raise FileExistsError(
        f"{where} holds {what}{whose}; {elsewhere}, or pass overwrite=True (--overwrite) to "
        f"write the {command}'s files over it"
    )


class Staging:
    """A temporary folder inside ``out`` (``out/.moelab-staging-XXXX``) where new files
    are written first; :meth:`commit` then moves each into ``out`` with a rename, so
    that a crash while they are computed leaves the files already in ``out`` whole.
    Staging folders that a crashed command left behind are removed."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        for old in self.out.glob(f"{STAGING_PREFIX}*"):
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        self.dir = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.out))

    def final(self, path: str | Path) -> Path:
        """Where a staged file lands in ``out`` (other paths unchanged)."""
        path = Path(path)
        return self.out / path.name if path.parent == self.dir else path

    def commit(self, last: Iterable[str] = ()) -> list[str]:
        """Move every staged file into ``out`` (the names in ``last`` after the others,
        in that order); return the names moved."""
        last = [n for n in last if (self.dir / n).is_file()]
        names = sorted(p.name for p in self.dir.iterdir() if p.is_file() and p.name not in last)
        for name in [*names, *last]:
            os.replace(self.dir / name, self.out / name)
        self.discard()
        return [*names, *last]

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def replace_folder(staged: Path, path: Path) -> None:
    """Put the finished ``staged`` folder at ``path``: a rename, or, when ``path`` exists
    (an earlier result, or an empty folder), two renames (the old folder aside under a
    hidden name, the new one in; the old one put back if the second fails) and the old
    one removed. ``path`` is at every moment a whole folder or absent."""
    if not path.exists():
        os.replace(staged, path)
        return
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.replace(path, old)
    try:
        os.replace(staged, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(path: Path, staging_name: str) -> Iterator[Path]:
    """A new, empty folder ``staging_name`` beside ``path`` to build a result in; on a
    clean exit it replaces ``path`` (:func:`replace_folder`), on any exception (a
    Ctrl-C, a full disk, a failed check) it is removed and ``path`` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(staging_name)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    try:
        yield staged
        replace_folder(staged, path)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
