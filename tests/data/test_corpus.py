from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from moelab.data import corpus
from moelab.data.corpus import load_corpus, rst_to_text

FIXTURE = r"""
.. _tut-shutil:

:mod:`shutil` --- High-level file operations
============================================

.. module:: shutil
   :synopsis: High-level file operations, including copying.

.. sectionauthor:: Fred L. Drake, Jr. <fdrake@acm.org>
.. this is a comment about the module

**Source code:** :source:`Lib/shutil.py`

.. index::
   single: file; copying

--------------

The :mod:`shutil` module offers *high-level* operations on **files**. Use
:func:`os.path.join` and :class:`~collections.abc.Mapping`, see :ref:`the tutorial
<tut-files>` and `the website <https://www.python.org/>`_ for more [#]_.

.. toctree::
   :maxdepth: 2

   intro.rst

Copy a file like this::

   shutil.copyfile("src", "dst")
   import os
Then a new paragraph.

.. function:: copyfile(src, dst, *, follow_symlinks=True)
              copyfile(src, dst)

   Copy the contents of the file named *src* to a file named ``dst``.

   .. versionchanged:: 3.3
      Added *follow_symlinks* argument.

   .. note::
      Special files cannot be copied::

         os.mkfifo("pipe")

.. code-block:: python

   def spam():
       return "eggs"

   >>> spam()
   'eggs'

>>> 2 + 2
4

:param src: the source path
:returns: nothing at all

+-----------+------------------+
| Operation | Result           |
+===========+==================+
| ``x|y``   | union of sets    |
+-----------+------------------+

=====  ===========
Code   Meaning
=====  ===========
``a``  first value
``b``  second value
=====  ===========

Sub-section title
~~~~~~~~~~~~~~~~~



Another paragraph with ``literal *not emphasis*`` text and :pep:`8`.

.. [#] A footnote with prose.
"""


def test_rst_to_text_keeps_prose_and_drops_markup() -> None:
    text = rst_to_text(FIXTURE)
    lines = text.split("\n")
    assert not any(line.startswith("..") for line in lines)
    assert not any(line.rstrip().endswith("::") for line in lines)
    assert not re.search(r":[a-z]+(:[a-z]+)?:`", text)
    for markup in ("``", "**", "`_", "+---", "=====", "~~~~", "----", ":param", ":maxdepth:"):
        assert markup not in text, markup
    for code in ("copyfile(", "def spam", "eggs", ">>>", "2 + 2", "mkfifo", "import os"):
        assert code not in text, code
    for dropped in ("synopsis", "Drake", "comment about", "single: file", "intro.rst"):
        assert dropped not in text, dropped
    for table in ("Operation", "union of sets", "first value"):
        assert table not in text, table
    assert "shutil --- High-level file operations" in text
    assert "The shutil module offers high-level operations on files. Use" in text
    assert "os.path.join and Mapping, see the tutorial" in text
    assert "the website for more." in text
    assert "Copy a file like this:\n\nThen a new paragraph." in text
    assert "Copy the contents of the file named src to a file named dst." in text
    assert "Changed in version 3.3: Added follow_symlinks argument." in text
    assert "Special files cannot be copied:" in text
    assert "Sub-section title" in text
    assert "literal *not emphasis* text and PEP 8." in text
    assert "A footnote with prose." in text
    assert "\n\n\n" not in text and text == text.strip()


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        (":class:`~foo.Bar`", "Bar"),
        (":ref:`text <label>`", "text"),
        (":c:func:`PyObject_New`", "PyObject_New"),
        (":meth:`!str.join`", "str.join"),
        ("``a * b``", "a * b"),
        ("`link text <https://x.org>`__", "link text"),
        ("a * b * c", "a * b * c"),
        (r"\*args", "*args"),
        (":samp:`print({x})`", "print(x)"),
    ],
)
def test_inline_roles(src: str, expected: str) -> None:
    assert rst_to_text(src) == expected


def test_folder_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("# Two\n\nmarkdown *kept*\n")
    (tmp_path / "a.txt").write_text("plain text\r\n")
    (tmp_path / "c.rst").write_text("Title\n=====\n\nSee :func:`f`.\n")
    (tmp_path / "skip.py").write_text("print(1)\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    assert load_corpus(tmp_path) == ["plain text", "# Two\n\nmarkdown *kept*", "Title\n\nSee f."]
    assert load_corpus(tmp_path / "a.txt") == ["plain text"]


def test_missing_sources_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    monkeypatch.setattr(corpus, "DEFAULT_CORPUS_DIR", tmp_path / "not-installed")
    with pytest.raises(FileNotFoundError) as info:
        load_corpus(None)
    message = str(info.value)
    assert "apt-get install python3-doc" in message
    assert "make demo" in message
    assert "load_corpus('path/to/folder')" in message


@pytest.mark.skipif(not corpus.DEFAULT_CORPUS_DIR.is_dir(), reason="python3-doc not installed")
def test_default_corpus_is_prose() -> None:
    docs = corpus.iter_documents(None)
    first = [next(docs) for _ in range(20)]
    assert all(isinstance(d, str) and d for d in first)
    text = "\n".join(first)
    assert "Python" in text
    assert not re.search(r"^\.\. |:[a-z]+:`|``", text, re.M)


def _hf_folder(tmp_path: Path) -> Path:
    (tmp_path / "dataset_info.json").write_text("{}")
    return tmp_path


def test_hf_dataset_with_fake_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeDataset:
        column_names = ("id", "text")

        def __getitem__(self, key: str) -> list:
            return {"id": [0, 1, 2], "text": ["first doc", "  ", "second doc"]}[key]

    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda path: {"train": FakeDataset()}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    folder = _hf_folder(tmp_path)
    assert load_corpus(folder) == ["first doc", "second doc"]
    with pytest.raises(ValueError, match="columns are"):
        load_corpus(folder, text_column="body")
    with pytest.raises(ValueError, match="splits"):
        load_corpus(folder, split="test")


def test_hf_dataset_without_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        load_corpus(_hf_folder(tmp_path))


def _mixed_folder(tmp_path: Path) -> Path:
    """One UTF-8 file and three that are not text: Latin-1, UTF-16 and binary."""
    (tmp_path / "good.txt").write_text("caf\u00e9 au lait", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (tmp_path / "utf16.md").write_bytes("wide text".encode("utf-16"))
    (tmp_path / "image.rst").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    return tmp_path


def test_non_utf8_files_are_skipped_with_a_count(tmp_path: Path) -> None:
    folder = _mixed_folder(tmp_path)
    with pytest.warns(corpus.CorpusWarning, match=r"skipped 3 of 4 files") as record:
        docs = load_corpus(folder)
    assert docs == ["caf\u00e9 au lait"]
    assert not any("\ufffd" in d for d in docs)
    message = str(record[0].message)
    assert all(name in message for name in ("image.rst", "latin1.txt", "utf16.md"))


def test_utf8_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "bom.txt").write_bytes("\ufeffsome text".encode())
    assert load_corpus(tmp_path) == ["some text"]


def test_a_named_file_that_is_not_utf8_is_an_error(tmp_path: Path) -> None:
    folder = _mixed_folder(tmp_path)
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text"):
        load_corpus(folder / "latin1.txt")
    with pytest.raises(ValueError, match="NUL"):
        load_corpus(folder / "image.rst")


def test_a_folder_without_any_utf8_file_is_an_error(tmp_path: Path) -> None:
    folder = _mixed_folder(tmp_path)
    (folder / "good.txt").unlink()
    with pytest.raises(ValueError, match="none of the 3 text files"):
        load_corpus(folder)


def test_empty_source_is_an_error_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here.txt").write_text("a file in the current directory")
    monkeypatch.chdir(tmp_path)
    for source in ("", "  "):
        with pytest.raises(ValueError, match="empty string"):
            load_corpus(source)
