"""Per-rank work spread over processes, results in rank order (so output is deterministic).

``stg validate``, ``stg feed``, ``stg inspect trace`` and ``stg predict PATH`` handle rank files
independently and then combine small per-rank results; :func:`map_ranks` runs the per-rank
function in a pool of worker processes (``--jobs``, default: every core this process may run
on) and yields the results in the order of the inputs, whatever order the workers finish in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, TypeVar

from stg.errors import UserError

T = TypeVar("T")
R = TypeVar("R")

SMALL_BYTES = 4 << 20
"""Below this much input in all, work runs in this process (a pool costs more than it saves)."""


def default_jobs() -> int:
    """Every core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover (not Linux)
        return max(1, os.cpu_count() or 1)


def resolve_jobs(jobs: int | None, option: str = "--jobs") -> int:
    """``jobs`` as a worker count: None or 0 mean every core; a negative count is refused."""
    if jobs is None or jobs == 0:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0:
        raise UserError(f"{option} {jobs}: must be a positive number of processes (0: all cores)")
    return jobs


def map_ranks(
    fn: Callable[[T], R],
    items: Sequence[T],
    jobs: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
) -> Iterator[R]:
    """``fn(item)`` for each item, in order, computed by up to ``jobs`` worker processes.

    ``fn`` must be a module-level function and items and results picklable. ``sizes`` (bytes
    per item) lets small inputs run in this process. Exceptions raised by ``fn`` propagate.
    """
    workers = min(resolve_jobs(jobs), len(items))
    if sizes is not None and sum(sizes) < SMALL_BYTES:
        workers = 1
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    # fork is cheap and sees this process's state; with other threads alive (a progress bar)
    # a forked child could inherit a held lock, so start workers from a clean server instead
    method = "fork" if threading.active_count() == 1 else "forkserver"
    chunk = max(1, min(16, len(items) // (4 * workers)))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context(method)) as pool:
        yield from pool.map(fn, items, chunksize=chunk)


def file_sizes(paths: Sequence[Any]) -> list[int]:
    """Sizes of ``paths`` in bytes (0 for a missing one)."""
    out = []
    for path in paths:
        try:
            out.append(os.path.getsize(path))
        except (OSError, TypeError):
            out.append(0)
    return out
