"""Errors that mean "bad input": the CLI prints their one-line message and exits with code 2."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import TypeGuard


class UserError(ValueError):
    """Bad user input. The message is one line naming the problem and the allowed values."""


class UnknownNameError(UserError, LookupError):
    """A name (model, emitter, schedule, predictor, ...) that no plugin registered."""


class TraceError(UserError):
    """A malformed trace file (truncated record, dangling dependency, cycle, ...)."""


class OutputError(UserError):
    """An output could not be written: a full disk or quota, no permission, a read-only file
    system, a move across file systems. Raised after the writer removed what it had begun."""


WRITE_FAULTS: frozenset[int] = frozenset(
    code
    for code in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EXDEV,
        errno.EIO,
    )
    if code is not None
)
"""The ``errno`` values of :class:`OSError` that are faults of the place written to, not of
stg: they are reported as one :class:`OutputError` line."""


def is_write_fault(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` is an :class:`OSError` with one of :data:`WRITE_FAULTS`."""
    return isinstance(exc, OSError) and exc.errno in WRITE_FAULTS


def output_error(path: str | PathLike[str], exc: OSError) -> OutputError:
    """The one-line error for ``exc``, raised while writing ``path``:
    ``cannot write PATH: No space left on device``."""
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


@contextmanager
def reported_write_faults(path: str | PathLike[str]) -> Iterator[None]:
    """Turn a :data:`WRITE_FAULTS` :class:`OSError` raised inside into :func:`output_error`
    naming ``path``; the code inside must already have removed its temporary files."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_FAULTS:
            raise
        raise output_error(path, exc) from None


def check_replaceable(path: str | PathLike[str]) -> None:
    """Refuse an output ``path`` that exists but is not a regular file or a folder (a device
    such as /dev/null, a pipe, a socket, or a link to one): stg writes a file by renaming a
    complete one over it, which would remove the device."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OutputError(
            f"cannot write {path}: it is not a regular file (a device or a pipe); stg replaces "
            "its outputs whole: give a file path"
        )


def write_replacing(
    path: str | PathLike[str], write: Callable[[Path], object], suffix: str = ".tmp"
) -> None:
    """Write one file atomically: ``write(tmp)`` fills a temporary file beside ``path``,
    which gets a new file's mode (0666 minus the umask; ``mkstemp`` makes 0600) and is renamed
    over ``path``. On any failure the temporary file is removed and ``path`` is untouched; a
    :data:`WRITE_FAULTS` error becomes :class:`OutputError` naming ``path``."""
    target = Path(path)
    check_replaceable(target)
    with reported_write_faults(target):
        handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
        os.close(handle)
        tmp = Path(name)
        try:
            write(tmp)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
