"""`stg.perf.eager`: the ops eager PyTorch dispatches per stg node, against counts of the
models ``benchmarks/eager_step.py`` times: the count an H200 took
(tests/data/eager/h200-eager-op-counts.json) and, where PyTorch is installed, one taken here
on the CPU by ``benchmarks/count_eager_ops.py``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import Node, NodeType, Role, node_role
from stg.host.registry import load_registry
from stg.perf import eager as eager_module
from stg.perf.costs import EAGER_OP_HOST_S, compute_time
from stg.perf.eager import EAGER_OPS, ONE_OP, eager_ops, eager_time
from stg.perf.system import load_system

ROOT = Path(__file__).resolve().parents[1]
COUNTS = json.loads((ROOT / "tests/data/eager/h200-eager-op-counts.json").read_text())
FAMILIES = ("llama", "gpt")
H100 = load_system("h100-80g")
SHAPES = {"llama": (64, 4, 2, 128, 100), "gpt": (64, 4, 4, 128, 100)}
"""(dmodel, heads, kv heads, ffn, vocabulary) as benchmarks/count_eager_ops.py counts them"""


def _counter_script() -> ModuleType:
    path = ROOT / "benchmarks" / "count_eager_ops.py"
    spec = importlib.util.spec_from_file_location("count_eager_ops", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("count_eager_ops", module)
    spec.loader.exec_module(module)
    return module


def _nodes(family: str, layers: int = 2, **options: Any) -> list[Node]:
    """The compute nodes of the model ``count_eager_ops.py`` counts, as stg generates it."""
    dmodel, heads, kv, ffn, vocab = SHAPES[family]
    chosen: dict[str, Any] = {
        "model": family,
        "dmodel": dmodel,
        "head": heads,
        "kvhead": kv,
        "dff": ffn,
        "dvocal": vocab,
        "num_stacks": layers,
        "seq": 16,
        "batch": 1,
        "mixed_precision": True,
        "dtype": "bf16",
        "profile": "eager",
        "causal": True,
    }
    generate = GenerateOptions(**{**chosen, **options})
    workload = build_workload(generate, load_registry(autoload=False))
    return [n for n in workload.ranks[0].nodes() if n.type is NodeType.COMP]


def _table_totals(family: str) -> tuple[int, int]:
    """Ops of layer 1 and of the nodes outside the layers (not the optimizer step)."""
    layer = outside = 0
    for node in _nodes(family):
        if node_role(node) is Role.OPTIMIZER_STEP:
            continue
        where = (node.attrs or {}).get("layer")
        if where == 1:
            layer += eager_ops(node).ops
        elif where is None:
            outside += eager_ops(node).ops
    return layer, outside


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_counts_the_ops_an_h200_dispatched(family: str) -> None:
    measured = COUNTS[family]
    assert _table_totals(family) == (measured["layer_total"], measured["outside_total"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_node_of_the_measured_models_has_a_count(family: str) -> None:
    for node in _nodes(family):
        if node_role(node) is not Role.OPTIMIZER_STEP:
            op = node.attrs["op"] if "op" in (node.attrs or {}) else node.name.rsplit("/", 1)[-1]
            assert op in EAGER_OPS or op.endswith(".grad_sum"), op


def _cuda_rms_norm_on_cpu(torch: Any) -> Any:
    """CPU kernels for ``_fused_rms_norm`` and its backward, which CUDA has and a CPU lacks
    (there ``rms_norm`` is composite: pow, mean, add, rsqrt, mul, mul), so that a CPU step
    dispatches the ops a CUDA step does. The library object holds the registration."""
    library = torch.library.Library("aten", "IMPL")

    def forward(x: Any, shape: list[int], weight: Any, eps: float | None) -> Any:
        dims = tuple(range(-len(shape), 0))
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        out = x.float() * rstd
        return (out if weight is None else out * weight).to(x.dtype), rstd

    def backward(grad: Any, x: Any, shape: list[int], rstd: Any, weight: Any, mask: Any) -> Any:
        dims = tuple(range(-len(shape), 0))
        normed = x * rstd
        scaled = grad if weight is None else grad * weight
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(dims, keepdim=True))
        leading = tuple(range(x.dim() - len(shape)))
        grad_weight = (grad * normed).sum(leading) if weight is not None else torch.empty(0)
        return grad_x, grad_weight

    library.impl("_fused_rms_norm", forward, "CPU")
    library.impl("_fused_rms_norm_backward", backward, "CPU")
    return library


def _same_names(ops: dict[str, int]) -> Counter[str]:
    """Op counts with SDPA's device-specific kernels under one name."""
    named: Counter[str] = Counter()
    for op, n in ops.items():
        named["sdpa" + (".backward" if "backward" in op else "") if "scaled_dot" in op else op] += n
    return named


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cpu_step_dispatches_what_the_table_and_the_h200_count(family: str) -> None:
    torch = pytest.importorskip("torch")
    library = _cuda_rms_norm_on_cpu(torch)
    try:
        counted = _counter_script().count(torch, family, "cpu")
    finally:
        library._destroy()
    for where in ("layer", "outside"):
        assert _same_names(counted[where]) == _same_names(COUNTS[family][where]), where
    totals = (sum(counted["layer"].values()), sum(counted["outside"].values()))
    assert totals == _table_totals(family)


def test_gradient_sums_are_one_add_per_further_term() -> None:
    sums = {
        n.attrs["op"]: eager_ops(n).ops
        for n in _nodes("llama")
        if n.attrs.get("layer") == 1 and n.attrs["op"].endswith(".grad_sum")
    }
    # q, k and v return the norm's output three gradients; gate and up two; the residual two
    assert sums == {
        "attention_norm.grad_sum": 2,
        "ffn_norm.grad_sum": 1,
        "residual1.grad_sum": 1,
        "x.grad_sum": 1,
    }


def _op(family: str, op: str, **options: Any) -> Node:
    return next(n for n in _nodes(family, 1, **options) if n.attrs.get("op") == op)


def test_a_node_pays_the_host_time_of_all_its_ops() -> None:
    rope = _op("llama", "rope_q.grad_q")
    assert compute_time(rope, H100, profile="eager") == pytest.approx(10 * EAGER_OP_HOST_S)
    assert compute_time(rope, H100) < EAGER_OP_HOST_S  # megatron: one fast kernel
    # a norm's weight gradient comes from its input gradient's op: its kernel time only
    weight = _op("llama", "ffn_norm.grad_ffn_norm.weight")
    assert compute_time(weight, H100, profile="eager") == pytest.approx(
        compute_time(weight, H100, profile="megatron")
    )


def test_a_bias_in_addmm_pays_its_cast_and_its_gradient_nothing() -> None:
    bias = _op("gpt", "fc1_bias")
    assert compute_time(bias, H100, profile="eager") == pytest.approx(EAGER_OP_HOST_S)
    assert compute_time(_op("gpt", "fc1_bias.grad_fc1"), H100, profile="eager") == 0.0


def test_autocast_copies_of_weights_and_activations_are_priced() -> None:
    # wide enough that the GPU, not the host, bounds each node
    wide = {"dmodel": 8192, "dff": 32768, "head": 64, "kvhead": 8, "seq": 8192}
    gate = next(n for n in _nodes("llama", 1, **wide) if n.attrs.get("op") == "gate")
    grad = next(n for n in _nodes("llama", 1, **wide) if n.attrs.get("op") == "gate.grad_w1")
    tokens, d, ffn = 8192, 8192, 32768
    copy = H100.kernel_overhead, 6 / (H100.hbm_bandwidth * H100.memory_efficiency)
    kernel = compute_time(gate, H100, profile="megatron")
    casts = 2 * copy[0] + copy[1] * (tokens * d + d * ffn)  # the input and the weight, once
    assert compute_time(gate, H100, profile="eager") == pytest.approx(kernel + casts)
    kernel = compute_time(grad, H100, profile="megatron")
    cast = copy[0] + copy[1] * d * ffn  # the weight's gradient back to fp32
    assert compute_time(grad, H100, profile="eager") == pytest.approx(kernel + cast)


def test_an_op_without_a_count_is_one_op() -> None:
    node = dataclasses.replace(_op("llama", "swiglu"), attrs={"op": "conv_state_update"})
    assert eager_ops(node) == ONE_OP
    assert eager_time(node, H100, 1e-9, EAGER_OP_HOST_S) == EAGER_OP_HOST_S


def test_expert_weights_are_copied_to_bf16_and_their_gradients_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/eager_step.py's ``Experts`` copies its fp32 stacked expert weights to bf16
    every forward (``w13``: gate and up, E·2F·d; ``w2``: E·d·F) and autograd copies their
    gradients back to fp32: each expert GEMM and its weight gradient pays its E·d·F share
    over its kernel; the router (an ``nn.Linear`` under autocast) copies its input, weight
    and fp32 logits."""
    experts, d, ffn, tokens = 16, 2048, 1024, 2048
    moe = {"model": "moe", "dmodel": d, "dff": ffn, "head": 16, "kvhead": 4, "dhead": 128,
           "dvocal": 1024, "num_stacks": 1, "seq": tokens, "batch": 1, "experts": experts,
           "kexperts": 2, "moe_routing": "dropless", "mixed_precision": True, "dtype": "bf16",
           "profile": "eager", "causal": True}  # fmt: skip
    workload = build_workload(GenerateOptions(**moe), load_registry(autoload=False))
    nodes = {
        n.attrs["op"]: n
        for n in workload.ranks[0].nodes()
        if n.type is NodeType.COMP and n.attrs.get("layer") == 0
    }
    copy = H100.kernel_overhead, 6 / (H100.hbm_bandwidth * H100.memory_efficiency)
    share = copy[0] + copy[1] * experts * d * ffn
    ops = ("expert_gate", "expert_up", "expert_down", "expert_gate.grad_w1",
           "expert_up.grad_w3", "expert_down.grad_w2", "router")  # fmt: skip
    priced = {op: compute_time(nodes[op], H100, profile="eager") for op in ops}
    with monkeypatch.context() as patch:
        patch.setattr(eager_module, "EAGER_OPS", {})  # each node one op of its own kernel
        kernels = {op: compute_time(nodes[op], H100, profile="eager") for op in ops}
    for op in ops[:-1]:
        assert priced[op] == pytest.approx(kernels[op] + share), op
    casts = 3 * copy[0] + copy[1] * (tokens * d + d * experts + tokens * experts)
    expected = max(kernels["router"] + casts, 4 * EAGER_OP_HOST_S)
    assert priced["router"] == pytest.approx(expected)
