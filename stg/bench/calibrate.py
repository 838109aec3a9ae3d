"""Benchmark results -> a calibration table (:class:`stg.perf.calibration.Calibration`).

Every measured case of the result files (stg's own, PARAM's, or the kernel measurements in
PARAM's format) becomes a table entry keyed as the predictor asks: its op class and kernel
shape from the operator's analysis (:func:`stg.bench.ops.analysis`), its dtype from its
first tensor, and the median of its measured times. GEMMs and memory-bound ops calibrate
from the forward pass (a backward pass is several kernels); attention from both. A shape
measured more than once keeps its fastest median. Then one model per (op class, dtype,
pass) is fitted to the entries (:func:`stg.perf.calibration.fit_model`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stg.bench.ops import analysis
from stg.bench.results import ResultFile, case_times, median
from stg.host.records import BenchOp
from stg.perf.calibration import (
    MEMORY_CLASSES,
    OP_CLASSES,
    Calibration,
    Entry,
    Kernel,
    attention_kernel,
    fit_model,
    gemm_kernel,
    memory_kernel,
)

PARAM_TO_STG_DTYPE = {
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "int8": "int8",
}
"""PARAM tensor dtypes that have a place in stg's systems (stg.perf.system.DTYPES); fp32
cases measured with TF32 matmuls (``extra.tf32``) count as tf32."""


@dataclass
class CalibrationReport:
    """What calibrating did: cases used, skipped (by reason), entries and models."""

    cases: int = 0
    used: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    warnings: list[str] = field(default_factory=list)


def _dtype(case: Mapping[str, Any]) -> str | None:
    for spec in (case["config"].get("input") or {}).get("args") or []:
        if isinstance(spec, Mapping) and spec.get("type") == "tensor":
            dtype = PARAM_TO_STG_DTYPE.get(str(spec.get("dtype")))
            extra = case.get("extra") or {}
            if dtype == "fp32" and extra.get("tf32"):
                return "tf32"
            return dtype
    return None


def case_kernels(
    case: Mapping[str, Any], op: BenchOp | None = None
) -> tuple[list[tuple[Kernel, list[float]]], str | None]:
    """The calibration kernels of one result line with their measured times (ms), or why
    the line calibrates nothing."""
    if "error" in case:
        return [], "failed case"
    forward = case_times(case, "forward")
    if not forward:
        return [], "no measured times"
    work = analysis(str(case.get("op_name")), case["config"], op)
    if work.op_class not in OP_CLASSES:
        return [], f"op class {work.op_class}"
    dtype = _dtype(case)
    if dtype is None:
        return [], "dtype without a stg dtype"
    if work.op_class == "gemm":
        if work.shape is None:
            return [], "shape not readable"
        return [(gemm_kernel(work.shape, dtype), forward)], None
    if work.op_class == "attention":
        if work.shape is None:
            return [], "shape not readable"
        found = [(attention_kernel(work.shape, dtype), forward)]
        backward = case_times(case, "backward")
        if backward:
            found.append((attention_kernel(work.shape, dtype, backward=True), backward))
        return found, None
    if work.nbytes is None:
        return [], "bytes not readable"
    return [(memory_kernel(work.op_class, dtype, work.nbytes, work.flops or 0.0), forward)], None


def calibrate(
    files: Iterable[ResultFile], ops: Mapping[str, Any] | None = None
) -> tuple[Calibration, CalibrationReport]:
    """A calibration table from result files; ``ops`` maps operator names to registered
    :class:`BenchOp` s (plugins' operators analyse their own cases)."""
    ops = ops or {}
    table = Calibration()
    report = CalibrationReport()
    devices: list[str] = []
    for result in files:
        table.sources.append(result.path)
        devices.append(result.device)
        report.warnings.extend(result.warnings)
        for case in result.cases:
            report.cases += 1
            record = ops.get(str(case.get("op_name")))
            found, why = case_kernels(case, record if isinstance(record, BenchOp) else None)
            if why is not None:
                report.skipped[why] += 1
                continue
            report.used += 1
            for kernel, times in found:
                table.add(
                    Entry(
                        kernel,
                        median(times) * 1e-3,
                        len(times),
                        str(case["op_name"]),
                        str(case.get("id", "")),
                    )
                )
    distinct = sorted(set(devices))
    table.device = distinct[0] if len(distinct) == 1 else " + ".join(distinct)
    if len(distinct) > 1:
        report.warnings.append(
            f"the results come from several devices ({', '.join(distinct)}); one table mixes them"
        )
    groups: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    for entry in table.entries.values():
        k = entry.kernel
        groups.setdefault((k.op_class, k.dtype, k.pass_), []).append(
            (k.flops, k.nbytes, entry.seconds)
        )
    for (kind, dtype, pass_), samples in sorted(groups.items()):
        model = fit_model(kind, dtype, pass_, samples)
        if model is not None:
            table.models[(kind, dtype, pass_)] = model
    return table, report


__all__ = ["MEMORY_CLASSES", "CalibrationReport", "calibrate", "case_kernels"]
