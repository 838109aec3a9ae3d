"""Errors that mean "bad input": the CLI prints their one-line message and exits with code 2."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike
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
