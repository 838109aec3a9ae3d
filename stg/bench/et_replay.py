"""PARAM-style execution-trace replay: the aten operators of a PyTorch host execution trace as
a PARAM compute config, run with made-up tensors of the recorded shapes.

PARAM's ``et_replay`` re-runs the operators of a host execution trace with tensors of their
recorded shapes and dtypes. Here the distinct operators become a PARAM compute config, which
``stg bench compute`` (or PARAM itself) runs and ``stg bench calibrate`` turns into a table
keyed as the importer (:mod:`stg.trace.pytorch_et`) types the trace's nodes:

- the operators replayed are the trace's *top-level* aten operators (those with no operator
  above them, as et_replay runs them) that move data (views and collectives are left out;
  :func:`stg.trace.pytorch_et.host_trace_work`), each distinct (schema, arguments) once;
- each becomes ``aten::NAME`` with its schema as the build argument (stg's and PARAM's form
  for aten operators) and one input arg-set per distinct argument list: tensors of the
  recorded shape and dtype (``requires_grad`` false, as a replay needs no autograd), and the
  recorded scalars, lists, devices and dtypes; the arg-set also lists the recorded results
  under ``outputs`` (PARAM ignores the key), which the analysis needs for their bytes;
- an operator with an argument a config cannot make (a layout, a generator, an opaque
  object) is skipped and counted by reason.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stg.bench.config import RECORDED_OUTPUTS
from stg.trace.aten import ELEMENT_TYPES, schema_name, split_list_type
from stg.trace.pytorch_et import host_trace_work, load_host_trace

GENERATOR = "PyTorch:DefaultDataGenerator"

SCALAR_TYPES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int",
    4: "long",
    5: "float16",
    6: "float",
    7: "double",
    11: "bool",
    15: "bfloat16",
}
"""c10::ScalarType codes (c10/core/ScalarType.h) that an ExecutionTraceObserver records for a
``ScalarType`` argument -> PARAM dtype names."""


class UnsupportedArgument(ValueError):
    """A recorded argument that a PARAM config cannot make."""


def data_spec(type_name: str, shape: Any, value: Any) -> dict[str, Any]:
    """The PARAM data spec of one recorded argument (type, shape and value)."""
    if type_name.startswith("Tensor(") and type_name.endswith(")"):
        element = ELEMENT_TYPES.get(type_name[len("Tensor(") : -1])
        if element is None or not isinstance(shape, list):
            raise UnsupportedArgument(type_name)
        return {"type": "tensor", "dtype": element[0], "shape": shape, "requires_grad": False}
    items = split_list_type(type_name)
    if items is not None:
        shapes = shape if isinstance(shape, list) else [None] * len(items)
        values = value if isinstance(value, list) else [None] * len(items)
        if len(shapes) != len(items) or len(values) != len(items):
            raise UnsupportedArgument(type_name)
        return {
            "type": "genericlist",
            "value": [data_spec(t, s, v) for t, s, v in zip(items, shapes, values, strict=True)],
        }
    if type_name == "Int":
        return {"type": "int", "value": int(value)}
    if type_name == "Double":
        return {"type": "double", "value": float(value)}
    if type_name == "Bool":
        return {"type": "bool", "value": bool(value)}
    if type_name == "String":
        return {"type": "str", "value": str(value)}
    if type_name == "None":
        return {"type": "none"}
    if type_name == "Device":
        return {"type": "device", "value": str(value)}
    if type_name == "ScalarType" and value in SCALAR_TYPES:
        return {"type": "dtype", "value": SCALAR_TYPES[value]}
    raise UnsupportedArgument(type_name)


@dataclass
class ReplayConfig:
    """A PARAM config of a trace's operators and what went into it."""

    config: dict[str, Any] = field(default_factory=dict)
    operators: int = 0
    """Top-level aten operators of the trace that move data."""
    cases: int = 0
    """Distinct (schema, arguments) in the config."""
    skipped: Counter[str] = field(default_factory=Counter)


def _argset(node: Mapping[str, Any]) -> dict[str, Any]:
    inputs = node.get("inputs") or {}
    outputs = node.get("outputs") or {}
    args = [
        data_spec(t, s, v)
        for t, s, v in zip(
            inputs.get("types") or [],
            inputs.get("shapes") or [],
            inputs.get("values") or [],
            strict=False,
        )
    ]
    results = []
    for t, s, v in zip(
        outputs.get("types") or [],
        outputs.get("shapes") or [],
        outputs.get("values") or [],
        strict=False,
    ):
        try:
            results.append(data_spec(t, s, v))
        except UnsupportedArgument:
            continue  # a result of another kind moves no tensor data
    return {"args": args, RECORDED_OUTPUTS: results}


def replay_config(trace_path: str | Path) -> ReplayConfig:
    """The PARAM compute config of the distinct operators of a host execution trace."""
    trace = load_host_trace(trace_path)
    work = host_trace_work(trace)
    nodes = {n["id"]: n for n in trace["nodes"] if isinstance(n, dict)}
    made = ReplayConfig()
    items: dict[str, dict[str, list[dict[str, Any]]]] = {}
    seen: set[str] = set()
    for node_id, op in work.ops.items():
        if op.kind == "view":
            continue
        made.operators += 1
        schema = work.schemas[node_id]
        try:
            argset = _argset(nodes[node_id])
        except UnsupportedArgument as exc:
            made.skipped[f"{schema_name(schema)} (a {exc} argument)"] += 1
            continue
        key = json.dumps([schema, argset], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        made.cases += 1
        items.setdefault(schema_name(schema), {}).setdefault(schema, []).append(argset)
    for name in sorted(items):
        made.config[name] = {
            "build_data_generator": GENERATOR,
            "input_data_generator": GENERATOR,
            "config": [
                {"build": [{"args": [{"type": "str", "value": schema}]}], "input": argsets}
                for schema, argsets in sorted(items[name].items())
            ],
        }
    return made


def skipped_summary(skipped: Mapping[str, int]) -> Sequence[str]:
    """``<n> <op> (<reason>)`` per skipped kind, most first."""
    return [f"{n} {why}" for why, n in Counter(skipped).most_common()]


__all__ = ["ReplayConfig", "UnsupportedArgument", "data_spec", "replay_config", "skipped_summary"]
