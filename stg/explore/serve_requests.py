"""Request streams for ``stg serve``: arrival times, prompt and output lengths.

Arrivals at a mean ``rate`` (requests per second) are a Poisson process (exponential gaps),
a gamma renewal process of a given coefficient of variation (gaps of shape ``1/cv²``: cv 1 is
Poisson, above 1 burstier), or bursts (a Poisson process of bursts at ``rate / burst``, each of
``burst`` requests at once on average, geometric in size). A trace file instead gives every
request: a CSV with a header, or JSON lines, with the fields ``arrival`` (seconds), ``prompt``
and ``output`` (tokens).

Lengths: ``fixed:N``, ``uniform:LOW:HIGH`` (integers, both included), ``lognormal:MEAN:SIGMA``
(tokens of that mean, ``SIGMA`` the standard deviation of their logarithm) or
``file:PATH[:FIELD]`` (drawn with replacement from the ``FIELD`` column, default ``prompt``
or ``output``, of a CSV or JSON-lines file). All draws come from one seed.
"""

from __future__ import annotations

import csv
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stg.errors import UserError

ARRIVALS = ("poisson", "gamma", "bursty")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "file")
TRACE_FIELDS = ("arrival", "prompt", "output")


@dataclass(frozen=True)
class Stream:
    """Requests in arrival order: arrival times (s), prompt and output lengths (tokens)."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)


def _read_rows(path: str) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file (a CSV with a header, or JSON lines)")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".jsonl", ".json", ".ndjson"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return list(csv.DictReader(text.splitlines()))
    except (json.JSONDecodeError, csv.Error) as exc:
        raise UserError(f"{path}: cannot be read: {exc}") from None


def _column(
    rows: Sequence[dict[str, object]], field: str, path: str, *, integer: bool
) -> np.ndarray:
    values = []
    for i, row in enumerate(rows):
        if field not in row:
            raise UserError(
                f"{path}: row {i + 1} has no field {field!r} (fields: {', '.join(row)})"
            )
        try:
            value = float(row[field])  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UserError(
                f"{path}: row {i + 1}: {field}={row[field]!r} is not a number"
            ) from None
        if integer and (value != int(value) or value < 1):
            raise UserError(
                f"{path}: row {i + 1}: {field}={row[field]!r} is not a positive integer"
            )
        if not integer and (not math.isfinite(value) or value < 0):
            raise UserError(f"{path}: row {i + 1}: {field}={row[field]!r} is not a time >= 0")
        values.append(value)
    if not values:
        raise UserError(f"{path}: no rows")
    return np.array(values, dtype=np.int64 if integer else np.float64)


def read_trace(path: str) -> Stream:
    """Requests from a trace file (fields ``arrival``, ``prompt``, ``output``), sorted by
    arrival (stable)."""
    rows = _read_rows(path)
    arrival = _column(rows, "arrival", path, integer=False)
    order = np.argsort(arrival, kind="stable")
    return Stream(
        arrival[order],
        _column(rows, "prompt", path, integer=True)[order],
        _column(rows, "output", path, integer=True)[order],
    )


@dataclass(frozen=True)
class Lengths:
    """A length distribution, parsed from ``kind:args`` (see the module docstring)."""

    spec: str
    field: str

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        kind, _, rest = self.spec.partition(":")
        args = rest.split(":") if rest else []
        usage = (
            f"--{self.field} {self.spec!r}: expected fixed:N, uniform:LOW:HIGH, "
            "lognormal:MEAN:SIGMA or file:PATH[:FIELD]"
        )
        if kind == "file":
            if not args:
                raise UserError(usage)
            path, field = (args[0], args[1]) if len(args) > 1 else (args[0], self.field)
            pool = _column(_read_rows(path), field, path, integer=True)
            return pool[rng.integers(0, len(pool), size=n)]
        try:
            numbers = [float(a) for a in args]
        except ValueError:
            raise UserError(usage) from None
        if kind == "fixed" and len(numbers) == 1 and numbers[0] >= 1:
            return np.full(n, int(numbers[0]), dtype=np.int64)
        if kind == "uniform" and len(numbers) == 2 and 1 <= numbers[0] <= numbers[1]:
            return rng.integers(int(numbers[0]), int(numbers[1]) + 1, size=n)
        if kind == "lognormal" and len(numbers) == 2 and numbers[0] >= 1 and numbers[1] >= 0:
            mean, sigma = numbers
            mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma²))] = mean
            return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=n))).astype(np.int64)
        raise UserError(usage)


def arrival_times(
    kind: str, rate: float, duration: float, rng: np.random.Generator, cv: float, burst: float
) -> np.ndarray:
    """Arrival times in ``[0, duration)`` of a process of mean ``rate`` requests/s."""
    if kind not in ARRIVALS:
        raise UserError(f"--arrival {kind!r}: allowed values are {', '.join(ARRIVALS)}")
    if not (rate > 0 and math.isfinite(rate)):
        raise UserError(f"--rate {rate}: must be a positive number of requests per second")
    if not (duration > 0 and math.isfinite(duration)):
        raise UserError(f"--duration {duration}: must be a positive number of seconds")
    expected = rate * duration
    n = int(expected + 10 * math.sqrt(expected) + 10)
    if kind == "poisson":
        times = np.cumsum(rng.exponential(1 / rate, size=n))
    elif kind == "gamma":
        if not cv > 0:
            raise UserError(f"--cv {cv}: must be positive (1 is Poisson)")
        shape = 1 / (cv * cv)
        n = int(expected + 10 * cv * math.sqrt(expected) + 10)
        times = np.cumsum(rng.gamma(shape, 1 / (rate * shape), size=n))
    else:
        if not burst >= 1:
            raise UserError(f"--burst {burst}: the mean burst size must be at least 1")
        bursts = int(expected / burst + 10 * math.sqrt(expected / burst) + 10)
        starts = np.cumsum(rng.exponential(burst / rate, size=bursts))
        sizes = rng.geometric(1 / burst, size=bursts)
        times = np.repeat(starts, sizes)
    while times[-1] < duration:  # the tail of a generous draw, almost never needed
        more = arrival_times(kind, rate, duration, rng, cv, burst)
        times = np.concatenate([times, times[-1] + more])
    return times[times < duration]


def check_seed(seed: int) -> None:
    """One error line for a seed numpy cannot take (a negative one)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise UserError(f"--seed {seed}: must be a non-negative integer")


def generate(
    *,
    arrival: str,
    rate: float,
    duration: float,
    prompt: str,
    output: str,
    seed: int,
    cv: float = 1.0,
    burst: float = 1.0,
) -> Stream:
    """A synthetic request stream (see the module docstring)."""
    check_seed(seed)
    for spec, name in ((prompt, "prompt"), (output, "output")):  # its errors before any draw
        Lengths(spec, name).draw(0, np.random.default_rng(0))
    arrivals_rng, prompt_rng, output_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    times = arrival_times(arrival, rate, duration, arrivals_rng, cv, burst)
    if len(times) == 0:
        raise UserError(
            f"no request arrives in {duration} s at {rate} requests/s; lengthen --duration"
        )
    n = len(times)
    return Stream(
        times,
        Lengths(prompt, "prompt").draw(n, prompt_rng),
        Lengths(output, "output").draw(n, output_rng),
    )


__all__ = [
    "ARRIVALS",
    "LENGTH_KINDS",
    "Lengths",
    "Stream",
    "arrival_times",
    "check_seed",
    "generate",
    "read_trace",
]
