"""Files and the terminal, safely: inputs are read only when they are regular files (a FIFO
with no writer would block forever), outputs are written atomically (a temporary file in the
same directory, then ``os.replace``), no output may name an input or another output, and text
echoed from an input file has its control characters escaped and its length bounded.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import BinaryIO, Iterable, Iterator

from .errors import PoseidonError, file_kind, short_repr

NAME_MAX_CHARS = 200   # cluster, model and device type names
MAX_ECHO_CHARS = 2000  # one warning or note line echoed to the terminal


class NotRegularFile(PoseidonError):
    """An input (or an existing output) that is a FIFO, a device, a directory, ...; ``kind``
    says which, in words."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def open_input(path: str, what: str = "") -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file (symbolic links followed);
    PoseidonError ``"<what> <path>: cannot read (a FIFO (named pipe), not a regular file)"``
    otherwise. Opened non-blocking first, so a FIFO without a writer is refused, not waited on.
    OSError (a missing or unreadable file) propagates: each loader words it."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            name = f"{what} {path}" if what else str(path)
            raise NotRegularFile(f"{name}: cannot read ({file_kind(mode)}, not a regular file)",
                                 file_kind(mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _mode_for(path: str) -> int:
    """The permission bits a new file gets (umask), or those of the file it replaces."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """A temporary path in ``path``'s directory (same suffix) to write; on success it replaces
    ``path`` (``os.replace``: a reader sees the old file or the new one, never a torn one), on
    failure it is removed and ``path`` is left untouched. A symbolic link is followed (its
    target is replaced); an existing non-regular file (``/dev/null``, a FIFO) is refused."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path}: cannot write ({file_kind(mode)}, not a regular file)",
                             file_kind(mode))
    directory = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=".poseidon-", suffix=os.path.splitext(target)[1] or
                               ".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str, text: str | bytes) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (``atomic_output``), synced to disk.
    OSError propagates."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` name one file: the same resolved path, or (both existing) the same
    inode (a hard link, a bind mount)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_distinct(outputs: Iterable[tuple[str, str | None]],
                   inputs: Iterable[tuple[str, str | None]]) -> None:
    """PoseidonError when an output path (``(flag, path)``, None: not given) is an input or
    another output: the plan would overwrite its own input (or one output the other)."""
    outs = [(f, p) for f, p in outputs if p]
    ins = [(f, p) for f, p in inputs if p]
    for i, (flag, path) in enumerate(outs):
        for other, opath in outs[:i]:
            if same_file(path, opath):
                raise PoseidonError(f"{flag} {path}: the same file as {other} {opath}; give "
                                    "each output its own file")
        for other, ipath in ins:
            if same_file(path, ipath):
                raise PoseidonError(f"{flag} {path}: the same file as the input {other} "
                                    f"{ipath}; writing it would overwrite the input")


def escape_controls(text: str) -> str:
    """``text`` with every non-printable character (terminal escapes, newlines, bidi
    controls) written as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def bound_line(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """One line for the terminal: controls escaped, cut to ``limit`` characters with
    ``... (N more characters)``."""
    text = escape_controls(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def bounded_join(items: Iterable[object], sep: str = ",", limit: int = 8) -> str:
    """``sep.join(items)`` of the first ``limit`` items, ``... (N more)`` for the rest."""
    items = [str(x) for x in items]
    if len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + f"{sep}... ({len(items) - limit} more)"


def name_problem(value: object, type_name: bool = False) -> str | None:
    """Why ``value`` is no valid name (None if it is): a non-empty printable string of at most
    ``NAME_MAX_CHARS`` characters; a device type name (``type_name``) also has no white space
    and no comma (it is listed comma-separated and printed in table columns)."""
    if not isinstance(value, str) or not value.strip():
        return "a non-empty string"
    if len(value) > NAME_MAX_CHARS or not value.isprintable():
        return f"a printable name of at most {NAME_MAX_CHARS} characters"
    if type_name and ("," in value or any(c.isspace() for c in value)):
        return "a device type name without spaces or commas"
    return None


def check_type_name(value: object, where: str) -> str:
    """``value`` if it is a valid device type name, else PoseidonError naming ``where``."""
    why = name_problem(value, type_name=True)
    if why is not None:
        raise PoseidonError(f"{where}: expected {why}, got {short_repr(value)}")
    return value  # type: ignore[return-value]


__all__ = ["MAX_ECHO_CHARS", "NAME_MAX_CHARS", "NotRegularFile", "atomic_output", "bound_line", "bounded_join",
           "check_distinct", "check_type_name", "escape_controls", "file_kind", "name_problem",
           "open_input", "same_file", "write_atomic"]
