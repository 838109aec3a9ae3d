"""PARAM's JSON-lines result files: writing them atomically, reading stg's and PARAM's own.

A result file is (PARAM's ``train/compute/python`` layout, see ``lib/pytorch/build_executor.py``):

1. a setup line ``{"run_options": {...}, "sys_info": {...}, "start_time": ISO}``;
2. one line per case: ``{"op_name", "id", "metric": {"forward": {"warmup.time": [ms],
   "measure.time": [ms], ...}, "backward": {...}}, "config": {"build", "input"}}``; stg adds
   ``extra`` (analytic FLOPs and bytes, median and IQR, achieved TFLOP/s and GB/s) and, for a
   case that failed, ``error`` (PARAM has no such line: one failing case aborts its run);
3. a finish line ``{"finish_time": ISO}`` (stg adds ``cases`` and ``failed``).

A file without its finish line (PARAM crashed on a case) is read, and said to be incomplete.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from stg.errors import UserError, check_replaceable, reported_write_faults


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) with linear interpolation between order
    statistics (numpy's default, ``statistics.quantiles(method="inclusive")``)."""
    if not values:
        raise ValueError("no values")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# -- writing --------------------------------------------------------------------------------


def new_file_mode() -> int:
    """The mode of any new file here: 0666 minus the umask (``mkstemp`` makes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_json_atomic(
    path: str | Path, data: Any, then: Callable[[], object] | None = None
) -> None:
    """Write ``data`` as indented JSON through a temporary file beside ``path``; ``then()``
    (another output of the same run) as in :func:`replace_then`."""
    target = Path(path)
    with reported_write_faults(target):
        handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            os.chmod(tmp, new_file_mode())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    replace_then(Path(tmp), target, then)


def replace_then(tmp: Path, target: Path, then: Callable[[], object] | None = None) -> None:
    """Move the complete file ``tmp`` onto ``target``, then run ``then()`` (the run's other
    outputs); if ``then()`` fails, the file ``target`` was before is put back (or the new one
    removed), so a run writes all its outputs or none. A fault of the file system is one
    :class:`stg.errors.OutputError` line naming ``target``; ``tmp`` is gone either way."""
    backup = tmp.with_name(tmp.name + ".old")
    had = False
    try:
        check_replaceable(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with reported_write_faults(target):
        try:
            if then is not None and os.path.lexists(target):
                os.rename(target, backup)
                had = True
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if had:
                os.replace(backup, target)
            raise
    if then is None:
        return
    try:
        then()
    except BaseException:
        if had:
            os.replace(backup, target)
        else:
            target.unlink(missing_ok=True)
        raise
    if had:
        backup.unlink(missing_ok=True)


class ResultWriter:
    """Lines written to a hidden temporary file beside ``path``, moved into place by
    :meth:`commit` (so a run that fails or is interrupted leaves nothing behind). A fault of
    the file system raises :class:`stg.errors.OutputError` after the temporary file is gone."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with reported_write_faults(self.path):
            handle, tmp = tempfile.mkstemp(
                prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent or Path(".")
            )
        self._tmp = Path(tmp)
        self._file: TextIO = os.fdopen(handle, "w", encoding="utf-8")
        self.lines = 0

    def write(self, record: Mapping[str, Any]) -> None:
        with self._aborted_on_fault():
            self._file.write(json.dumps(record, sort_keys=False, default=str) + "\n")
            self._file.flush()
        self.lines += 1

    def commit(self, then: Callable[[], object] | None = None) -> Path:
        """Move the lines into place, then run ``then()`` (the run's other outputs): if it
        fails, the earlier file is put back (:func:`replace_then`)."""
        with self._aborted_on_fault():
            self._file.close()
            os.chmod(self._tmp, new_file_mode())
        replace_then(self._tmp, self.path, then)
        return self.path

    @contextmanager
    def _aborted_on_fault(self) -> Iterator[None]:
        with reported_write_faults(self.path):
            try:
                yield
            except OSError:
                self.abort()
                raise

    def abort(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the buffered rest could not be written: the file goes anyway
                pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


# -- reading --------------------------------------------------------------------------------


@dataclass
class ResultFile:
    """The lines of one result file: setup, cases (dicts as written) and whether it ended."""

    path: str
    setup: dict[str, Any] = field(default_factory=dict)
    cases: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        """The device the file was measured on (``NVIDIA H100 80GB HBM3``, ``cpu``)."""
        info = self.setup.get("sys_info") or {}
        options = self.setup.get("run_options") or {}
        name = info.get("cuda_device_name")
        device = str(options.get("device") or "")
        if name and device.startswith("cuda"):
            return str(name)
        return device or "unknown"


def read_results(path: str | Path) -> ResultFile:
    """Parse a result file; one-line :class:`UserError` for anything but JSON lines.

    A last line cut short (a run killed while writing) is dropped with a warning; a missing
    finish line is a warning (PARAM stops at its first failing case)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read results {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"results {name!r} are not UTF-8 text") from None
    out = ResultFile(name)
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"results {name!r} are empty")
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if position == len(lines) - 1 and position > 0:
                out.warnings.append(f"{name}: line {number} is cut short; ignored")
                break
            raise UserError(
                f"results {name!r}: line {number} is not JSON (expected PARAM's JSON lines)"
            ) from None
        if not isinstance(record, dict):
            raise UserError(f"results {name!r}: line {number} is not a JSON object")
        if "run_options" in record or "sys_info" in record:
            out.setup = record
        elif "op_name" in record:
            if not isinstance(record.get("config"), Mapping):
                raise UserError(f"results {name!r}: line {number} has no config object")
            out.cases.append(record)
        elif "finish_time" in record:
            out.finished = True
    if not out.cases:
        raise UserError(f"results {name!r} hold no case lines (op_name, id, metric, config)")
    if not out.finished:
        out.warnings.append(
            f"{name} is incomplete (no finish line: the run stopped early); "
            f"using its {len(out.cases)} cases"
        )
    return out


def case_times(case: Mapping[str, Any], pass_name: str = "forward") -> list[float]:
    """The measured times of a case in ms (empty when that pass was not measured)."""
    metric = case.get("metric") or {}
    values = (metric.get(pass_name) or {}).get("measure.time") or []
    return [float(v) for v in values if isinstance(v, int | float) and v >= 0]


def iter_results(paths: Iterable[str | Path]) -> Iterator[ResultFile]:
    for path in paths:
        yield read_results(path)


__all__ = [
    "ResultFile",
    "ResultWriter",
    "case_times",
    "iter_results",
    "median",
    "new_file_mode",
    "quartiles",
    "read_results",
    "replace_then",
    "write_json_atomic",
]
