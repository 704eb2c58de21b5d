"""Errors a user can cause. Anything else that escapes is a bug."""

from __future__ import annotations

import os
import reprlib
import stat

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 100, 100, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT_MAX = 160


def short_repr(value: object) -> str:
    """``repr(value)`` cut to a few dozen characters (an error line stays one short line, even
    for a 1 MB string or a structure that YAML aliases expand to billions of values)."""
    try:
        text = _SHORT.repr(value)
    except (ValueError, RecursionError):   # an int too long to print, a self-referencing list
        return f"<{type(value).__name__}>"
    return text if len(text) <= _SHORT_MAX else text[:_SHORT_MAX - 3] + "..."


def file_kind(mode: int) -> str:
    """What a ``st_mode`` names, in words ("a directory", "a FIFO (named pipe)", ...)."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "not a regular file"


class PoseidonError(Exception):
    """A user mistake or an impossible request; the CLI prints it on one line and exits 2."""


def check_writable(flag: str, path: str) -> None:
    """PoseidonError unless ``path`` can be written: checked before the search or run, so a typo
    in an output path costs nothing. An existing file is left untouched. (The CLI, ``poseidon
    validate`` and the launch's ``--poseidon-save-plan`` share it.)"""
    if os.path.isdir(path):
        raise PoseidonError(f"{flag} {path}: cannot write (is a directory)")
    if os.path.exists(path) and not os.path.isfile(path):   # written by os.replace: a file
        raise PoseidonError(f"{flag} {path}: cannot write "
                            f"({file_kind(os.stat(path).st_mode)}, not a regular file)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        why = "not a directory" if os.path.exists(directory) else "no such directory"
        raise PoseidonError(f"{flag} {path}: cannot write ({why}: {directory})")
    target = path if os.path.exists(path) else directory
    if not os.access(target, os.W_OK):
        raise PoseidonError(f"{flag} {path}: cannot write (permission denied)")


class SpecError(PoseidonError):
    """A cluster, model or plan specification is malformed.

    The message names the source (file), the field path and what was expected, e.g.
    ``examples/clusters/x.yaml: device_types.A100.memory_gib: expected a number > 0, got -3``.
    """

    def __init__(self, source: str, field: str, expected: str, got: object = None) -> None:
        self.source = source
        self.field = field
        self.expected = expected
        self.got = got
        got_part = "" if got is None else f", got {short_repr(got)}"
        super().__init__(f"{source}: {field}: expected {expected}{got_part}")


class ProfileDBError(PoseidonError):
    """The on-disk profile database is corrupt, of an old version, or unwritable."""


class InfeasibleError(PoseidonError):
    """No plan satisfies the constraints (batch divisibility, memory, device counts)."""


class DistributedError(PoseidonError):
    """A collective timed out or a rank failed during bootstrap, discovery or profiling."""


class PeerRefusedError(DistributedError):
    """Another rank refused the launch's input (a ``PoseidonError`` there, its own line names
    why): this rank exits with the same code 2 (not 1, a failure)."""


def is_refusal(e: BaseException) -> bool:
    """A refusal of the user's input (exit 2): a ``PoseidonError`` that is no distributed
    failure, or another rank's refusal."""
    return isinstance(e, PeerRefusedError) or (isinstance(e, PoseidonError)
                                               and not isinstance(e, DistributedError))


def record_field_error(where: str, field: str, expected: str, got: object) -> ProfileDBError:
    """The one-line error of a profile DB record's field."""
    return ProfileDBError(f"{where}.{field}: expected {expected}, got {short_repr(got)}")


def record_choice(record: dict, where: str, field: str, allowed, default: str) -> str:
    """``record[field]`` (``default`` when absent), one of ``allowed``; ProfileDBError
    otherwise."""
    value = record.get(field, default)
    if value not in allowed:
        raise record_field_error(where, field, "one of " + ", ".join(allowed), value)
    return value


def check_record_fields(record: object, where: str, known, required) -> dict:
    """A profile DB record's shape: an object, only ``known`` fields, every ``required`` one;
    ProfileDBError naming ``where`` and the field otherwise. Returns the record."""
    if not isinstance(record, dict):
        raise ProfileDBError(f"{where}: expected an object, got {type(record).__name__}")
    for field in record:
        if field not in known:
            raise ProfileDBError(f"{where}.{str(field)[:80]}: expected a known field ("
                                 + ", ".join(sorted(known)) + "), got 'unknown field'")
    for field in required:
        if field not in record:
            raise ProfileDBError(f"{where}.{field}: missing")
    return record
