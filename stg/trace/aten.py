"""What an aten operator of a PyTorch execution trace does, from its schema and tensors.

PyTorch's ExecutionTraceObserver records, for each operator, its schema (the ``op_schema``
attribute, e.g. ``aten::addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1,
Scalar alpha=1) -> Tensor``) and, per argument and result, a type (``Tensor(float)``,
``GenericList[Tensor(float),Tensor(float)]``, ``Int``, ...) and a shape. Read from those typed
records only (never from node names):

- a **view** returns tensors that alias an input without writing it (``-> Tensor(a)``): it
  moves no data;
- a **GEMM** is one of the matmul schemas (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
  ``linear``, ``matmul``): its
  ``(batch, m, n, k)``, the key of the calibration tables (:mod:`stg.perf.calibration`);
- any other operator is **memory-bound**: it reads its tensor arguments and writes its tensor
  results once (bytes at the dtypes' widths).

Pure Python; shared by the trace importer (:mod:`stg.trace.pytorch_et`) and ``stg bench``'s
analysis of the replayed operators, so that both key a kernel alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

ELEMENT_TYPES: dict[str, tuple[str, int]] = {
    "float": ("float", 4),
    "double": ("double", 8),
    "c10::Half": ("float16", 2),
    "c10::BFloat16": ("bfloat16", 2),
    "int": ("int", 4),
    "long int": ("long", 8),
    "long": ("long", 8),
    "short int": ("int16", 2),
    "short": ("int16", 2),
    "signed char": ("int8", 1),
    "unsigned char": ("uint8", 1),
    "bool": ("bool", 1),
    "c10::Float8_e4m3fn": ("float8_e4m3fn", 1),
    "c10::Float8_e5m2": ("float8_e5m2", 1),
}
"""Element types as the ExecutionTraceObserver writes them (C++ type names, in
``Tensor(<type>)``) -> (PARAM's dtype name, bytes per element)."""

STG_DTYPES = {
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "int8": "int8",
}
"""PARAM dtype names that have a stg dtype (:data:`stg.perf.system.DTYPES`)."""


_TENSOR = re.compile(r"^Tensor\((.+)\)$")


@dataclass(frozen=True)
class Tensor:
    """One recorded tensor: PARAM's dtype name, bytes per element and shape."""

    dtype: str
    width: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.width * math.prod(self.shape)


def tensor_of(type_name: str, shape: Any) -> Tensor | None:
    """The tensor of a recorded ``Tensor(<type>)`` and its shape, or None (another type, or
    an element type without a PARAM dtype)."""
    found = _TENSOR.match(type_name)
    if found is None or not isinstance(shape, list):
        return None
    element = ELEMENT_TYPES.get(found.group(1))
    if element is None or not all(isinstance(x, int) for x in shape):
        return None
    return Tensor(element[0], element[1], tuple(shape))


def split_list_type(type_name: str) -> list[str] | None:
    """``GenericList[Tensor(float),Tensor(float)]`` -> its element types (None otherwise)."""
    if not type_name.startswith("GenericList[") or not type_name.endswith("]"):
        return None
    inner = type_name[len("GenericList[") : -1]
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(inner):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    if inner:
        items.append(inner[start:])
    return items


def tensors(types: Sequence[str], shapes: Sequence[Any]) -> list[Tensor]:
    """Every tensor of recorded arguments or results, tensor lists included."""
    found: list[Tensor] = []
    for type_name, shape in zip(types, shapes, strict=False):
        single = tensor_of(type_name, shape)
        if single is not None:
            found.append(single)
            continue
        items = split_list_type(type_name)
        if items is not None and isinstance(shape, list):
            found.extend(tensors(items, shape))
    return found


def schema_name(schema: str) -> str:
    """``aten::add.Tensor(...) -> Tensor`` -> ``aten::add`` (the overload dropped)."""
    return schema.split("(", 1)[0].split(".", 1)[0].strip()


def base_name(schema: str) -> str:
    """``aten::add_.Tensor(...)`` -> ``add_``."""
    return schema_name(schema).split("::", 1)[-1]


def is_view(schema: str) -> bool:
    """Whether every tensor the schema returns aliases an input without writing it."""
    if "->" not in schema:
        return False
    returns = schema.rsplit("->", 1)[1]
    annotated = re.findall(r"Tensor(\([^)]*\))?", returns)
    if not annotated:
        return False
    return all(alias and "!" not in alias for alias in annotated)


def gemm_shape(base: str, operands: Sequence[Tensor]) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of a matmul schema from its tensor arguments in order
    (``linear``: input ``[..., k]`` times weight ``[n, k]`` transposed, the leading input
    dimensions flattened into ``m``; ``matmul`` of two matrices or two equal batches)."""
    if base == "linear" and len(operands) >= 2:
        x, w = operands[0].shape, operands[1].shape
        if len(w) == 2 and x and x[-1] == w[1]:
            return 1, math.prod(x[:-1]), w[0], w[1]
        return None
    if base in ("mm", "_scaled_mm", "matmul") and len(operands) >= 2:
        a, b = operands[0].shape, operands[1].shape
    elif base == "addmm" and len(operands) >= 3:
        a, b = operands[1].shape, operands[2].shape
    elif base == "bmm" and len(operands) >= 2:
        a, b = operands[0].shape, operands[1].shape
    elif base == "baddbmm" and len(operands) >= 3:
        a, b = operands[1].shape, operands[2].shape
    else:
        return None
    if len(a) == 2 and len(b) == 2 and a[1] == b[0]:
        return 1, a[0], b[1], a[1]
    if len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
        return a[0], a[1], b[2], a[2]
    return None


@dataclass(frozen=True)
class OpWork:
    """What one operator does: ``kind`` (``gemm``, ``memory`` or ``view``), its GEMM shape,
    FLOPs (2 per multiply-accumulate; 0 for memory-bound ops), bytes moved and the PARAM
    dtype of its first result (else first argument) tensor."""

    kind: str
    gemm: tuple[int, int, int, int] | None
    flops: int
    nbytes: int
    dtype: str | None
    elements: int = 0
    """Elements of the results (of the arguments where it returns none)."""


def op_work(schema: str, inputs: Iterable[Tensor], outputs: Iterable[Tensor]) -> OpWork:
    """The work of an operator from its schema and its recorded tensors."""
    args = list(inputs)
    results = list(outputs)
    first = results[0] if results else args[0] if args else None
    dtype = first.dtype if first is not None else None
    elements = sum(math.prod(t.shape) for t in (results or args))
    if is_view(schema):
        return OpWork("view", None, 0, 0, dtype, elements)
    nbytes = sum(t.nbytes for t in args) + sum(t.nbytes for t in results)
    shape = gemm_shape(base_name(schema), args)
    if shape is not None:
        batch, m, n, k = shape
        return OpWork("gemm", shape, 2 * batch * m * n * k, nbytes, dtype, elements)
    return OpWork("memory", None, 0, nbytes, dtype, elements)


__all__ = [
    "ELEMENT_TYPES",
    "STG_DTYPES",
    "OpWork",
    "Tensor",
    "base_name",
    "gemm_shape",
    "is_view",
    "op_work",
    "schema_name",
    "split_list_type",
    "tensor_of",
    "tensors",
]
