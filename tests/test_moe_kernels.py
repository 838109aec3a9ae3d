"""A mixture's routing kernels in eager PyTorch against H200 kernel measurements.

tests/data/kernels/h200-moe-routing.jsonl times them alone (``index_select``, ``index_add_``,
the gate-weight multiply; bf16 and fp32, 8k-262k routed rows) and h200-moe-layer.jsonl
profiles one experts layer of ``benchmarks/eager_step.py`` forward and backward, kernel by
kernel (``benchmarks/profile_moe_layer.py``). The constants of the scatter-add and of the
``gather`` and ``row_scale`` classes are their medians over the runs of >= 64k rows; this
checks every case of those runs, and the same kernels inside the layer, and that the eager
profile charges them for the dispatch and combine nodes of a generated mixture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time, scatter_add_time
from stg.perf.system import load_system

KERNELS = Path(__file__).resolve().parent / "data" / "kernels"
ROUTING = [
    json.loads(line) for line in (KERNELS / "h200-moe-routing.jsonl").read_text().splitlines()
]
LAYERS = [json.loads(line) for line in (KERNELS / "h200-moe-layer.jsonl").read_text().splitlines()]
H200_SYSTEM = load_system("h200-141g")
H200 = H200_SYSTEM.gpu
DTYPES = {"torch.bfloat16": ("bf16", 2), "torch.float32": ("fp32", 4)}
# name: (dmodel, experts, experts per token), as benchmarks/eager_step.py's MOE
SHAPES = {
    "qwen3-30b-a3b-4l": (2048, 128, 8),
    "olmoe-1b-7b-8l": (2048, 64, 8),
    "mixtral-8x7b-2l": (4096, 8, 2),
}
SCATTER_KERNEL = "indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2,"  # rows of d
GATHER_KERNEL = "vectorized_gather_kernel"


def _large(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["rows"] >= 65536]


@pytest.mark.parametrize(
    "case", _large(ROUTING), ids=lambda r: f"{r['rows']}x{r['d']}-{r['dtype']}"
)
def test_routing_kernels_alone(case: dict) -> None:
    dtype, width = DTYPES[case["dtype"]]
    elements = case["rows"] * case["d"]
    scatter = (case["zero_index_add_ms"] - case["zero_ms"]) * 1e-3
    assert scatter_add_time(H200, elements, dtype) == pytest.approx(scatter, rel=0.05)
    # the gather reads and writes each row; with 8 rows per token a token's row is read from
    # L2 more often than with 2, and the gather runs 13 % faster than the median
    gather = memory_bound_time(H200, 2 * elements * width, "gather", dtype)
    assert gather == pytest.approx(case["index_select_ms"] * 1e-3, rel=0.20)
    if width == 2:  # the one-weight-per-row multiply's rate is that of 16-bit values
        scale = memory_bound_time(H200, 2 * elements * width, "row_scale", dtype)
        assert scale == pytest.approx(case["mul_ms"] * 1e-3, rel=0.05)


def _kernel_us(layer: dict, prefix: str) -> tuple[float, float]:
    """Self device µs per call and calls of the kernels whose name has ``prefix``."""
    hits = [v for k, v in layer["device_us"].items() if prefix in k]
    return sum(v[0] for v in hits), sum(v[2] for v in hits)


def test_the_layers_scatter_adds_and_gathers(
    report_table: Callable[[str, list[str]], None],
) -> None:
    lines = [
        f"{'model':<18}{'tokens':>7}{'index_add_ µs':>15}{'model':>8}{'gather µs':>11}{'model':>8}"
    ]
    for layer in LAYERS:
        d, _, k = SHAPES[layer["model"]]
        routed = layer["tokens"] * k * d
        scatter_us, scatter_calls = _kernel_us(layer, SCATTER_KERNEL)
        gather_us, gather_calls = _kernel_us(layer, GATHER_KERNEL)
        # two of each per layer: the combine's index_add_ and the dispatch's gradient; the
        # dispatch's index_select and the combine's gradient
        assert scatter_calls == gather_calls == 2
        scatter = 2 * scatter_add_time(H200, routed, "bf16") * 1e6
        gather = 2 * memory_bound_time(H200, 2 * routed * 2, "gather", "bf16") * 1e6
        lines.append(
            f"{layer['model']:<18}{layer['tokens']:>7}{scatter_us:>15.0f}{scatter:>8.0f}"
            f"{gather_us:>11.0f}{gather:>8.0f}"
        )
        if layer["tokens"] >= 8192:  # smaller ones end before the atomics' rate is reached
            assert scatter == pytest.approx(scatter_us, rel=0.15)
            assert gather == pytest.approx(gather_us, rel=0.20)
    report_table("H200 experts layer: routing kernels, measured and modelled", lines)


def _routing_nodes(profile: str) -> dict[str, float]:
    options = GenerateOptions(
        model="moe", dmodel=2048, dff=768, head=16, kvhead=4, num_stacks=1, seq=8192, batch=1,
        micro_batch=1, dvocal=512, experts=128, kexperts=8, dtype="bf16", mixed_precision=True,
    )  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    nodes = {
        n.name.rsplit("/", 1)[-1]: n for n in workload.ranks[0].nodes() if "/layer0/" in n.name
    }
    names = ("dispatch", "combine", "combine.grad_expert_down", "dispatch.grad_ffn_norm")
    return {name: compute_time(nodes[name], H200_SYSTEM, profile=profile) for name in names}


def test_eager_charges_the_atomics_of_the_combine_and_the_dispatch_gradient() -> None:
    eager = _routing_nodes("eager")
    megatron = _routing_nodes("megatron")
    routed = 8192 * 8 * 2048  # at least: balanced routing, 8 experts per token
    atomics = scatter_add_time(H200, routed, "bf16")
    for name in ("combine", "dispatch.grad_ffn_norm"):
        assert eager[name] >= atomics  # index_add_: bound by its atomics
        assert megatron[name] < atomics / 3  # Transformer Engine's fused (un)permute: a gather
    gather = memory_bound_time(H200, 2 * routed * 2, "gather", "bf16")
    assert eager["dispatch"] >= gather
