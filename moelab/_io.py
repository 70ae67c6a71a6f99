"""The one way moelab writes a file: :func:`write_atomic` (a temporary in the same folder,
fsynced, then renamed over the target, so that a reader, a kill or a full disk never
leaves half a file) and, for a JSON document, :func:`write_json` with the bytes of
:func:`json_bytes` (strict JSON, RFC 8259: see :mod:`moelab._strict_json`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from moelab._strict_json import strict_dumps

__all__ = ["file_mode", "json_bytes", "named", "usual_mode", "write_atomic", "write_json"]


def file_mode() -> int:
    """The mode a new file gets from ``open()``: 0o666 less the process's umask (0o644
    under the usual umask 022)."""
    mask = os.umask(0o022)  # NOTE: the only way to read the umask is to set it
    os.umask(mask)
    return 0o666 & ~mask


def usual_mode(path: str | Path) -> None:
    """Give the file ``path`` the mode of a file ``open()`` makes (:func:`file_mode`):
    for a file that a writer made through a private temporary (``tempfile.mkstemp`` and
    safetensors' ``save_file`` create theirs 0600, readable by the owner only)."""
    os.chmod(path, file_mode())


def named(err: OSError, path: str | Path) -> OSError:
    """``err`` with ``path`` as its file name when it names none (a failed write or
    close: "No space left on device" alone says not where), else ``err`` itself."""
    if err.filename is not None or isinstance(err, BrokenPipeError):
        return err
    return OSError(err.errno, err.strerror or str(err), str(path))


def write_file(f: Any, data: bytes) -> None:
    """The one place bytes reach a file (tests replace it to simulate a full disk)."""
    f.write(data)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary in the same folder: write, flush, fsync,
    then ``os.replace`` (atomic on POSIX), so readers never see half a file.

    On any failure (a full disk, a signal) the temporary is removed and ``path`` is left
    as it was; an OSError is raised again with ``path`` as its filename (the system's
    message alone names no file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_file(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and err.filename in (None, str(tmp)):
            # the target's name, not the temporary's (which is gone)
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise


def json_bytes(obj: Any, indent: int | None = 2) -> bytes:
    """``obj`` as one strict JSON document and a newline, UTF-8: a NaN or infinity
    becomes null (:func:`moelab._strict_json.strict_dumps`)."""
    return (strict_dumps(obj, indent) + "\n").encode()


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` to ``path`` as strict JSON (:func:`json_bytes`) with
    :func:`write_atomic`."""
    write_atomic(Path(path), json_bytes(obj, indent))
