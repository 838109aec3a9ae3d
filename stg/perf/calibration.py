"""Calibration tables: measured kernel times that the time predictor consults before its models.

``stg bench calibrate`` writes a table from benchmark results (PARAM's JSON lines, stg's or
PARAM's own); ``stg predict --calibration FILE`` hands it to the time predictor, which asks
:meth:`Calibration.node_time` for each compute node:

1. **lookup**: a measurement of exactly the node's kernel: ``gemm`` = (batch, m, n, k),
   ``attention`` = (batch, heads, s_q, s_kv, head_dim, causal) forward or backward, or a
   memory-bound kernel class (``stream``, ``norm``, ``softmax``) moving exactly the node's
   bytes, in the node's dtype;
2. **interpolation** in the model fitted per (op class, dtype, pass) to all measurements of
   that class: ``t = latency + flops/flop_rate + bytes/byte_rate`` (non-negative least squares
   on relative error), used only between the smallest and largest measured work (FLOPs for
   GEMMs and attention, bytes for memory-bound kernels), never extrapolated;
3. otherwise ``None``: the predictor's analytical model prices the node.

Keys are the kernel shapes that generated compute nodes carry as attributes (``gemm`` and
``attention``, :mod:`stg.core.lowering`); a node without them (a foreign trace) can still
use the fitted models through its FLOPs and bytes.

The file (JSON)::

    {"format": "stg-calibration", "version": 1, "device": "NVIDIA H100 80GB HBM3",
     "sources": ["results.jsonl"],
     "entries": [{"op_class": "gemm", "dtype": "bf16", "pass": "forward",
                  "shape": [1, 4096, 4096, 4096], "seconds": 0.000186, "samples": 10,
                  "op": "torch.mm", "id": "0|0|3"}, ...],
     "models": [{"op_class": "gemm", "dtype": "bf16", "pass": "forward", "latency_us": 9.8,
                 "tflops": 690.1, "gbps": null, "flops_range": [1e9, 2e12],
                 "bytes_range": [...], "samples": 120, "median_rel_error": 0.08}, ...]}

Memory-bound entries have ``"bytes"`` instead of ``"shape"``.

**Collectives.** A table may also hold measured collectives, ``"comms"``: a list of
:class:`stg.perf.comm_time.MeasuredCurve` (collective, ranks, sizes, seconds), and
``--calibration`` takes the result file of ``stg bench comms`` itself (its rows, one curve per
collective over its number of processes). :func:`with_measured_comms` puts them on the
system's innermost network dimension (the processes of one ``stg bench comms`` run share a
node), where each replaces the modelled curve of its collective and group size.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stg.errors import UserError, write_replacing
from stg.perf.comm_time import MEASURED_COLLECTIVES, MeasuredCurve
from stg.perf.kernel_time import (
    ATTENTION_BACKWARD_WORK,
    DTYPE_BYTES,
    attention_flops,
    memory_kind,
)
from stg.perf.kernels import kernel_name
from stg.perf.system import System, normalize_dtype, op_class

FORMAT = "stg-calibration"
VERSION = 1
OP_CLASSES = ("gemm", "attention", "stream", "norm", "softmax")
"""Op classes a table covers: GEMMs, fused attention and the memory-bound kernel classes of
:mod:`stg.perf.kernel_time`."""
MEMORY_CLASSES = ("stream", "norm", "softmax")
PASSES = ("forward", "backward")
WIDE_DTYPES = frozenset({"fp32", "tf32"})

MIN_FIT_SAMPLES = 3
"""Fewest distinct measurements for a fitted model: one more than the two terms (latency and
one rate) that a class's model needs at least, so a fit is never just two points joined."""


class CalibrationError(UserError):
    """A calibration file that cannot be read."""


@dataclass(frozen=True)
class Kernel:
    """What a compute node runs, as a calibration table is keyed: op class, dtype, pass, key
    (the shape, or ``(bytes,)`` for a memory-bound class), and its work."""

    op_class: str
    dtype: str
    pass_: str
    key: tuple[int, ...] | None
    flops: float
    nbytes: float


def gemm_kernel(gemm: Sequence[int], dtype: str) -> Kernel:
    """The kernel of ``batch`` GEMMs ``[m, k] x [k, n]`` (``gemm`` = (batch, m, n, k))."""
    batch, m, n, k = (int(x) for x in gemm[:4])
    width = DTYPE_BYTES.get(dtype, 2)
    nbytes = batch * ((m * k + k * n) * width + m * n * max(width, 2))
    return Kernel("gemm", dtype, "forward", (batch, m, n, k), 2.0 * batch * m * n * k, nbytes)


def attention_kernel(attention: Sequence[int], dtype: str, backward: bool = False) -> Kernel:
    """The kernel of the attention core; ``attention`` = (batch, heads, s_q, s_kv, head_dim,
    causal[, backward]) (a 7th element, as generated nodes carry, overrides ``backward``)."""
    values = [int(x) for x in attention]
    batch, heads, s_q, s_kv, head_dim, causal = values[:6]
    if len(values) >= 7:
        backward = bool(values[6])
    flops = attention_flops(batch, heads, s_q, s_kv, head_dim, bool(causal))
    if backward:
        flops *= ATTENTION_BACKWARD_WORK
    width = DTYPE_BYTES.get(dtype, 2)
    nbytes = batch * heads * 2 * (s_q + s_kv) * head_dim * width
    key = (batch, heads, s_q, s_kv, head_dim, int(bool(causal)))
    return Kernel("attention", dtype, "backward" if backward else "forward", key, flops, nbytes)


def memory_kernel(kind: str, dtype: str, nbytes: float, flops: float = 0.0) -> Kernel:
    return Kernel(kind, dtype, "forward", (int(nbytes),), float(flops), float(nbytes))


def node_kernel(node: Any, default_dtype: str = "bf16") -> Kernel | None:
    """The calibration key of a compute node (None for a node without work or a bad dtype).

    Dtypes follow the time predictor: a node's dtype is its output's, and a matmul writing
    fp32 in a workload that computes in a narrower dtype runs in the workload's dtype."""
    num_ops = getattr(node, "num_ops", 0) or 0
    size = getattr(node, "tensor_size", 0) or 0
    if num_ops <= 0 and size <= 0:
        return None
    attrs = getattr(node, "attrs", None) or {}
    gemm = attrs.get("gemm")
    attention = attrs.get("attention")
    try:
        dtype = normalize_dtype(getattr(node, "dtype", None) or default_dtype)
        default = normalize_dtype(default_dtype)
    except UserError:
        return None
    name = kernel_name(node)
    # without a shape, only the arithmetic intensity tells a matmul (op_class without a name)
    kind = (
        "attention"
        if attention is not None
        else "gemm"
        if gemm is not None
        else op_class("", num_ops, size)
    )
    if kind in ("gemm", "attention") and dtype in WIDE_DTYPES and default not in WIDE_DTYPES:
        dtype = default
    if attention is not None and dtype == "fp8" and attrs.get("attention_dtype") != "fp8":
        # an fp8 recipe's attention runs in 16 bits unless it is fp8 attention (the node's
        # attention_dtype: serving's fp8 KV cache, training's fp8_attention), as priced
        dtype = "bf16"
    if attention is not None and len(attention) >= 6:
        return attention_kernel(attention, dtype)
    if gemm is not None and len(gemm) == 4:
        return gemm_kernel(gemm, dtype)
    if kind == "gemm":  # a matmul without its shape: the fitted model only
        return Kernel("gemm", dtype, "forward", None, float(num_ops), float(size))
    return memory_kernel(memory_kind(name), dtype, size, num_ops)


# -- fitted models ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FittedModel:
    """``seconds = latency + flops·per_flop + bytes·per_byte`` for one (op class, dtype, pass),
    valid between the smallest and largest measured work (FLOPs, or bytes for memory-bound)."""

    op_class: str
    dtype: str
    pass_: str
    latency: float
    per_flop: float
    per_byte: float
    low: float
    high: float
    samples: int
    median_rel_error: float

    @property
    def variable(self) -> str:
        return "bytes" if self.op_class in MEMORY_CLASSES else "flops"

    def predict(self, flops: float, nbytes: float) -> float | None:
        work = nbytes if self.variable == "bytes" else flops
        if not self.low <= work <= self.high:
            return None
        return self.latency + flops * self.per_flop + nbytes * self.per_byte

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_class": self.op_class,
            "dtype": self.dtype,
            "pass": self.pass_,
            "latency_us": self.latency * 1e6,
            "tflops": 1 / self.per_flop / 1e12 if self.per_flop > 0 else None,
            "gbps": 1 / self.per_byte / 1e9 if self.per_byte > 0 else None,
            f"{self.variable}_range": [self.low, self.high],
            "samples": self.samples,
            "median_rel_error": self.median_rel_error,
        }


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_relative(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float] | None:
    """Non-negative coefficients ``c`` minimising ``sum((row·c / t - 1)²)`` (relative error,
    so small kernels count as much as large ones); each subset of columns is solved by least
    squares and the best feasible one kept. None if no subset fits."""
    width = len(rows[0])
    scaled = [[x / t for x in row] for row, t in zip(rows, times, strict=True)]
    # columns are scaled to unit size first: FLOPs and seconds differ by 1e15
    norms = [max(abs(r[j]) for r in scaled) or 1.0 for j in range(width)]
    unit = [[r[j] / norms[j] for j in range(width)] for r in scaled]
    best: tuple[float, list[float]] | None = None
    for size in range(1, width + 1):
        for columns in itertools.combinations(range(width), size):
            ata = [[sum(r[i] * r[j] for r in unit) for j in columns] for i in columns]
            atb = [sum(r[i] for r in unit) for i in columns]
            solution = _solve(ata, atb)
            if solution is None or any(x < 0 for x in solution):
                continue
            coef = [0.0] * width
            for j, x in zip(columns, solution, strict=True):
                coef[j] = x / norms[j]
            error = sum((sum(a * b for a, b in zip(r, coef, strict=True)) - 1) ** 2 for r in scaled)
            if best is None or error < best[0] - 1e-15:
                best = (error, coef)
    return None if best is None else best[1]


def fit_model(
    op_class_: str,
    dtype: str,
    pass_: str,
    samples: Sequence[tuple[float, float, float]],
) -> FittedModel | None:
    """The model of one class from (flops, bytes, seconds) samples; None with too few."""
    distinct = sorted(set(samples))
    if len(distinct) < MIN_FIT_SAMPLES:
        return None
    memory = op_class_ in MEMORY_CLASSES
    rows = [[1.0, b] if memory else [1.0, f, b] for f, b, _ in distinct]
    times = [t for _, _, t in distinct]
    coef = fit_relative(rows, times)
    if coef is None:
        return None
    latency = coef[0]
    per_flop = 0.0 if memory else coef[1]
    per_byte = coef[1] if memory else coef[2]
    import statistics  # with fractions and decimal: only a fit needs it

    errors = [abs((latency + f * per_flop + b * per_byte) / t - 1) for f, b, t in distinct if t > 0]
    work = [b if memory else f for f, b, _ in distinct]
    return FittedModel(
        op_class_,
        dtype,
        pass_,
        latency,
        per_flop,
        per_byte,
        min(work),
        max(work),
        len(distinct),
        statistics.median(errors) if errors else 0.0,
    )


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One measured kernel: its key and median time in seconds."""

    kernel: Kernel
    seconds: float
    samples: int = 0
    op: str = ""
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        k = self.kernel
        out: dict[str, Any] = {"op_class": k.op_class, "dtype": k.dtype, "pass": k.pass_}
        if k.op_class in MEMORY_CLASSES:
            out["bytes"] = k.key[0] if k.key else int(k.nbytes)
        else:
            out["shape"] = list(k.key or ())
        out.update(seconds=self.seconds, samples=self.samples, op=self.op, id=self.id)
        return out


EntryKey = tuple[str, str, str, tuple[int, ...]]


def _entry_key(kernel: Kernel) -> EntryKey | None:
    if kernel.key is None:
        return None
    return (kernel.op_class, kernel.dtype, kernel.pass_, kernel.key)


@dataclass
class Calibration:
    """Measured kernels and fitted models of one device (see the module docstring)."""

    device: str = "unknown"
    sources: list[str] = field(default_factory=list)
    entries: dict[EntryKey, Entry] = field(default_factory=dict)
    models: dict[tuple[str, str, str], FittedModel] = field(default_factory=dict)
    path: str | None = None
    comms: list[MeasuredCurve] = field(default_factory=list)
    """measured collectives (see the module docstring)"""

    def add(self, entry: Entry) -> None:
        """Keep the fastest measurement of a key (a framework runs the fastest kernel it has
        for a shape; several backends measured for one shape are alternatives)."""
        key = _entry_key(entry.kernel)
        if key is None:
            return
        old = self.entries.get(key)
        if old is None or entry.seconds < old.seconds:
            self.entries[key] = entry

    def resolve(self, kernel: Kernel) -> tuple[float, str] | None:
        """(seconds, ``measured`` or ``fitted``) for a kernel, or None."""
        key = _entry_key(kernel)
        if key is not None:
            entry = self.entries.get(key)
            if entry is not None:
                return entry.seconds, "measured"
        model = self.models.get((kernel.op_class, kernel.dtype, kernel.pass_))
        if model is not None:
            seconds = model.predict(kernel.flops, kernel.nbytes)
            if seconds is not None and seconds > 0:
                return seconds, "fitted"
        return None

    def covers(self, op_class: str, dtype: str) -> bool:
        """Whether the table measured any kernel of ``op_class`` in ``dtype`` (an fp8 or int8
        GEMM measured on the device runs natively there)."""
        return any(k[0] == op_class and k[1] == dtype for k in self.entries) or any(
            k[0] == op_class and k[1] == dtype for k in self.models
        )

    def node_time(self, node: Any, default_dtype: str = "bf16") -> float | None:
        """Seconds of one compute node from this table, or None (the analytical model)."""
        kernel = node_kernel(node, default_dtype)
        if kernel is None:
            return None
        found = self.resolve(kernel)
        return None if found is None else found[0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": self.device,
            "sources": list(self.sources),
            "entries": [e.as_dict() for _, e in sorted(self.entries.items())],
            "models": [m.as_dict() for _, m in sorted(self.models.items())],
            **({"comms": [c.as_dict() for c in self.comms]} if self.comms else {}),
        }


def calibrated_time(
    table: Calibration,
    dtype: str,
    *,
    gemm: Sequence[int] | None = None,
    attention: Sequence[int] | None = None,
    op_class: str | None = None,
    nbytes: float | None = None,
    flops: float = 0.0,
    backward: bool = False,
) -> float | None:
    """Seconds of one kernel from ``table``, or None: a GEMM by its ``gemm`` shape (batch, m,
    n, k), fused attention by its ``attention`` shape (batch, heads, s_q, s_kv, head_dim,
    causal[, backward]), a memory-bound kernel by its ``op_class`` (stream, norm, softmax)
    and ``nbytes``."""
    dtype = normalize_dtype(dtype)
    if gemm is not None:
        kernel = gemm_kernel(gemm, dtype)
    elif attention is not None:
        kernel = attention_kernel(attention, dtype, backward)
    elif op_class in MEMORY_CLASSES and nbytes is not None:
        kernel = memory_kernel(op_class, dtype, nbytes, flops)
    else:
        raise ValueError("give gemm, attention, or a memory-bound op_class with nbytes")
    found = table.resolve(kernel)
    return None if found is None else found[0]


def coverage(
    table: Calibration, nodes: Iterable[Any], default_dtype: str = "bf16"
) -> dict[str, Any]:
    """How the compute nodes of a workload are priced: ``measured`` (lookup), ``fitted``
    (interpolated) or ``analytical`` (not covered), per op class, with the share of FLOPs."""
    by_class: dict[str, dict[str, int]] = {}
    flops = {"measured": 0.0, "fitted": 0.0, "analytical": 0.0}
    for node in nodes:
        kernel = node_kernel(node, default_dtype)
        if kernel is None:
            continue
        found = table.resolve(kernel)
        how = "analytical" if found is None else found[1]
        counts = by_class.setdefault(kernel.op_class, {"measured": 0, "fitted": 0, "analytical": 0})
        counts[how] += 1
        flops[how] += float(getattr(node, "num_ops", 0) or 0)
    totals = {how: sum(c[how] for c in by_class.values()) for how in flops}
    all_flops = sum(flops.values())
    return {
        "file": table.path,
        "device": table.device,
        "nodes": sum(totals.values()),
        **totals,
        "flops_share": {how: (v / all_flops if all_flops else 0.0) for how, v in flops.items()},
        "by_class": by_class,
    }


# -- files ---------------------------------------------------------------------------------------


def _need(where: str, data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise CalibrationError(f"{where}: missing key {key!r}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CalibrationError(f"{where}: {key} has the wrong type ({type(value).__name__})")
    return value


def _kernel_of(where: str, raw: Mapping[str, Any]) -> Kernel:
    kind = _need(where, raw, "op_class", str)
    if kind not in OP_CLASSES:
        raise CalibrationError(
            f"{where}: op_class {kind!r} is not known; allowed: {', '.join(OP_CLASSES)}"
        )
    name = _need(where, raw, "dtype", str)
    try:
        dtype = normalize_dtype(name)
    except UserError as exc:
        raise CalibrationError(f"{where}: {exc}") from None
    pass_ = raw.get("pass", "forward")
    if pass_ not in PASSES:
        raise CalibrationError(f"{where}: pass {pass_!r} must be forward or backward")
    if kind in MEMORY_CLASSES:
        nbytes = _need(where, raw, "bytes", int)
        return memory_kernel(kind, dtype, nbytes)
    shape = _need(where, raw, "shape", list)
    length = 4 if kind == "gemm" else 6
    if len(shape) != length or not all(isinstance(x, int) and x >= 0 for x in shape):
        raise CalibrationError(f"{where}: a {kind} shape is {length} integers >= 0")
    if kind == "gemm":
        return gemm_kernel(shape, dtype)
    return attention_kernel(shape, dtype, backward=pass_ == "backward")


def calibration_from_dict(data: Any, source: str = "calibration") -> Calibration:
    """Check and convert the JSON form; a mistake is one line naming where."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise CalibrationError(
            f"{source} is not a calibration table (format {FORMAT!r}; stg bench calibrate "
            f"writes one) or a stg bench comms result (format {COMMS_FORMAT!r})"
        )
    if data.get("version") != VERSION:
        raise CalibrationError(f"{source}: version {data.get('version')!r} is not {VERSION}")
    table = Calibration(
        device=str(data.get("device") or "unknown"),
        sources=[str(s) for s in data.get("sources") or []],
        path=source,
    )
    entries = _need(source, data, "entries", list)
    for i, raw in enumerate(entries):
        where = f"{source}: entries[{i}]"
        if not isinstance(raw, Mapping):
            raise CalibrationError(f"{where} must be an object")
        kernel = _kernel_of(where, raw)
        seconds = _need(where, raw, "seconds", (int, float))
        if not (seconds > 0 and math.isfinite(seconds)):
            raise CalibrationError(f"{where}: seconds must be > 0")
        table.add(
            Entry(
                kernel,
                float(seconds),
                int(raw.get("samples") or 0),
                str(raw.get("op", "")),
                str(raw.get("id", "")),
            )
        )
    for i, raw in enumerate(data.get("models") or []):
        where = f"{source}: models[{i}]"
        if not isinstance(raw, Mapping):
            raise CalibrationError(f"{where} must be an object")
        kind = _need(where, raw, "op_class", str)
        if kind not in OP_CLASSES:
            raise CalibrationError(f"{where}: op_class {kind!r} is not known")
        name = _need(where, raw, "dtype", str)
        try:
            dtype = normalize_dtype(name)
        except UserError as exc:
            raise CalibrationError(f"{where}: {exc}") from None
        pass_ = str(raw.get("pass", "forward"))
        variable = "bytes" if kind in MEMORY_CLASSES else "flops"
        low, high = _need(where, raw, f"{variable}_range", list)
        tflops, gbps = raw.get("tflops"), raw.get("gbps")
        table.models[(kind, dtype, pass_)] = FittedModel(
            kind,
            dtype,
            pass_,
            float(_need(where, raw, "latency_us", (int, float))) * 1e-6,
            1 / (tflops * 1e12) if tflops else 0.0,
            1 / (gbps * 1e9) if gbps else 0.0,
            float(low),
            float(high),
            int(raw.get("samples") or 0),
            float(raw.get("median_rel_error") or 0.0),
        )
    curves = data.get("comms") or []
    if not isinstance(curves, list):
        raise CalibrationError(f"{source}: comms must be a list of measured curves")
    for i, raw in enumerate(curves):
        try:
            table.comms.append(MeasuredCurve.from_dict(raw))
        except ValueError as exc:
            raise CalibrationError(f"{source}: comms[{i}]: {exc}") from None
    return table


# -- measured collectives (stg bench comms) -------------------------------------------------------

COMMS_FORMAT = "stg-bench-comms"
"""The ``format`` of a ``stg bench comms`` result file."""


def is_comms_result(data: Any) -> bool:
    """Whether ``data`` is the JSON of a ``stg bench comms`` result."""
    return isinstance(data, Mapping) and data.get("format") == COMMS_FORMAT


def comms_calibration(data: Mapping[str, Any], source: str) -> Calibration:
    """The measured curves of a ``stg bench comms`` result: per collective, its rows' sizes and
    median times over the run's number of processes (nccl-tests' size conventions, which
    :func:`stg.perf.comm_time.level_time` shares)."""
    options = data.get("options")
    ranks = options.get("nprocs") if isinstance(options, Mapping) else None
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise CalibrationError(f"{source}: options.nprocs must be a number of processes >= 2")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise CalibrationError(f"{source}: a stg bench comms result needs its rows")
    times: dict[str, dict[int, float]] = {}
    for i, row in enumerate(rows):
        where = f"{source}: rows[{i}]"
        if not isinstance(row, Mapping):
            raise CalibrationError(f"{where} must be an object")
        collective = _need(where, row, "collective", str)
        if collective not in MEASURED_COLLECTIVES:
            raise CalibrationError(
                f"{where}: collective {collective!r} is not known; "
                f"allowed: {', '.join(MEASURED_COLLECTIVES)}"
            )
        size = _need(where, row, "size", int)
        seconds = _need(where, row, "time", (int, float))
        if size <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            raise CalibrationError(f"{where}: size and time must be > 0")
        by_size = times.setdefault(collective, {})
        by_size[size] = min(float(seconds), by_size.get(size, math.inf))
    curves = [
        MeasuredCurve(
            name, ranks, tuple(sorted(by_size)), tuple(by_size[s] for s in sorted(by_size))
        )
        for name, by_size in sorted(times.items())
    ]
    return Calibration(
        device=str(data.get("device") or "unknown"), sources=[source], path=source, comms=curves
    )


def with_measured_comms(system: System, table: Calibration) -> System:
    """``system`` with the table's measured collectives on its innermost network dimension,
    each replacing a curve of the same collective and group size that the dimension had."""
    if not table.comms:
        return system
    if not isinstance(system, System):
        raise CalibrationError(
            "measured collectives calibrate one network; on a hybrid system give them with "
            "one group's device preset (--system t4-16g) instead"
        )
    inner = system.network[0]
    for curve in table.comms:
        if inner.size and curve.ranks > inner.size:
            raise CalibrationError(
                f"{table.path or 'calibration'}: {curve.collective} was measured over "
                f"{curve.ranks} ranks; the innermost network dimension of {system.name!r} "
                f"({inner.name}) holds {inner.size}"
            )
    replaced = {(c.collective, c.ranks) for c in table.comms}
    kept = tuple(c for c in inner.measured if (c.collective, c.ranks) not in replaced)
    inner = dataclasses.replace(inner, measured=(*kept, *table.comms))
    return dataclasses.replace(system, network=(inner, *system.network[1:]))


def load_calibration(path: str | Path) -> Calibration:
    """A calibration table from its JSON file; one-line :class:`CalibrationError` otherwise."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CalibrationError(f"cannot read calibration {name!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CalibrationError(f"calibration {name!r} is not JSON") from None
    if is_comms_result(data):
        return comms_calibration(data, name)
    return calibration_from_dict(data, name)


def write_calibration(table: Calibration, path: str | Path) -> None:
    """Write the table atomically (a temporary file beside ``path``, then renamed)."""
    text = json.dumps(table.as_dict(), indent=1) + "\n"
    write_replacing(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


__all__ = [
    "COMMS_FORMAT",
    "FORMAT",
    "MEMORY_CLASSES",
    "OP_CLASSES",
    "Calibration",
    "CalibrationError",
    "Entry",
    "FittedModel",
    "Kernel",
    "attention_kernel",
    "calibrated_time",
    "calibration_from_dict",
    "comms_calibration",
    "coverage",
    "fit_model",
    "fit_relative",
    "gemm_kernel",
    "is_comms_result",
    "load_calibration",
    "memory_kernel",
    "node_kernel",
    "with_measured_comms",
    "write_calibration",
]
