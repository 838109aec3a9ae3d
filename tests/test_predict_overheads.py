"""FP8 without a plugin, Megatron's and Transformer Engine's fusions, and compute slowed by
concurrent communication, each against its closed form."""

from __future__ import annotations

import dataclasses

import pytest

from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeTemplate, NodeType, RankClass, RankGraph, Workload
from stg.host.registry import load_registry
from stg.perf.kernel_time import gemm_time, memory_bound_time
from stg.perf.system import load_system
from stg.predictors.time import (
    NCCL_CHANNELS,
    collective_time,
    compute_time,
    contended_systems,
    group_shape,
    predict_time,
)

H100 = load_system("h100-80g")
A100 = load_system("a100-80g")


def gemm_node(name: str, dtype: str, m: int = 4096, n: int = 16384, k: int = 4096) -> NodeTemplate:
    return NodeTemplate(
        0,
        name,
        NodeType.COMP,
        num_ops=2 * m * n * k,
        tensor_size=(m * k + k * n) * 2 + m * n * 2,
        dtype=dtype,
        attrs={"gemm": (1, m, n, k)},
    )


def test_fp8_gemm_runs_natively_where_the_gpu_has_fp8_tensor_cores() -> None:
    node = gemm_node("mb0/layer0/fwd/fc1", "fp8")
    expected = gemm_time(H100.gpu, 4096, 16384, 4096, "fp8") + H100.kernel_overhead
    assert compute_time(node, H100, "bf16") == pytest.approx(expected)
    bf16 = gemm_time(H100.gpu, 4096, 16384, 4096, "bf16")
    assert expected < 0.6 * bf16  # about twice the bf16 rate
    # the A100 has no fp8 tensor cores: the GEMM runs in the workload's dtype
    a100 = gemm_time(A100.gpu, 4096, 16384, 4096, "bf16") + A100.kernel_overhead
    assert compute_time(node, A100, "bf16") == pytest.approx(a100)


def test_megatron_fuses_biases_and_transformer_engine_casts() -> None:
    bias = NodeTemplate(
        0,
        "mb1/layer0/fwd/fc1_bias",
        NodeType.COMP,
        num_ops=2**26,
        tensor_size=3 * 2**27,
        dtype="bf16",
    )
    assert compute_time(bias, H100, "bf16", profile="megatron") == 0.0
    assert compute_time(bias, H100, "bf16", profile="eager") > 0.0
    elements = 2**26
    weight_cast = NodeTemplate(
        0,
        "mb1/layer0/fwd/fc1.cast_w1",
        NodeType.COMP,
        num_ops=elements,
        tensor_size=3 * elements,
        dtype="fp8",
        attrs={"micro_batch": 1},  # the typed micro-batch, not the name, tells the first
    )
    assert compute_time(weight_cast, H100, "bf16", profile="megatron") == 0.0  # cached
    first = dataclasses.replace(
        weight_cast, name="mb0/layer0/fwd/fc1.cast_w1", attrs={"micro_batch": 0}
    )
    streamed = memory_bound_time(H100.gpu, 3 * elements, "stream", "fp8")
    assert compute_time(first, H100, "bf16", profile="megatron") == pytest.approx(
        streamed + H100.kernel_overhead
    )
    activation = dataclasses.replace(weight_cast, name="mb1/layer0/fwd/fc1.cast_ln2")
    # fused into the LayerNorm that produces it: only the fp8 copy is written
    assert compute_time(activation, H100, "bf16", profile="megatron") == pytest.approx(
        memory_bound_time(H100.gpu, elements, "stream", "fp8")
    )
    grad = dataclasses.replace(
        weight_cast,
        name="mb1/layer0/bwd/fc1.cast_w1.grad_w1",
        dtype="fp32",
        tensor_size=6 * elements,
    )
    # a gradient cast stays a kernel in both profiles
    assert compute_time(grad, H100, "bf16", profile="megatron") == pytest.approx(
        compute_time(grad, H100, "bf16", profile="eager")
    )


def test_fp8_precision_plan_speeds_up_an_h100_step() -> None:
    plan = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
    base = GenerateOptions(
        model="gpt",
        dmodel=4096,
        dff=16384,
        head=32,
        kvhead=32,
        num_stacks=2,
        seq=2048,
        batch=4,
        micro_batch=2,
        dvocal=51200,
        mixed_precision=True,
    )
    registry = load_registry(autoload=False)
    times = {}
    for label, options in (("bf16", base), ("fp8", dataclasses.replace(base, precision=plan))):
        report = predict_time(build_workload(options, registry), H100, explain=True)
        times[label] = report["explain"]["breakdown_s"]["compute: gemm"]
    assert times["fp8"] < 0.75 * times["bf16"]


def test_compute_slowed_by_a_concurrent_collective() -> None:
    system = load_system("h100-80g")
    # c0 -> all-reduce over the two nodes' rails; c0 -> c2 runs while the all-reduce does
    layout = Layout({"dp": 2}, group_axes=(("dp",),))
    size = 2**30
    m = n = k = 8192
    nodes = (
        gemm_node("c0", "bf16", m, n, k),
        NodeTemplate(
            1,
            "grad_sync",
            NodeType.COMM_COLL,
            data_deps=(0,),
            comm_type=CollectiveType.ALL_REDUCE,
            comm_size=size,
            group_axes=("dp",),
        ),
        dataclasses.replace(gemm_node("c2", "bf16", m, n, k), id=2, data_deps=(0,)),
    )
    rc = RankClass(0, 0, nodes)
    # place the two ranks on two nodes: rank order puts dp innermost, so 8 ranks per node
    wide = dataclasses.replace(
        system, network=(dataclasses.replace(system.network[0], size=1), *system.network[1:])
    )
    ranks = tuple(RankGraph(r, rc, layout) for r in range(2))
    report = predict_time(Workload(ranks, layout.comm_groups, layout, {}), wide)
    free = gemm_time(wide.gpu, m, n, k) + wide.kernel_overhead
    slow_gpu = contended_systems(wide)["network"].gpu
    assert slow_gpu.sm_count == wide.sm_count - NCCL_CHANNELS["network"]
    slow = gemm_time(slow_gpu, m, n, k) + wide.kernel_overhead
    comm = collective_time(CollectiveType.ALL_REDUCE, size, group_shape([0, 1], wide), wide)
    assert comm > slow  # c2 runs entirely under the collective
    assert slow > free
    assert report["iteration_time_s"] == pytest.approx(free + comm)
    (rank,) = report["ranks"]
    assert rank["compute_s"] == pytest.approx(free + slow)


def test_unfused_softmax_is_a_memory_bound_kernel_at_its_measured_rate() -> None:
    elements = 50 * 2**20
    node = NodeTemplate(
        0,
        "mb0/layer0/fwd/softmax",
        NodeType.COMP,
        num_ops=5 * elements,
        tensor_size=4 * elements,
        dtype="fp16",
    )
    expected = memory_bound_time(A100.gpu, 4 * elements, "softmax", "fp16") + A100.kernel_overhead
    assert compute_time(node, A100, "fp16") == pytest.approx(expected)
    # slower than a streaming kernel of the same bytes (16-bit softmax: measured 0.35 of it)
    assert expected > 2 * memory_bound_time(A100.gpu, 4 * elements, "stream", "fp16")
