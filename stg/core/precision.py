"""Per-op precision plans: which matmuls run in which precision.

A plan maps op-name patterns (``fnmatch``, matched against the op names of the model
templates: ``q``, ``k``, ``v``, ``attn_out``, ``fc1``, ``fc2``, ``gate``, ``up``, ``down``,
``scores``, ``context``, ``logits``, ``router``, ``expert_*``) to a dtype. The plan applies to
every layer alike and to the op's backward matmuls too. A matmul in a precision other than its
operands' gets cast nodes (``<op>.cast_<operand>``, one FLOP and a read and a write per
element) in front of it; it runs in that precision (its node's ``dtype``) and writes its
output in the activation dtype. The file format is JSON::

    {"ops": {"fc1": "int8", "fc2": "int8", "logits": "bf16"}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path

from stg.errors import UserError

PrecisionPlan = tuple[tuple[str, str], ...]

DTYPE_BYTES: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}
"""Bytes per element of every dtype stg knows (tf32 is stored as fp32)."""

DTYPES = tuple(DTYPE_BYTES)


def normalize_plan(ops: Mapping[str, str] | PrecisionPlan) -> PrecisionPlan:
    """Check a plan (pattern -> dtype) and return it in canonical, hashable form."""
    items = ops.items() if isinstance(ops, Mapping) else ops
    out = []
    for pattern, dtype in items:
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"precision plan: op pattern {pattern!r} must be a non-empty string")
        if dtype not in DTYPES:
            raise UserError(
                f"precision plan: dtype {dtype!r} of {pattern!r} must be one of {', '.join(DTYPES)}"
            )
        out.append((pattern, dtype))
    return tuple(out)


def load_plan(path: str | Path) -> PrecisionPlan:
    """Read a plan file ``{"ops": {pattern: dtype}}``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"precision plan {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"precision plan {path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ops"), dict):
        raise UserError(f'precision plan {path}: expected {{"ops": {{"<op>": "<dtype>"}}}}')
    return normalize_plan(data["ops"])


def dump_plan(plan: PrecisionPlan) -> str:
    """The JSON text of a plan, as :func:`load_plan` reads it."""
    return json.dumps({"ops": dict(plan)}, indent=2, sort_keys=True) + "\n"


class PrecisionPlanWarning(UserWarning):
    """A precision plan names an op that the model does not have (the plan entry does
    nothing)."""


def unmatched_patterns(plan: PrecisionPlan, op_names: Iterable[str]) -> list[str]:
    """The plan's op patterns that match none of ``op_names``, in plan order."""
    names = sorted(set(op_names))
    return [
        pattern
        for pattern in dict.fromkeys(p for p, _ in plan)
        if not any(fnmatchcase(name, pattern) for name in names)
    ]


def precision_of(plan: PrecisionPlan, op_name: str) -> str | None:
    """The dtype the plan gives the op (the last matching pattern wins), or None."""
    root = op_name.split(".grad_", 1)[0]
    found = None
    for pattern, dtype in plan:
        if fnmatchcase(root, pattern):
            found = dtype
    return found
