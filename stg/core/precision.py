"""Per-op precision plans: which matmuls run in which precision.

A plan maps op-name patterns (``fnmatch``, matched against the op names of the model
templates: ``q``, ``k``, ``v``, ``attn_out``, ``fc1``, ``fc2``, ``gate``, ``up``, ``down``,
``scores``, ``context``, ``logits``, ``router``, ``expert_*``) to a dtype. The plan applies to
every layer alike and to the op's backward matmuls too. A matmul in a precision other than its
operands' gets cast nodes (``<op>.cast_<operand>``, one FLOP and a read and a write per
element) in front of it; it runs in that precision (its node's ``dtype``) and writes its
output in the activation dtype. The file format is JSON::

    {"ops": {"fc1": "int8", "fc2": "int8", "logits": "bf16"}}

In a serving phase an entry that names a weight format (``fp8``, ``int8``, ``w4a16``,
``nvfp4``, ``mxfp8``, ``mxfp4``; :mod:`stg.core.quantization`) stores the op's weight in that
format instead of casting it: serving engines quantize weights once, offline. The formats that
are not dtypes are serving-only.

On a hybrid cluster (:mod:`stg.perf.hybrid`) a plan may also give each device group its
own entries, which apply after (and so override) the common ``ops``::

    {"ops": {"logits": "fp16"}, "groups": {"t4": {"fc1": "int8", "fc2": "int8"}}}

In the canonical plan a group's entry is the pattern ``<group>:<op pattern>``; a plan without
groups is the one-group case. The ranks of each group run :func:`plan_for_group` of the plan.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path

from stg.core.quantization import FORMAT_ONLY
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

PLAN_VALUES = (*DTYPES, *FORMAT_ONLY)
"""What a plan entry may name: a dtype, or a serving weight format."""


def normalize_plan(ops: Mapping[str, str] | PrecisionPlan) -> PrecisionPlan:
    """Check a plan (pattern -> dtype) and return it in canonical, hashable form."""
    items = ops.items() if isinstance(ops, Mapping) else ops
    out = []
    for pattern, dtype in items:
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"precision plan: op pattern {pattern!r} must be a non-empty string")
        if dtype not in PLAN_VALUES:
            raise UserError(
                f"precision plan: dtype {dtype!r} of {pattern!r} must be one of "
                f"{', '.join(PLAN_VALUES)}"
            )
        out.append((pattern, dtype))
    return tuple(out)


def load_plan(path: str | Path) -> PrecisionPlan:
    """Read a plan file ``{"ops": {pattern: dtype}, "groups": {group: {pattern: dtype}}}``
    (``groups`` optional; ``ops`` optional where ``groups`` is given)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"precision plan {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"precision plan {path}: not readable JSON ({exc})") from None
    expected = (
        f'precision plan {path}: expected {{"ops": {{"<op>": "<dtype>"}}}} or '
        f'{{"groups": {{"<device group>": {{"<op>": "<dtype>"}}}}}}'
    )
    if not isinstance(data, dict) or not ({"ops", "groups"} & set(data)):
        raise UserError(expected)
    extra = sorted(set(data) - {"ops", "groups"})
    if extra:
        raise UserError(f"precision plan {path}: unknown key {extra[0]!r}; allowed: groups, ops")
    ops = data.get("ops", {})
    groups = data.get("groups", {})
    if not isinstance(ops, dict) or not isinstance(groups, dict):
        raise UserError(expected)
    entries = list(ops.items())
    for group, group_ops in groups.items():
        if not group or ":" in group or not isinstance(group_ops, dict):
            raise UserError(f"precision plan {path}: groups.{group}: {expected.split(': ', 1)[1]}")
        entries.extend((f"{group}:{pattern}", dtype) for pattern, dtype in group_ops.items())
    return normalize_plan(entries)


def dump_plan(plan: PrecisionPlan) -> str:
    """The JSON text of a plan, as :func:`load_plan` reads it."""
    common = {p: d for p, d in plan if ":" not in p}
    groups: dict[str, dict[str, str]] = {}
    for pattern, dtype in plan:
        if ":" in pattern:
            group, op = pattern.split(":", 1)
            groups.setdefault(group, {})[op] = dtype
    data: dict[str, object] = {"ops": common}
    if groups:
        data["groups"] = groups
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def plan_groups(plan: PrecisionPlan) -> list[str]:
    """The device groups a plan names (``<group>:<op>`` entries), in order of appearance."""
    return list(dict.fromkeys(p.split(":", 1)[0] for p, _ in plan if ":" in p))


def plan_for_group(plan: PrecisionPlan, group: str | None) -> PrecisionPlan:
    """The one-group plan that ranks of device group ``group`` run: the common entries, then
    the group's own (so they win)."""
    common = tuple((p, d) for p, d in plan if ":" not in p)
    if group is None:
        return common
    prefix = f"{group}:"
    own = tuple((p[len(prefix) :], d) for p, d in plan if p.startswith(prefix))
    return common + own


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
