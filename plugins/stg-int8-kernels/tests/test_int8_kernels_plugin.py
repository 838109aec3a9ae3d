"""The int8/fp8 kernel plugin: its records, and what it does to predictions (stg.testing)."""

from __future__ import annotations

import pytest
import stg_int8_kernels

from stg.api import Kernel, KernelTable, build_workload
from stg.testing import KERNEL_DIMS, check_kernel, tiny_options


def test_registers_documented_kernels(stg_registry):
    registry = stg_registry(stg_int8_kernels)
    assert registry.kernels.names() == [
        "fp8-gemm-h100",
        "fp8-gemm-l4",
        "int8-gemm-a10",
        "int8-gemm-a100",
        "int8-gemm-a100-40g",
        "int8-gemm-h100",
        "int8-gemm-l4",
        "int8-gemm-t4",
    ]
    a100 = registry.kernels.get("int8-gemm-a100")
    assert isinstance(a100, Kernel) and a100.systems == ("a100-80g",)
    # a cast reads 2 B twice and writes 1 B per element at 80 % of 2039 GB/s, plus 2 launches
    assert a100.cast_alpha == pytest.approx(5 / (2039e9 * 0.8))
    assert a100.cast_beta == pytest.approx(4e-6)
    assert a100.bytes_per_element == 1.0
    # A100 has no fp8 tensor cores: no fp8 kernel there
    table = KernelTable.build(list(registry.kernels), "a100-80g")
    assert table.get("gemm", "fp8") is None and table.get("gemm", "int8") is a100


@pytest.mark.parametrize(
    ("kernel", "system"),
    [("int8-gemm-a100", "a100-80g"), ("int8-gemm-h100", "h100-80g"), ("fp8-gemm-h100", None)],
)
def test_planned_matmuls_are_faster_and_smaller(stg_registry, kernel, system):
    reports = check_kernel(kernel, stg_registry(stg_int8_kernels), system)
    default, planned = reports["default"], reports["planned"]
    assert planned["time"]["iteration_time_s"] < default["time"]["iteration_time_s"]
    assert planned["memory"]["peak_bytes"] < default["memory"]["peak_bytes"]
    # the model's FLOPs do not change: only how fast they run
    assert planned["time"]["model_flops"] > default["time"]["model_flops"]  # + cast FLOPs
    assert planned["time"]["model_flops"] < 1.01 * default["time"]["model_flops"]


def test_kernels_do_not_touch_unplanned_workloads(stg_registry):
    with_plugin = check_kernel("int8-gemm-a100", stg_registry(stg_int8_kernels))["default"]
    registry = stg_registry()
    workload = build_workload(tiny_options(**KERNEL_DIMS), registry)
    plain = registry.predictors.get("time").predict(workload, "a100-80g")
    assert plain["iteration_time_s"] == with_plugin["time"]["iteration_time_s"]
