"""The PARAM compute config of exactly the kernels of a stg workload.

Every compute node of every rank class is keyed as the calibration table keys it
(:func:`stg.perf.calibration.node_kernel`: its ``gemm`` or ``attention`` shape, or its
memory-bound class and bytes, in its dtype), and each distinct kernel becomes one input
arg-set of a PARAM operator:

- a GEMM ``(batch, m, n, k)``: ``torch.mm`` of ``[m, k]`` and ``[k, n]`` (``torch.bmm`` of
  ``[batch, m, k]`` and ``[batch, k, n]`` when batch > 1), inputs without gradients (each
  forward, input-gradient and weight-gradient GEMM of the workload is its own node and case);
- fused attention ``(batch, heads, s_q, s_kv, head_dim, causal)``:
  ``scaled_dot_product_attention`` of q ``[batch, heads, s_q, head_dim]`` and k, v
  ``[batch, heads, s_kv, head_dim]`` with ``is_causal``; its forward and backward nodes are
  one case, measured with ``stg bench compute -b``;
- a memory-bound kernel of class ``stream``, ``norm`` or ``softmax`` moving ``B`` bytes of a
  dtype of width ``w``: ``gelu``, ``layer_norm`` or ``softmax`` of ``B / (2w)`` elements (one
  read, one write: the same bytes) as rows of at most :data:`MAX_COLUMNS` columns.

fp8 and int8 kernels are left out (``torch.mm`` does not run them); they are counted. The
config's ``"__stg__"`` key (skipped by PARAM and by stg, having no input_data_generator) lists
each case with the nodes and rank classes it stands for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stg.core.workload import NodeType, Workload
from stg.perf.calibration import Kernel, node_kernel

STG_TO_PARAM_DTYPE = {"fp32": "float", "tf32": "float", "bf16": "bfloat16", "fp16": "float16"}
"""stg dtypes that PARAM's data generator can make (data_impl.py's float dtypes)."""

MAX_COLUMNS = 8192
"""Columns of the 2-D tensors of memory-bound cases: the row length of the shared H100
elementwise measurements (data/kernels/h100-elementwise.jsonl, [rows, 8192])."""

GENERATOR = "PyTorch:DefaultDataGenerator"
MEMORY_OPS = {
    "stream": "torch.nn.functional.gelu",
    "norm": "torch.nn.functional.layer_norm",
    "softmax": "torch.softmax",
}
ATTENTION_OP = "torch.nn.functional.scaled_dot_product_attention"


def _tensor(dtype: str, shape: list[int], grad: bool) -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "shape": shape, "requires_grad": grad}


def kernel_case(kernel: Kernel) -> tuple[str, dict[str, Any]] | None:
    """(operator, input arg-set) that runs ``kernel``; None if PARAM cannot make its dtype."""
    dtype = STG_TO_PARAM_DTYPE.get(kernel.dtype)
    if dtype is None or kernel.key is None:
        return None
    if kernel.op_class == "gemm":
        batch, m, n, k = kernel.key
        if batch == 1:
            args = [_tensor(dtype, [m, k], False), _tensor(dtype, [k, n], False)]
            return "torch.mm", {"args": args}
        args = [_tensor(dtype, [batch, m, k], False), _tensor(dtype, [batch, k, n], False)]
        return "torch.bmm", {"args": args}
    if kernel.op_class == "attention":
        batch, heads, s_q, s_kv, head_dim, causal = kernel.key
        q = _tensor(dtype, [batch, heads, s_q, head_dim], True)
        kv = _tensor(dtype, [batch, heads, s_kv, head_dim], True)
        return ATTENTION_OP, {
            "args": [q, kv, dict(kv)],
            "kwargs": {"is_causal": {"type": "bool", "value": bool(causal)}},
        }
    width = {"float": 4, "bfloat16": 2, "float16": 2}[dtype]
    elements = max(1, round(kernel.key[0] / (2 * width)))
    columns = math.gcd(elements, MAX_COLUMNS)
    x = _tensor(dtype, [elements // columns, columns], False)
    op = MEMORY_OPS[kernel.op_class]
    if kernel.op_class == "norm":
        shape = {"type": "genericlist", "value": [{"type": "int", "value": columns}]}
        return op, {"args": [x, shape]}
    if kernel.op_class == "softmax":
        return op, {"args": [x, {"type": "int", "value": -1}]}
    return op, {"args": [x]}


@dataclass
class ModelConfig:
    """A workload's kernels as a PARAM config, with what each case stands for."""

    config: dict[str, Any]
    cases: list[dict[str, Any]] = field(default_factory=list)
    rank_classes: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)


def _compute_nodes(workload: Workload) -> Iterable[tuple[int, int, Any]]:
    for rc in workload.rank_classes:
        for node in rc.nodes:
            if node.type is NodeType.COMP:
                yield rc.index, rc.stage, node


def model_config(workload: Workload, options: Mapping[str, Any] | None = None) -> ModelConfig:
    """The PARAM config of the distinct kernels of ``workload`` (see the module docstring)."""
    default_dtype = str((options or {}).get("dtype") or "bf16")
    kernels: dict[tuple[Any, ...], dict[str, Any]] = {}
    skipped: dict[str, int] = {}
    per_class: dict[int, dict[str, Any]] = {}
    for rc_index, stage, node in _compute_nodes(workload):
        kernel = node_kernel(node, default_dtype)
        if kernel is None:
            continue
        if kernel.pass_ == "backward":  # one attention case stands for both passes
            kernel = Kernel(
                kernel.op_class, kernel.dtype, "forward", kernel.key, kernel.flops, kernel.nbytes
            )
        made = kernel_case(kernel)
        if made is None:
            why = f"{kernel.dtype} {kernel.op_class}" if kernel.key else "no kernel shape"
            skipped[why] = skipped.get(why, 0) + 1
            continue
        info = kernels.setdefault(
            (kernel.op_class, kernel.dtype, kernel.key),
            {
                "op": made[0],
                "argset": made[1],
                "kernel": kernel,
                "nodes": 0,
                "classes": set(),
                "example": node.name,
            },
        )
        info["nodes"] += 1
        info["classes"].add(rc_index)
        entry = per_class.setdefault(
            rc_index, {"rank_class": rc_index, "stage": stage, "kernels": set(), "nodes": 0}
        )
        entry["kernels"].add((kernel.op_class, kernel.dtype, kernel.key))
        entry["nodes"] += 1
    order = {"gemm": 0, "attention": 1, "stream": 2, "norm": 3, "softmax": 4}
    ordered = sorted(
        kernels.values(),
        key=lambda i: (order[i["kernel"].op_class], i["kernel"].dtype, i["kernel"].key),
    )
    config: dict[str, Any] = {}
    cases = []
    for info in ordered:
        op = info["op"]
        entry = config.setdefault(
            op, {"input_data_generator": GENERATOR, "config": [{"input": []}]}
        )
        inputs = entry["config"][0]["input"]
        kernel: Kernel = info["kernel"]
        cases.append(
            {
                "op": op,
                "id": f"0|0|{len(inputs)}",
                "op_class": kernel.op_class,
                "dtype": kernel.dtype,
                ("bytes" if kernel.op_class in MEMORY_OPS else kernel.op_class): (
                    kernel.key[0] if kernel.op_class in MEMORY_OPS else list(kernel.key or ())
                ),
                "nodes": info["nodes"],
                "rank_classes": sorted(info["classes"]),
                "example": info["example"],
            }
        )
        inputs.append(info["argset"])
    classes = []
    for rc_index in sorted(per_class):
        entry = per_class[rc_index]
        counts = {c: 0 for c in order}
        for kind, _, _ in entry["kernels"]:
            counts[kind] += 1
        classes.append(
            {"rank_class": rc_index, "stage": entry["stage"], "nodes": entry["nodes"], **counts}
        )
    config["__stg__"] = {
        "generated_by": "stg bench model",
        "options": dict(options or {}),
        "run": "stg bench compute CONFIG -b (attention cases are timed forward and backward)",
        "cases": cases,
    }
    return ModelConfig(config, cases, classes, skipped)


__all__ = ["MAX_COLUMNS", "ModelConfig", "kernel_case", "model_config"]
