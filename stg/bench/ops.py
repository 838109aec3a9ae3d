"""The built-in operators of ``stg bench compute`` and what a measurement of each means.

The operators are registered through the ``stg_register_bench_ops`` hook like any plugin's
(this module is a built-in plugin module), as PARAM's ``workloads/pytorch/native_basic_ops.py``
registers its own: ``torch.mm``, ``torch.matmul``, ``torch.bmm``, ``torch.baddbmm``,
``torch.addmm``, ``torch.add``, ``torch.mul``, ``torch.add_`` (in place), the activations,
norms and softmax of ``torch.nn.functional``, ``scaled_dot_product_attention``,
``torch.nn.Linear`` (built from the config's build arg-set), and ``torch._scaled_mm`` and
``torch.Tensor.copy_`` (to read the kernel measurements that ship with stg's shared data).
``aten::NAME`` operators are not registered: :mod:`stg.bench.runner` runs any of them from
the schema given as the build argument, and :func:`analysis` reads the common ones.

Each operator's analytic figures are computed from a case's materialized config (forward):

- FLOPs: 2 per multiply-accumulate for matmuls (``2·m·n·k``); attention ``4·b·h·s_q·s_kv·d``,
  halved under causal masking, backward 2.5x the forward (stg.perf.kernel_time); memory-bound
  ops count the FLOPs per element of stg's model conventions (:data:`ELEMENT_FLOPS`).
- bytes: every tensor argument read once and the output written once, at their dtypes' widths.
- kernel shape: ``gemm`` = [batch, m, n, k] for ``C[m, n] = A[m, k]·B[k, n]``; ``attention`` =
  [batch, heads, s_q, s_kv, head_dim, causal]: the keys of the calibration table
  (:mod:`stg.perf.calibration`), the same as the ``gemm`` and ``attention`` attributes of
  generated compute nodes.

Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import stg
from stg.bench.config import RECORDED_OUTPUTS
from stg.host.records import BenchOp
from stg.perf.calibration import MEMORY_CLASSES
from stg.perf.kernel_time import ATTENTION_BACKWARD_WORK, memory_kind

DTYPE_WIDTH: dict[str, int] = {
    "float": 4,
    "double": 8,
    "float16": 2,
    "bfloat16": 2,
    "int": 4,
    "long": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element of the tensor dtypes of PARAM configs (torch's element sizes), and the
fp8 dtypes that the shared kernel measurements use."""

ELEMENT_FLOPS: dict[str, int] = {
    "add": 1,
    "mul": 1,
    "relu": 1,
    "copy": 0,
    "gelu": 8,  # tanh approximation: models/gpt.py GELU_FLOPS
    "silu": 4,  # models/llama.py: SWIGLU_FLOPS = silu (4) + the gate product (1)
    "layer_norm": 7,  # stg/core/symbolic.py GraphBuilder.layernorm
    "rms_norm": 4,  # stg/core/symbolic.py GraphBuilder.rmsnorm
    "dropout": 2,  # a random draw compared with p, then a multiply
    "softmax": 5,  # models/gpt.py SOFTMAX_FLOPS: scale, max, subtract+exp, sum, divide
}
"""FLOPs per output element of memory-bound ops, as stg's models count them."""

MEMORY_CLASS: dict[str, str] = {
    "add": "stream",
    "mul": "stream",
    "relu": "stream",
    "copy": "stream",
    "gelu": "stream",
    "silu": "stream",
    "layer_norm": "norm",
    "rms_norm": "norm",
    "dropout": "norm",
    "softmax": "softmax",
}
"""Memory-bound kernel class of each op (stg.perf.kernel_time's MEMORY_KERNEL_EFFICIENCY)."""


# -- reading a case's config -------------------------------------------------------------------


class _Config:
    """The positional and keyword data specs of a materialized config."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        inputs = config.get("input") or {}
        self.args: list[Any] = list(inputs.get("args") or [])
        self.kwargs: dict[str, Any] = dict(inputs.get("kwargs") or {})
        self.build: Any = config.get("build")

    def spec(self, index: int, name: str | None = None) -> Mapping[str, Any] | None:
        if index < len(self.args):
            return self.args[index]
        if name is not None:
            return self.kwargs.get(name)
        return None

    def tensor(self, index: int, name: str | None = None) -> tuple[list[int], int]:
        """Shape and element width of a tensor argument; ValueError if it is not one."""
        spec = self.spec(index, name)
        if not isinstance(spec, Mapping) or spec.get("type") != "tensor":
            raise ValueError(f"argument {name or index} is not a tensor")
        shape = [int(x) for x in spec.get("shape") or []]
        return shape, DTYPE_WIDTH.get(str(spec.get("dtype")), 4)

    def tensors(self) -> list[tuple[list[int], int]]:
        specs = [*self.args, *self.kwargs.values()]
        return [
            ([int(x) for x in s.get("shape") or []], DTYPE_WIDTH.get(str(s.get("dtype")), 4))
            for s in specs
            if isinstance(s, Mapping) and s.get("type") == "tensor"
        ]

    def value(self, index: int, name: str, default: Any = None) -> Any:
        spec = self.spec(index, name)
        if isinstance(spec, Mapping) and "value" in spec:
            return spec["value"]
        return default


def _elements(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _broadcast(*shapes: Sequence[int]) -> list[int]:
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(ndim):
        sizes = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return out


@dataclass(frozen=True)
class Analysis:
    """What a case's config says about its work: op class, kernel shape, FLOPs, bytes."""

    op_class: str
    shape: tuple[int, ...] | None
    flops: float | None
    nbytes: float | None
    backward_flops: float | None


# -- matmuls -------------------------------------------------------------------------------------


def _gemm(batch: int, m: int, n: int, k: int) -> tuple[int, ...]:
    return (batch, m, n, k)


def _out_width(width: int) -> int:
    return max(width, 2)  # fp8/int8 GEMMs write a 16-bit output


def _mm_parts(c: _Config, a_index: int = 0) -> tuple[tuple[int, ...], float]:
    (a, wa), (b, wb) = c.tensor(a_index, "self"), c.tensor(a_index + 1, "mat2")
    if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
        raise ValueError(f"mm needs [m, k] x [k, n], got {a} x {b}")
    m, k, n = a[0], a[1], b[1]
    nbytes = m * k * wa + k * n * wb + m * n * _out_width(wa)
    return _gemm(1, m, n, k), float(nbytes)


def _bmm_parts(c: _Config, a_index: int = 0) -> tuple[tuple[int, ...], float]:
    (a, wa), (b, wb) = c.tensor(a_index, "batch1"), c.tensor(a_index + 1, "batch2")
    if len(a) != 3 or len(b) != 3 or a[0] != b[0] or a[2] != b[1]:
        raise ValueError(f"bmm needs [b, m, k] x [b, k, n], got {a} x {b}")
    batch, m, k, n = a[0], a[1], a[2], b[2]
    nbytes = batch * (m * k * wa + k * n * wb + m * n * _out_width(wa))
    return _gemm(batch, m, n, k), float(nbytes)


def _matmul_parts(c: _Config) -> tuple[tuple[int, ...], float]:
    (a, wa), (b, wb) = c.tensor(0, "input"), c.tensor(1, "other")
    if not a or not b:
        raise ValueError("matmul needs tensors of at least one dimension")
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul shapes {a} and {b} do not match")
    batch = _elements(_broadcast(a2[:-2], b2[:-2]))
    m, k, n = a2[-2], a2[-1], b2[-1]
    nbytes = _elements(a) * wa + _elements(b) * wb + batch * m * n * _out_width(wa)
    return _gemm(batch, m, n, k), float(nbytes)


def _gemm_flops(shape: tuple[int, ...]) -> float:
    batch, m, n, k = shape
    return 2.0 * batch * m * n * k


def _linear_features(c: _Config) -> tuple[int, int, bool, int | None]:
    build = c.build if isinstance(c.build, Mapping) else {}
    b = _Config({"input": build})
    in_features = b.value(0, "in_features")
    out_features = b.value(1, "out_features")
    bias = b.value(2, "bias", True)
    dtype = b.value(4, "dtype")
    if not isinstance(in_features, int) or not isinstance(out_features, int):
        raise ValueError("torch.nn.Linear is built from in_features and out_features")
    width = DTYPE_WIDTH.get(str(dtype)) if dtype is not None else None
    return in_features, out_features, bool(bias), width


def _linear_parts(c: _Config) -> tuple[tuple[int, ...], float]:
    in_features, out_features, bias, width = _linear_features(c)
    x, wx = c.tensor(0, "input")
    if not x or x[-1] != in_features:
        raise ValueError(f"Linear({in_features}, {out_features}) cannot take input {x}")
    m = _elements(x[:-1])
    ww = width or 4
    nbytes = m * in_features * wx + in_features * out_features * ww + m * out_features * wx
    if bias:
        nbytes += out_features * ww
    return _gemm(1, m, out_features, in_features), float(nbytes)


def _aten_linear_parts(c: _Config) -> tuple[tuple[int, ...], float]:
    (x, wx), (w, ww) = c.tensor(0, "input"), c.tensor(1, "weight")
    if len(w) != 2 or not x or x[-1] != w[1]:
        raise ValueError(f"linear needs input [..., in] and weight [out, in], got {x} and {w}")
    m = _elements(x[:-1])
    nbytes = m * w[1] * wx + w[0] * w[1] * ww + m * w[0] * wx
    return _gemm(1, m, w[0], w[1]), float(nbytes)


def _with_input(
    parts: Callable[[_Config], tuple[tuple[int, ...], float]], index: int, name: str
) -> Callable[[_Config], tuple[tuple[int, ...], float]]:
    """A matmul with an added ``input`` tensor (baddbmm, addmm): its bytes count too."""

    def read(c: _Config) -> tuple[tuple[int, ...], float]:
        shape, nbytes = parts(c)
        extra, width = c.tensor(index, name)
        return shape, nbytes + _elements(extra) * width

    return read


# -- attention -----------------------------------------------------------------------------------


def _attention_parts(c: _Config) -> tuple[tuple[int, ...], float, float]:
    (q, wq), (k, wk), (v, wv) = c.tensor(0, "query"), c.tensor(1, "key"), c.tensor(2, "value")
    if len(q) < 3 or len(k) != len(q) or len(v) != len(q):
        raise ValueError(f"attention needs q, k, v of 3 or 4 dimensions, got {q}, {k}, {v}")
    causal = bool(c.value(5, "is_causal", False))
    batch = _elements(q[:-3]) if len(q) > 3 else q[0]
    heads = q[-3] if len(q) > 3 else 1
    s_q, head_dim = q[-2], q[-1]
    s_kv, value_dim = k[-2], v[-1]
    if k[-1] != head_dim or v[-2] != s_kv:
        raise ValueError(f"attention shapes q {q}, k {k}, v {v} do not match")
    flops = 2.0 * batch * heads * s_q * s_kv * (head_dim + value_dim)
    if causal:
        flops /= 2
    out = _elements(q[:-1]) * value_dim
    nbytes = _elements(q) * wq + _elements(k) * wk + _elements(v) * wv + out * wq
    return (batch, heads, s_q, s_kv, head_dim, int(causal)), flops, float(nbytes)


# -- memory-bound ops ----------------------------------------------------------------------------


def _elementwise_parts(c: _Config) -> tuple[int, float]:
    """Output elements and bytes: every tensor argument read, the broadcast output written."""
    tensors = c.tensors()
    if not tensors:
        raise ValueError("no tensor argument")
    out_shape = _broadcast(*(shape for shape, _ in tensors))
    width = tensors[0][1]
    elements = _elements(out_shape)
    nbytes = sum(_elements(shape) * w for shape, w in tensors) + elements * width
    return elements, float(nbytes)


def _unary_parts(c: _Config) -> tuple[int, float]:
    shape, width = c.tensor(0, "input")
    n = _elements(shape)
    return n, 2.0 * n * width


# -- analysis by op name -------------------------------------------------------------------------


_GEMM_PARTS: dict[str, Callable[[_Config], tuple[tuple[int, ...], float]]] = {
    "mm": _mm_parts,
    "_scaled_mm": _mm_parts,
    "bmm": _bmm_parts,
    "matmul": _matmul_parts,
    "baddbmm": _with_input(lambda c: _bmm_parts(c, 1), 0, "self"),
    "addmm": _with_input(lambda c: _mm_parts(c, 1), 0, "self"),
    "linear": _aten_linear_parts,
    "Linear": _linear_parts,
}
_UNARY = ("relu", "gelu", "silu", "layer_norm", "rms_norm", "dropout", "softmax", "copy")
_ATTENTION = ("scaled_dot_product_attention",)


def base_name(op_name: str) -> str:
    """``torch.nn.functional.gelu`` -> ``gelu``; ``aten::add_.Tensor`` -> ``add``;
    ``torch._softmax`` -> ``softmax``; ``torch.Tensor.copy_`` -> ``copy``."""
    name = op_name.split("::", 1)[-1]
    parts = name.split(".")
    # aten overloads (add.Tensor) follow the name; dotted torch paths end with it
    last = parts[0] if "::" in op_name else parts[-1]
    last = last.rstrip("_")
    return last.lstrip("_") if last.lstrip("_") in _UNARY else last


def analysis(op_name: str, config: Mapping[str, Any], op: BenchOp | None = None) -> Analysis:
    """The op class, kernel shape, FLOPs and bytes of one case (``None`` where unknown).

    A registered :class:`BenchOp` answers through its own functions; other names (``aten::``
    ops, PARAM's result files) by their base name."""
    if op is not None and op.name != op_name:
        op = None
    if op is None and op_name.startswith("aten::") and _recorded_outputs(config) is not None:
        return recorded_analysis(op_name, config)
    if op is None:
        op = BUILTIN_BY_NAME.get(op_name) or _by_base_name(op_name)
    if op is None:
        return Analysis("other", None, None, None, None)

    def safely(fn: Callable[[Mapping[str, Any]], Any] | None) -> Any:
        if fn is None:
            return None
        try:
            return fn(config)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None

    shape = safely(op.shape)
    return Analysis(
        op.op_class,
        tuple(int(x) for x in shape) if shape is not None else None,
        safely(op.flops),
        safely(op.nbytes),
        safely(op.backward_flops),
    )


def _recorded_outputs(config: Mapping[str, Any]) -> list[Any] | None:
    outputs = (config.get("input") or {}).get(RECORDED_OUTPUTS)
    return outputs if isinstance(outputs, list) else None


def _spec_tensors(specs: Sequence[Any]) -> list[tuple[list[int], int]]:
    found: list[tuple[list[int], int]] = []
    for spec in specs:
        if not isinstance(spec, Mapping):
            continue
        if spec.get("type") == "tensor":
            width = DTYPE_WIDTH.get(str(spec.get("dtype")), 4)
            found.append(([int(x) for x in spec.get("shape") or []], width))
        elif spec.get("type") in ("genericlist", "tuple"):
            found.extend(_spec_tensors(spec.get("value") or []))
    return found


def recorded_analysis(op_name: str, config: Mapping[str, Any]) -> Analysis:
    """An aten operator replayed from an execution trace, analysed as the trace importer
    types its node (:func:`stg.trace.aten.op_work`): a matmul by its GEMM shape, any other
    operator as a memory-bound kernel of its name's class that reads its tensor arguments
    and writes its recorded results, one op per written element."""
    c = _Config(config)
    base = base_name(op_name)
    if base in _GEMM_PARTS:
        parts = _GEMM_PARTS[base]
        try:
            shape = parts(c)[0]
        except (ValueError, TypeError, KeyError, IndexError):
            shape = None
        if shape is not None:
            flops = _gemm_flops(shape)
            nbytes = _recorded_bytes(c, config)
            return Analysis("gemm", tuple(int(x) for x in shape), flops, nbytes, 2 * flops)
    outputs = _spec_tensors(_recorded_outputs(config) or [])
    written = outputs or _spec_tensors([*c.args, *c.kwargs.values()])
    elements = sum(_elements(shape) for shape, _ in written)
    kind = memory_kind(op_name)
    op_class = kind if kind in MEMORY_CLASSES else "stream"
    return Analysis(op_class, None, float(max(elements, 1)), _recorded_bytes(c, config), None)


def _recorded_bytes(c: _Config, config: Mapping[str, Any]) -> float:
    tensors = _spec_tensors([*c.args, *c.kwargs.values()])
    tensors += _spec_tensors(_recorded_outputs(config) or [])
    return float(sum(_elements(shape) * width for shape, width in tensors))


def _by_base_name(op_name: str) -> BenchOp | None:
    base = base_name(op_name)
    if base in _GEMM_PARTS or base in _UNARY or base in _ATTENTION or base in ("add", "mul"):
        return _make(op_name, _analysis_only, base)
    return None


def _analysis_only(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this operator record only analyses configs; it does not run")


# -- the records ---------------------------------------------------------------------------------


def _make(name: str, fn: str | Callable[..., Any], base: str, **extra: Any) -> BenchOp:
    """The BenchOp of ``name`` whose analysis is that of the op ``base``."""
    if base in _GEMM_PARTS:
        parts = _GEMM_PARTS[base]
        return BenchOp(
            name=name,
            function=fn,
            op_class="gemm",
            shape=lambda config: parts(_Config(config))[0],
            flops=lambda config: _gemm_flops(parts(_Config(config))[0]),
            backward_flops=lambda config: 2 * _gemm_flops(parts(_Config(config))[0]),
            nbytes=lambda config: parts(_Config(config))[1],
            **extra,
        )
    if base in _ATTENTION:
        return BenchOp(
            name=name,
            function=fn,
            op_class="attention",
            shape=lambda config: _attention_parts(_Config(config))[0],
            flops=lambda config: _attention_parts(_Config(config))[1],
            backward_flops=lambda config: (
                ATTENTION_BACKWARD_WORK * _attention_parts(_Config(config))[1]
            ),
            nbytes=lambda config: _attention_parts(_Config(config))[2],
            **extra,
        )
    per_element = ELEMENT_FLOPS[base]
    parts_of = _elementwise_parts if base in ("add", "mul") else _unary_parts
    return BenchOp(
        name=name,
        function=fn,
        op_class=MEMORY_CLASS[base],
        flops=lambda config: float(per_element * parts_of(_Config(config))[0]),
        nbytes=lambda config: parts_of(_Config(config))[1],
        **extra,
    )


_F = "torch.nn.functional."
BUILTIN_OPS: tuple[BenchOp, ...] = (
    _make("torch.mm", "torch.mm", "mm", description="C = A·B"),
    _make("torch.matmul", "torch.matmul", "matmul", description="broadcasting matmul"),
    _make("torch.bmm", "torch.bmm", "bmm", description="batched C = A·B"),
    _make("torch.baddbmm", "torch.baddbmm", "baddbmm", description="beta·input + alpha·A·B"),
    _make("torch.addmm", "torch.addmm", "addmm", description="beta·input + alpha·A·B"),
    _make("torch._scaled_mm", "torch._scaled_mm", "_scaled_mm", description="fp8 GEMM (CUDA)"),
    _make("torch.nn.Linear", "torch.nn.Linear", "Linear", buildable=True, description="y = xW^T+b"),
    _make("torch.add", "torch.add", "add"),
    _make("torch.mul", "torch.mul", "mul"),
    _make("torch.add_", "torch.Tensor.add_", "add", inplace=True, description="in place"),
    _make(f"{_F}relu", f"{_F}relu", "relu"),
    _make(f"{_F}gelu", f"{_F}gelu", "gelu"),
    _make(f"{_F}silu", f"{_F}silu", "silu"),
    _make(f"{_F}layer_norm", f"{_F}layer_norm", "layer_norm"),
    _make(f"{_F}rms_norm", f"{_F}rms_norm", "rms_norm"),
    _make(f"{_F}dropout", f"{_F}dropout", "dropout"),
    _make(f"{_F}softmax", f"{_F}softmax", "softmax"),
    _make("torch.softmax", "torch.softmax", "softmax"),
    _make("torch.Tensor.copy_", "torch.Tensor.copy_", "copy", inplace=True),
    _make(
        f"{_F}scaled_dot_product_attention",
        f"{_F}scaled_dot_product_attention",
        "scaled_dot_product_attention",
        description="fused attention (SDPA)",
    ),
)
BUILTIN_BY_NAME: dict[str, BenchOp] = {op.name: op for op in BUILTIN_OPS}


@stg.hookimpl
def stg_register_bench_ops(register: Callable[[BenchOp], None]) -> None:
    for op in BUILTIN_OPS:
        register(op)


__all__ = [
    "BUILTIN_OPS",
    "DTYPE_WIDTH",
    "ELEMENT_FLOPS",
    "MEMORY_CLASS",
    "Analysis",
    "analysis",
    "base_name",
    "recorded_analysis",
]
