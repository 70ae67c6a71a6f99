"""Documents for training: the Python documentation, a folder of text files, or a saved
Hugging Face dataset.

The default corpus is the reStructuredText source of the Python documentation that
Debian's ``python3-doc`` package installs under ``/usr/share/doc/python3/html/_sources``
(about 500 files, 10 MB): English technical prose, available offline, licensed for reuse.
:func:`rst_to_text` strips the markup so that the model learns prose, not reST syntax.

    docs = load_corpus(None)                 # the default corpus (one str per source file)
    docs = load_corpus("my/folder")          # every .txt / .md / .rst file below a folder
    docs = load_corpus("book.txt")           # one file: its paragraphs (blank-line separated)
    docs = load_corpus("saved_dataset")      # datasets.Dataset.save_to_disk output

Files are read as UTF-8 (a leading byte-order mark is dropped). A file in a folder
that is not UTF-8 text (a binary file, or text in another encoding such as Latin-1 or
UTF-16) is skipped, and a :class:`CorpusWarning` counts the skipped files and names the
first ones; a single file given as the source must be UTF-8 text (else ``ValueError``).

A folder holds one document per file; a single file given as the source is split into
documents at blank lines (:func:`paragraphs`), so that one file of text can be trained
on (training holds whole documents out for validation and needs at least two).
Commands show it as one line (:func:`corpus_warnings_as_lines`), not as Python prints a
warning (with the file, line and source line that raised it).
"""

from __future__ import annotations

import contextlib
import re
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

DEFAULT_CORPUS_DIR = Path("/usr/share/doc/python3/html/_sources")
TEXT_SUFFIXES = (".txt", ".md", ".rst")

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "CorpusWarning",
    "check_trainable_file",
    "corpus_warnings_as_lines",
    "iter_documents",
    "load_corpus",
    "paragraphs",
    "rst_to_text",
]


# --------------------------------------------------------------------------- loading


class CorpusWarning(UserWarning):
    """Files of a corpus folder were skipped (not UTF-8 text)."""


@contextlib.contextmanager
def corpus_warnings_as_lines(say: Callable[[str], None]) -> Iterator[None]:
    """Within ``with``: each :class:`CorpusWarning` goes to ``say`` as one line,
    ``"warning: <message>"``, once per distinct message (a corpus read twice warns
    once), instead of Python's display of a warning; other warnings are shown as
    usual."""
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("always", CorpusWarning)
        shown = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if not issubclass(category, CorpusWarning):
                shown(message, category, filename, lineno, file, line)
            elif str(message) not in seen:
                seen.add(str(message))
                say(f"warning: {message}")

        warnings.showwarning = show
        yield


class _NotText(ValueError):
    """A file that is not UTF-8 text."""


def load_corpus(
    source: str | Path | None = None, *, text_column: str = "text", split: str | None = None
) -> list[str]:
    """All documents of ``source`` as a list; see :func:`iter_documents` for the sources
    and errors. Files of a folder that are not UTF-8 text (binary files, Latin-1, UTF-16)
    are skipped, with one :class:`CorpusWarning` that counts them; ``""`` is an error."""
    return list(iter_documents(source, text_column=text_column, split=split))


def iter_documents(
    source: str | Path | None = None, *, text_column: str = "text", split: str | None = None
) -> Iterator[str]:
    """Iterate the documents (non-empty strings) of a corpus, in a fixed order.

    ``source`` is
      * ``None``: the default corpus, the Python documentation of ``python3-doc``;
      * a folder of text files: every ``.txt``/``.md``/``.rst`` file below it, sorted by
        relative path, one document per file; reST files (``.rst``, ``.rst.txt``) are
        converted to prose with :func:`rst_to_text`, the others are read as they are;
      * a single such file: a corpus of its own, whose documents are its paragraphs
        (:func:`paragraphs`: split at blank lines), so that one file can be trained on,
        with some of its paragraphs held out for validation;
      * a folder written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict``; then
        ``split``, default ``"train"``), one document per row of ``text_column``.

    Files are decoded as UTF-8 (a byte-order mark is dropped). In a folder, a file that
    is not UTF-8 text (binary: it holds a NUL byte or invalid UTF-8, e.g. Latin-1 or
    UTF-16 text) is skipped, never read as replacement characters; once the folder is
    read, one :class:`CorpusWarning` counts the skipped files and names the first ones.

    Raises (at call time, not at the first item): :class:`FileNotFoundError` for a
    missing source or a folder without text files; ``ValueError`` for an empty string
    (``Path("")`` would be the current directory) or a single file that is not UTF-8
    text. A folder whose every text file was skipped raises ``ValueError`` at the end of
    the iteration.
    """
    if isinstance(source, str) and not source.strip():
        raise ValueError(
            "the corpus source is an empty string; give a folder or file (or None for the "
            "default corpus, the Python documentation)"
        )
    if source is None:
        root = DEFAULT_CORPUS_DIR
        if not root.is_dir():
            raise FileNotFoundError(
                f"the default corpus (the Python documentation sources) is not installed: "
                f"{root} does not exist. Install it with `apt-get install python3-doc` "
                f"(as root; `make demo` installs it), or point to another corpus: a folder of "
                f".txt/.md/.rst files or a `datasets` folder saved with save_to_disk, e.g. "
                f"load_corpus('path/to/folder')."
            )
        return _iter_folder(root)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"corpus source {str(path)!r} does not exist; give a folder of .txt/.md/.rst "
            f"files, one such file, or a `datasets` folder saved with save_to_disk "
            f"(or None for the Python documentation: `apt-get install python3-doc`)."
        )
    if path.is_file():
        try:
            doc = _read_document(path)
        except _NotText as err:
            raise ValueError(f"{path} is not UTF-8 text ({err}); convert it to UTF-8") from None
        return iter(paragraphs(doc))
    if _is_hf_dataset(path):
        return _iter_hf_dataset(path, text_column, split)
    return _iter_folder(path)


_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def paragraphs(text: str) -> list[str]:
    """The documents of a single corpus file: its paragraphs, the runs of lines between
    blank lines (lines empty or holding spaces and tabs only), each stripped; none
    empty. ``"a\nb\n\nc"`` gives ``["a\nb", "c"]``."""
    return [p.strip() for p in _BLANK_LINE.split(text) if p.strip()]


def check_trainable_file(source: str | Path | None, text: bool = False) -> None:
    """ValueError, saying how to split it, when ``source`` is a single text file (a
    .txt/.md/.rst file, or any file with ``text``) of fewer than two paragraphs: training
    holds whole documents out for validation and needs at least two (a folder or another
    source is left to the usual checks)."""
    if source is None or not str(source).strip() or not Path(source).is_file():
        return
    if not text and not Path(source).name.lower().endswith(TEXT_SUFFIXES):
        return
    n = sum(1 for _ in iter_documents(source))
    if n < 2:
        raise ValueError(
            f"{source} holds {n} paragraph(s), and training needs at least 2 documents (it "
            "holds whole ones out for validation): a single file is split into documents "
            "at blank lines, so separate its parts with blank lines, or give a folder of "
            "files (one document each)"
        )


def _iter_folder(root: Path) -> Iterator[str]:
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(TEXT_SUFFIXES)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(f"no .txt/.md/.rst files under {root}")
    return _read_files(root, files)


def _read_files(root: Path, files: list[Path]) -> Iterator[str]:
    skipped: list[str] = []
    for p in files:
        try:
            doc = _read_document(p)
        except _NotText:
            skipped.append(p.relative_to(root).as_posix())
            continue
        if doc:
            yield doc
    if skipped:
        first = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        if len(skipped) == len(files):
            raise ValueError(
                f"none of the {len(files)} text files under {root} is UTF-8 text "
                f"(e.g. {first}); convert them to UTF-8"
            )
        warnings.warn(
            f"skipped {len(skipped)} of {len(files)} files under {root} that are not UTF-8 "
            f"text (binary or another encoding): {first}",
            CorpusWarning,
            stacklevel=2,
        )


def _read_document(path: Path) -> str:
    """The document of one file; raises _NotText unless it is UTF-8 text."""
    raw = path.read_bytes()
    if b"\x00" in raw:  # UTF-16 text or a binary file: a NUL byte is never text
        raise _NotText("it holds NUL bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _NotText(f"invalid UTF-8 at byte {err.start}") from None
    name = path.name.lower()
    if name.endswith((".rst", ".rst.txt")):
        return rst_to_text(text)
    return text.replace("\r\n", "\n").strip()


def _is_hf_dataset(path: Path) -> bool:
    return any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))


def _iter_hf_dataset(path: Path, text_column: str, split: str | None) -> Iterator[str]:
    try:
        import datasets  # optional: only this source needs it
    except ImportError as e:
        raise ImportError(
            f"{path} is a Hugging Face `datasets` folder; reading it needs the datasets "
            f"package: pip install datasets"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):  # DatasetDict
        names = list(ds.keys())
        key = split or "train"
        if key not in names:
            raise ValueError(f"{path} has splits {names}; choose one with split=...")
        ds = ds[key]
    if text_column not in ds.column_names:
        raise ValueError(
            f"{path} has no column {text_column!r}; its columns are {list(ds.column_names)} "
            f"(choose one with text_column=...)"
        )
    return (t for t in ds[text_column] if isinstance(t, str) and t.strip())


# --------------------------------------------------------------------- reST -> prose

# Directives whose whole block (arguments, options and content) is code, data or markup.
_SKIP_DIRECTIVES = frozenset(
    """code-block code sourcecode testcode testsetup testcleanup testoutput doctest
    productionlist literalinclude include toctree index highlight tabularcolumns list-table
    csv-table table math raw image figure graphviz digraph autosummary automodule
    sectionauthor moduleauthor codeauthor currentmodule program audit-event
    audit-event-table literal-block parsed-literal""".split()
)
# Directives whose argument is text (an admonition or a title): keep it as a paragraph.
_TEXT_ARG_DIRECTIVES = frozenset(
    """note warning seealso tip important caution attention hint danger error admonition
    impl-detail topic sidebar rubric""".split()
)
# Sphinx renders these with a label; keep the label so the prose reads as in the HTML.
_VERSION_LABELS = {
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}:",
}

_DIRECTIVE = re.compile(r"^\.\.\s+([A-Za-z][\w:+.-]*)::(?:\s+(.*))?$")
_EXPLICIT = re.compile(r"^\.\.(?:\s|$)")
_FOOTNOTE = re.compile(r"^\.\.\s+\[(?:#[\w-]*|\d+|\*|[\w.-]+)\](?:\s+(.*))?$")
_FIELD = re.compile(r"^:(?:[^:`\s]|\\:)(?:[^:`]|\\:)*:(?:\s|$)")
_ADORNMENT = re.compile(r"""^([=\-~^*#"'`+_:.<>])\1{2,}\s*$""")
_GRID_RULE = re.compile(r"^\+(?:[-=]+\+)+\s*$")
_SIMPLE_RULE = re.compile(r"^=+(?:\s+=+)+\s*$")
_SIMPLE_INNER_RULE = re.compile(r"^[=-]+(?:\s+[=-]+)*\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_end(lines: list[str], i: int, ind: int) -> int:
    """Index after the block of lines from ``i`` on that are blank or indented > ``ind``."""
    n = len(lines)
    while i < n and (not lines[i].strip() or _indent(lines[i]) > ind):
        i += 1
    return i


def _dedented(lines: list[str]) -> list[str]:
    return textwrap.dedent("\n".join(lines)).split("\n")


def _blocks(lines: list[str]) -> list[str]:
    """Block-level pass: keep prose lines (unindented), drop markup blocks; "" separates."""
    out: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        s = line.strip()
        ind = _indent(line)
        if not s:
            out.append("")
            i += 1
            continue

        if _EXPLICIT.match(s):  # directive, comment, target, footnote, substitution
            end = _block_end(lines, i + 1, ind)
            if s == ".." and (i + 1 >= n or not lines[i + 1].strip()):
                end = i + 1  # an empty comment consumes nothing after it
            out.extend(["", *_explicit_block(s, lines[i + 1 : end]), ""])
            i = end
            continue

        if s.startswith("__ ") or s == "__":  # anonymous hyperlink target
            i = _block_end(lines, i + 1, ind)
            continue

        if s.startswith(">>>"):  # doctest block: runs to the next blank line
            while i < n and lines[i].strip():
                i += 1
            out.append("")
            continue

        if _GRID_RULE.match(s):  # grid table: rules and | rows
            while i < n and lines[i].strip()[:1] in ("+", "|"):
                i += 1
            continue

        if _SIMPLE_RULE.match(s):  # simple table: ends at a rule followed by a blank line
            j = i + 1
            while j < n:
                if _SIMPLE_INNER_RULE.match(lines[j].strip()) and (
                    j + 1 >= n or not lines[j + 1].strip()
                ):
                    break
                j += 1
            i = j + 1
            continue

        if _ADORNMENT.match(s):  # section underline / overline, transition
            i += 1
            continue

        if _FIELD.match(s):  # field list item with its indented body
            i = _block_end(lines, i + 1, ind)
            continue

        if s.endswith("::"):  # paragraph introducing a literal block
            head = s[:-2]
            if head and not head[-1].isspace():
                out.append(head + ":")
            elif head.strip():
                out.append(head.rstrip())
            i += 1
            if i >= n or not lines[i].strip():  # the literal block is the indented block
                i = _block_end(lines, i, ind)
            out.append("")  # the paragraph after the code is a new one
            continue

        out.append(s[2:] if s.startswith("| ") else s)  # a line block drops its bar
        i += 1
    return out


def _explicit_block(first: str, rest: list[str]) -> list[str]:
    """Prose kept from one explicit-markup block (``.. ...`` line + indented lines)."""
    if m := _FOOTNOTE.match(first):
        return _blocks([m.group(1) or "", *_dedented(rest)])
    m = _DIRECTIVE.match(first)
    if m is None:  # comment, ``.. _label:`` target or ``.. |name| ...`` substitution
        return []
    name, arg = m.group(1).lower(), (m.group(2) or "").strip()
    if name in _SKIP_DIRECTIVES:
        return []
    if name in _VERSION_LABELS or name in _TEXT_ARG_DIRECTIVES or name == "availability":
        # The lines right after the directive line continue its text argument (or are
        # its content); only leading :options: are markup.
        k = 0
        while k < len(rest) and _FIELD.match(rest[k].strip()):
            k += 1
        content = _blocks(_dedented(rest[k:]))
        if name in _VERSION_LABELS:
            n_versions = 2 if name == "deprecated-removed" else 1
            parts = arg.split(None, n_versions)
            versions = [*parts, "?", "?"][:n_versions]
            label = _VERSION_LABELS[name].format(*versions)
            text = " ".join(parts[n_versions:])
            if not text and not any(content):
                return [label.rstrip(":.") + "."]
            if not text and content and content[0]:  # label and text on one line
                text, content = content[0], content[1:]
            head = f"{label} {text}"
        elif name == "availability":
            head = f"Availability: {arg}"
        else:
            head = arg
        return [head, *content] if head else content
    # Header = lines up to the first blank line: signature continuation and :options:.
    h = 0
    while h < len(rest) and rest[h].strip():
        h += 1
    body = _dedented(rest[h:])
    # Any other directive (function, class, method, data, only, ...): the signature or
    # condition is dropped and the content, which is documentation prose, is kept.
    return _blocks(body)


# Inline markup. Literals and roles are swapped for placeholders first, so that the
# emphasis and escape rules never look inside them.
_LITERAL = re.compile(r"(?<!\\)``(?=\S)(.+?)(?<=\S)``(?!`)", re.S)
_ROLE = re.compile(r":([A-Za-z][\w.+-]*(?::[A-Za-z][\w.+-]*)*):`((?:[^`\\]|\\.)+)`", re.S)
_TITLED = re.compile(r"^(.*\S)\s*<([^<>]+)>$", re.S)
_LINK = re.compile(r"(?<![\w`])`([^`]+?)`(__?)?(?![\w`])", re.S)
_FOOTREF = re.compile(r"\s?\[(?:#[\w-]*|\d+|\*|[A-Za-z][\w.-]*)\]_(?!\w)")
_SUBST = re.compile(r"\|([\w][\w .-]*?)\|(?:__?)?(?!\w)")
_STRONG = re.compile(r"(?<![\w\\*])\*\*(?=\S)(.+?)(?<=[^\s\\])\*\*(?![\w*])", re.S)
_EMPH = re.compile(r"(?<![\w\\*])\*(?=[^\s*])(.+?)(?<=[^\s\\*])\*(?![\w*])", re.S)
_ESCAPE = re.compile(r"\\(.)", re.S)
_PLACEHOLDER = re.compile("\x00(\\d+)\x00")


def _role_text(role: str, body: str) -> str:
    body = re.sub(r"\\(.)", r"\1", " ".join(body.split()))
    if m := _TITLED.match(body):
        return m.group(1)
    role = role.rsplit(":", 1)[-1].lower()
    if role in ("pep", "rfc"):
        return f"{role.upper()} {body.split('#')[0]}"
    if role == "samp":
        return body.replace("{", "").replace("}", "")
    body = body.lstrip("!")
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return body


def _inline(text: str) -> str:
    saved: list[str] = []

    def keep(value: str) -> str:
        saved.append(value)
        return f"\x00{len(saved) - 1}\x00"

    text = text.replace("\x00", "")
    text = _LITERAL.sub(lambda m: keep(" ".join(m.group(1).split())), text)
    text = _ROLE.sub(lambda m: keep(_role_text(m.group(1), m.group(2))), text)

    def link(m: re.Match[str]) -> str:
        body = " ".join(m.group(1).split())
        if t := _TITLED.match(body):
            return keep(t.group(1))
        return keep(body.strip("<>"))

    text = _LINK.sub(link, text)
    text = _FOOTREF.sub("", text)
    text = _SUBST.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    text = text.replace("\\ ", "")
    text = _ESCAPE.sub(r"\1", text)
    while _PLACEHOLDER.search(text):  # a link title may hold a literal
        text = _PLACEHOLDER.sub(lambda m: saved[int(m.group(1))], text)
    return text


def rst_to_text(src: str) -> str:
    """Strip reStructuredText markup, keeping the prose.

    Dropped: directive lines and their options, the content of code/table/index
    directives, literal blocks (after ``::``) and doctest blocks, section adornments,
    grid and simple tables, comments, targets, substitution definitions, field lists.
    Kept: paragraphs, titles, list items and the content of prose directives (notes,
    function descriptions, ...). Inline roles become their text (``:class:`~a.B``` -> B,
    ``:ref:`text <label>``` -> text), ````literals```` their content, emphasis its words and
    ```text <url>`_`` its text. Paragraphs are separated by one blank line.
    """
    lines = src.replace("\r\n", "\n").replace("\r", "\n").expandtabs(8).split("\n")
    paragraphs: list[str] = []
    current: list[str] = []
    for line in [*_blocks([x.rstrip() for x in lines]), ""]:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(_inline("\n".join(current)).strip())
            current = []
    return "\n\n".join(p for p in paragraphs if p)
