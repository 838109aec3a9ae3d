"""Run the cases of a PARAM compute config with PyTorch and write PARAM's result lines.

Timing follows PARAM's ``continuous_events`` mode: the forward pass runs ``warmup`` then
``iterations`` times back to back, each call timed on its own (CUDA events recorded around it
on a GPU, synchronised once at the end; ``time.perf_counter_ns`` on a CPU); with
``backward``, a second loop runs the forward untimed and times the backward. Times are in
milliseconds. On CUDA the peak memory of each loop (``torch.cuda.max_memory_allocated``, MB,
inputs included, as PARAM reports it) is recorded too.

PARAM's traps are handled: tensors of an in-place op (a schema that writes its first argument,
or an op registered ``inplace``) are made with ``requires_grad`` false, and so are integer and
bool tensors (autograd refuses them); a case that fails (bad shapes, an operator the device
lacks, out of memory) is recorded with its error and the run goes on. Like PARAM,
``torch.set_num_threads`` is set (to 1 by default) and the seeds are fixed at 0.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import math
import os
import platform
import random
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import stg
from stg.bench import ops as bench_ops
from stg.bench import require
from stg.bench.config import Case
from stg.bench.results import ResultWriter, quartiles
from stg.errors import UserError
from stg.host.records import BenchOp

PARAM_DTYPE_NAMES = {
    "float": "float32",
    "double": "float64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int": "int32",
    "long": "int64",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "bool": "bool",
}
"""PARAM's tensor dtype names -> torch dtype attribute names (data_impl.py's dtype map)."""


@dataclass(frozen=True)
class RunOptions:
    """How to run: device, warm-up and measured iterations, backward pass, CPU threads.

    Defaults: 3 warm-up and 10 measured iterations, as the shared H100 kernel measurements
    were taken (data/kernels/README.md); one CPU thread, as PARAM sets
    (``torch.set_num_threads(1)`` in its init_pytorch)."""

    device: str = "cpu"
    warmup: int = 3
    iterations: int = 10
    backward: bool = False
    threads: int | None = 1
    cuda_l2_cache: bool = True
    """PARAM's ``--cuda-l2-cache``: on (True) keeps the GPU's L2 between calls; off flushes it
    before each call by writing a device buffer the size of the L2."""
    nvtx: bool = False
    """Mark each call with an NVTX range (PARAM's ``[param|<op>|<id>|<tag>|forward]`` labels
    inside a ``param_bench:measure`` range), as the batches that ncu and nsys profile need."""

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise UserError(f"--warmup {self.warmup}: must be >= 0")
        if self.iterations < 1:
            raise UserError(f"--iterations {self.iterations}: must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads {self.threads}: must be >= 1")
        if self.nvtx and not self.device.startswith("cuda"):
            raise UserError(
                f"--nvtx marks CUDA work with NVTX ranges; it does not apply to --device "
                f"{self.device}"
            )
        if not self.cuda_l2_cache and not self.device.startswith("cuda"):
            raise UserError(
                f"--cuda-l2-cache off flushes a CUDA GPU's L2 cache between iterations; it does "
                f"not apply to --device {self.device} (PARAM flushes on CUDA only)"
            )


class _CaseFailure(Exception):
    """A case cannot run: the message is its error line."""


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# -- operators --------------------------------------------------------------------------------


def op_table(entries: Iterable[Any]) -> dict[str, BenchOp | str]:
    """Registered operators by name (registry entries or records); a name that several
    plugins registered maps to the error line naming them."""
    table: dict[str, BenchOp | str] = {}
    owners: dict[str, list[str]] = {}
    for entry in entries:
        record = getattr(entry, "item", entry)
        owners.setdefault(record.name, []).append(getattr(entry, "qualified", record.name))
        table[record.name] = record
    for name, who in owners.items():
        if len(who) > 1:
            table[name] = f"operator {name!r} is registered by several plugins: {', '.join(who)}"
    return table


def resolve_function(path: str) -> Callable[..., Any]:
    """``torch.nn.functional.gelu`` -> the function (the longest importable module prefix,
    then attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                target = getattr(target, attr)
        except AttributeError:
            break
        if callable(target):
            return target
        break
    raise _CaseFailure(f"cannot find the function {path!r}")


@dataclass
class _Operator:
    """What runs for one case: a callable and how to treat its tensors."""

    call: Callable[..., Any]
    inplace: bool = False
    module: Any = None
    schema: Any = None


def _aten_operator(torch: Any, case: Case) -> _Operator:
    build = case.build
    args = (build or {}).get("args") if isinstance(build, Mapping) else None
    hint = (
        f"{case.op_name} needs its schema as the build argument, e.g. "
        '{"build": [{"args": [{"type": "str", "value": "aten::add.Tensor(Tensor self, '
        'Tensor other, *, Scalar alpha=1) -> Tensor"}]}]}'
    )
    if not args:
        raise _CaseFailure(hint)
    first = args[0]
    namespace = case.op_name.split("::", 1)[1]
    base, _, _ = namespace.partition(".")
    if first.get("type") == "str":
        try:
            schema = torch._C.parse_schema(str(first.get("value")))
        except RuntimeError as exc:
            raise _CaseFailure(f"bad schema {first.get('value')!r}: {_one_line(exc)}") from None
        if schema.name != case.op_name.split(".", 1)[0]:
            raise _CaseFailure(
                f"the schema names {schema.name}, but the operator is {case.op_name}"
            )
        packet = getattr(torch.ops.aten, schema.name.split("::", 1)[1], None)
        if packet is None:
            raise _CaseFailure(f"this PyTorch has no operator {schema.name}")
        overload = getattr(packet, schema.overload_name or "default", None)
        if overload is None:
            raise _CaseFailure(f"this PyTorch has no overload {schema.name}.{schema.overload_name}")
        first_arg = schema.arguments[0] if schema.arguments else None
        alias = getattr(first_arg, "alias_info", None)
        inplace = bool(alias is not None and alias.is_write) or base.endswith("_")
        return _Operator(overload, inplace=inplace, schema=schema)
    if first.get("type") == "genericlist":  # PARAM's older form: the argument types only
        packet = getattr(torch.ops.aten, base, None)
        if packet is None:
            raise _CaseFailure(f"this PyTorch has no operator aten::{base}")
        return _Operator(packet, inplace=base.endswith("_"))
    raise _CaseFailure(hint)


def _operator(
    torch: Any, case: Case, op: BenchOp | str | None, names: Iterable[str] = ()
) -> _Operator:
    if isinstance(op, str):
        raise _CaseFailure(op)
    if op is None:
        if case.op_name.startswith("aten::"):
            return _aten_operator(torch, case)
        raise _CaseFailure(
            f"unknown operator {case.op_name!r}; allowed: {', '.join(sorted(names))}, "
            "or aten::NAME with its schema as the build argument"
        )
    function = op.function
    call = resolve_function(function) if isinstance(function, str) else function
    return _Operator(call, inplace=op.inplace, module=op if op.buildable else None)


# -- data ---------------------------------------------------------------------------------------


class _Materializer:
    """PARAM's DefaultDataGenerator: floats from ``torch.rand``, ints from
    ``randint(-10, 10)``, bools ``rand < 0.5``, 0-d tensors a uniform value in [-10, 10]."""

    def __init__(self, torch: Any, device: Any, rng: random.Random) -> None:
        self.torch = torch
        self.device = device
        self.rng = rng

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, PARAM_DTYPE_NAMES[name])

    def value(self, spec: Mapping[str, Any], no_grad: bool) -> Any:
        kind = spec["type"]
        if kind == "tensor":
            return self.tensor(spec, no_grad)
        if kind in ("int", "long"):
            if "value" in spec:
                return spec["value"]
            low, high = spec["value_range"]
            return self.rng.randint(low, high)
        if kind in ("float", "double"):
            if "value" in spec:
                return spec["value"]
            low, high = spec["value_range"]
            return self.rng.uniform(low, high)
        if kind == "bool":
            return spec["value"]
        if kind == "str":
            return spec.get("value", "")
        if kind == "device":
            return self.torch.device(spec["value"])
        if kind == "dtype":
            return self.dtype(spec["value"])
        if kind == "none":
            return None
        items = [self.value(item, no_grad) for item in spec["value"]]
        return tuple(items) if kind == "tuple" else items

    def tensor(self, spec: Mapping[str, Any], no_grad: bool) -> Any:
        torch = self.torch
        name = spec["dtype"]
        dtype = self.dtype(name)
        floating = name in ("float", "double", "float16", "bfloat16")
        grad = bool(spec.get("requires_grad", True)) and floating and not no_grad
        shape = list(spec["shape"])
        if not shape:
            value = torch.tensor(self.rng.uniform(-10.0, 10.0), device=self.device)
            return value.to(dtype).requires_grad_(grad)
        if floating:
            return torch.rand(*shape, dtype=dtype, device=self.device, requires_grad=grad)
        if name == "bool":
            return torch.rand(*shape, device=self.device) < 0.5
        return torch.randint(-10, 10, tuple(shape), dtype=dtype, device=self.device)

    def argset(
        self, argset: Mapping[str, Any] | None, no_grad: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        if not argset:
            return [], {}
        args = [self.value(spec, no_grad) for spec in argset.get("args") or []]
        kwargs = {k: self.value(v, no_grad) for k, v in (argset.get("kwargs") or {}).items()}
        return args, kwargs


def _schema_call(schema: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[list, dict]:
    """PARAM passes an aten op's arguments positionally in schema order, keyword-only ones
    included (``aten::add``'s ``alpha``); keyword-only ones go by name here."""
    if schema is None:
        return args, kwargs
    positional: list[Any] = []
    named = dict(kwargs)
    params = list(schema.arguments)
    if len(args) > len(params):
        raise _CaseFailure(f"{len(args)} arguments given; the schema takes {len(params)}")
    for value, param in zip(args, params, strict=False):
        if param.kwarg_only:
            named[param.name] = value
        else:
            positional.append(value)
    return positional, named


# -- timing ---------------------------------------------------------------------------------


def _first_tensor(torch: Any, out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, list | tuple):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    return None


class _Timer:
    """Per-call times in ms: CUDA events on a GPU, ``perf_counter_ns`` elsewhere."""

    def __init__(
        self, torch: Any, device: Any, flush: Any = None, label: str | None = None
    ) -> None:
        self.torch = torch
        self.cuda = device.type == "cuda"
        self.device = device
        self.flush = flush
        self.label = label

    def loop(
        self,
        count: int,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        before: Callable[[], Any] | None = None,
    ) -> tuple[list[float], Any, float | None]:
        """Run ``fn`` ``count`` times, each timed; ``before`` runs untimed before each call and
        its result is passed as the first argument. Returns times, last result, peak MB."""
        torch = self.torch
        times: list[float] = []
        out: Any = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(count)
            ]
            nvtx = torch.cuda.nvtx if self.label is not None else None
            whole = nvtx.range_start("param_bench:measure") if nvtx is not None else None
            for start, end in events:
                state = before() if before is not None else None
                if self.flush is not None:  # PARAM's L2 flush: outside the timed events
                    self.flush.zero_()
                mark = nvtx.range_start(self.label) if nvtx is not None else None
                start.record()
                out = fn(*args, **kwargs) if before is None else fn(state)
                end.record()
                if nvtx is not None:
                    nvtx.range_end(mark)
            if nvtx is not None:
                nvtx.range_end(whole)
            torch.cuda.synchronize(self.device)
            times = [start.elapsed_time(end) for start, end in events]
            peak = torch.cuda.max_memory_allocated(self.device) / 1048576
            return times, out, peak
        clock = time.perf_counter_ns
        if before is None and not kwargs:  # the common case, without an empty **{} per call
            for _ in range(count):
                t0 = clock()
                out = fn(*args)
                t1 = clock()
                times.append((t1 - t0) / 1e6)
        elif before is None:
            for _ in range(count):
                t0 = clock()
                out = fn(*args, **kwargs)
                t1 = clock()
                times.append((t1 - t0) / 1e6)
        else:
            for _ in range(count):
                state = before()
                t0 = clock()
                out = fn(state)
                t1 = clock()
                times.append((t1 - t0) / 1e6)
        return times, out, None


def time_back_to_back(
    torch: Any,
    fn: Callable[[], Any],
    *,
    warmup: int,
    iterations: int,
    min_event_ms: float,
    max_reps: int = 50,
    reps: int | None = None,
) -> tuple[list[float], int]:
    """Per-call milliseconds of ``fn`` on the current CUDA stream, ``warmup + iterations``
    timings (warm-up first), each of ``reps`` calls launched back to back between two CUDA
    events (the launches queue ahead of the GPU, as in a training step), and ``reps``: where not
    given, chosen from one timed call so that a timing lasts at least ``min_event_ms``, at most
    ``max_reps``. The measurement scripts in benchmarks/ time kernels with it."""
    if reps is None:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        once = max(start.elapsed_time(end), 1e-4)
        reps = max(1, min(max_reps, math.ceil(min_event_ms / once)))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(warmup + iterations)
    ]
    for start, end in events:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / reps for s, e in events], reps


def time_graph(torch: Any, fn: Callable[[], Any], *, replays: int, timings: int = 15) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (no host time):
    three eager warm-up calls, the capture, three warm-up replays, then ``timings`` timings of
    ``replays`` replays back to back between two CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(timings):
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def time_call(
    torch: Any,
    device: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    options: RunOptions,
    leaves: Sequence[Any] = (),
    label: str = "",
) -> tuple[dict[str, dict[str, list[float]]], str | None]:
    """PARAM's metric dict for one callable (forward, and backward when asked and possible),
    and why the backward was skipped (or None). ``label`` is the case's ``<op>|<id>``, for
    the NVTX ranges of :attr:`RunOptions.nvtx`."""
    flush = None
    if device.type == "cuda" and not options.cuda_l2_cache:
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        flush = torch.empty(max(int(l2_bytes), 1), dtype=torch.uint8, device=device)

    def timer_for(tag: str, pass_name: str) -> _Timer:
        name = f"[param|{label}|{tag}|{pass_name}]" if options.nvtx else None
        return _Timer(torch, device, flush, name if device.type == "cuda" else None)

    metric: dict[str, dict[str, list[float]]] = {}
    forward: dict[str, list[float]] = {}
    out: Any = None
    for tag, count in (("warmup", options.warmup), ("measure", options.iterations)):
        if count == 0:
            forward[f"{tag}.time"] = []
            continue
        times, out, peak = timer_for(tag, "forward").loop(count, fn, args, kwargs)
        forward[f"{tag}.time"] = times
        if peak is not None:
            forward[f"{tag}.gpu.memory"] = [peak]
    metric["forward"] = forward
    if not options.backward:
        return metric, None
    result = _first_tensor(torch, out)
    if result is None or not result.requires_grad:
        return metric, "backward skipped: the output does not require grad"
    grad = torch.ones_like(result)

    def forward_untimed() -> Any:
        for leaf in leaves:
            leaf.grad = None
        return _first_tensor(torch, fn(*args, **kwargs))

    def backward(value: Any) -> None:
        value.backward(grad)

    backward_metric: dict[str, list[float]] = {}
    for tag, count in (("warmup", options.warmup), ("measure", options.iterations)):
        if count == 0:
            backward_metric[f"{tag}.time"] = []
            continue
        timer = timer_for(tag, "backward")
        times, _, peak = timer.loop(count, backward, (), {}, before=forward_untimed)
        backward_metric[f"{tag}.time"] = times
        if peak is not None:
            backward_metric[f"{tag}.gpu.memory"] = [peak]
    metric["backward"] = backward_metric
    return metric, None


# -- the run ------------------------------------------------------------------------------------


def _leaves(torch: Any, values: Iterable[Any]) -> list[Any]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(_leaves(torch, value))
    return found


class Runner:
    """Runs cases on one device; :meth:`run_case` returns a result line (a dict)."""

    def __init__(self, options: RunOptions, ops: Mapping[str, BenchOp | str]) -> None:
        self.torch = require("torch", "stg bench compute")
        torch = self.torch
        self.options = options
        self.ops = ops
        try:
            self.device = torch.device(options.device)
        except RuntimeError as exc:
            raise UserError(f"--device {options.device!r}: {_one_line(exc)}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {options.device}: no CUDA device is available")
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        torch.manual_seed(0)
        self.rng = random.Random(0)

    def run_case(self, case: Case) -> dict[str, Any]:
        record: dict[str, Any] = {"op_name": case.op_name, "id": case.id}
        if case.error is not None:
            record.update(metric={}, config=case.config, error=case.error)
            return record
        op = self.ops.get(case.op_name)
        config = case.config
        try:
            metric, note, config = self._measure(case, op)
        except _CaseFailure as exc:
            record.update(metric={}, config=config, error=str(exc))
            return record
        except Exception as exc:  # a case must never abort the run (PARAM's does)
            record.update(metric={}, config=config, error=_one_line(exc))
            self._free()
            return record
        record.update(metric=metric, config=config)
        record["extra"] = self._extra(case, op if isinstance(op, BenchOp) else None, metric)
        if note:
            record["extra"]["note"] = note
        self._free()
        return record

    def _measure(
        self, case: Case, op: BenchOp | str | None
    ) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
        torch = self.torch
        operator = _operator(torch, case, op, self.ops)
        data = _Materializer(torch, self.device, self.rng)
        config = case.config
        if operator.inplace:
            config = _no_grad_config(config)
        call = operator.call
        if operator.module is not None:
            if not isinstance(case.build, Mapping):
                raise _CaseFailure(
                    f"{case.op_name} is built from a build arg-set; the config has none"
                )
            build_args, build_kwargs = data.argset(case.build, no_grad=True)
            try:
                built = call(*build_args, **build_kwargs)
            except Exception as exc:
                raise _CaseFailure(f"building {case.op_name} failed: {_one_line(exc)}") from None
            call = built.to(self.device) if hasattr(built, "to") else built
        args, kwargs = data.argset(case.input, no_grad=operator.inplace)
        args, kwargs = _schema_call(operator.schema, args, kwargs)
        leaves = _leaves(torch, [*args, *kwargs.values()])
        if hasattr(call, "parameters"):
            leaves += [p for p in call.parameters() if p.requires_grad]
        options = self.options
        if operator.inplace and options.backward:
            options = replace(options, backward=False)
        label = case.run_id
        if operator.inplace:
            with torch.no_grad():
                metric, note = time_call(
                    torch, self.device, call, args, kwargs, options, leaves, label
                )
            if self.options.backward:
                note = "backward skipped: the op works in place"
        else:
            metric, note = time_call(torch, self.device, call, args, kwargs, options, leaves, label)
        return metric, note, config

    def _free(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def _extra(self, case: Case, op: BenchOp | None, metric: Mapping[str, Any]) -> dict[str, Any]:
        return case_extra(case.op_name, case.config, metric, op, self._tf32())

    def _tf32(self) -> bool:
        torch = self.torch
        return self.device.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)

    def setup_line(self, argv: Sequence[str], out_path: str) -> dict[str, Any]:
        """PARAM's setup line: run options and system information."""
        torch = self.torch
        options = self.options
        cuda = self.device.type == "cuda"
        run_options = {
            "device": options.device,
            "pass_type": "ExecutionPass.BACKWARD" if options.backward else "ExecutionPass.FORWARD",
            "warmup": options.warmup,
            "iteration": options.iterations,
            "op_exec_mode": "OpExecutionMode.CONTINUOUS_EVENTS",
            "cuda_l2_cache": options.cuda_l2_cache,
            "time_unit": "millisecond",
            "out_file_prefix": out_path,
            "threads": options.threads,
            "cmd_args": list(argv),
        }
        info: dict[str, Any] = {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "python_version": platform.python_version(),
            "stg_version": stg.__version__,
            "cuda_available": bool(torch.cuda.is_available()),
        }
        if cuda:
            index = self.device.index if self.device.index is not None else 0
            props = torch.cuda.get_device_properties(index)
            info.update(
                cuda=torch.version.cuda,
                cuda_device_id=index,
                cuda_device_name=torch.cuda.get_device_name(index),
                cuda_device_property=str(props),
                cudnn=torch.backends.cudnn.version(),
                cudnn_enabled=bool(torch.backends.cudnn.enabled),
            )
        info.update(
            pytorch_version=torch.__version__,
            pytorch_debug_build=bool(torch.version.debug),
            cpu=platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
        )
        return {"run_options": run_options, "sys_info": info, "start_time": _now()}


def _no_grad_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with ``requires_grad`` false on every input tensor (what PARAM needs to run
    an in-place op; the result line records it so the line can be fed back to PARAM)."""
    inputs = dict(config.get("input") or {})

    def off(spec: Any) -> Any:
        if isinstance(spec, Mapping) and spec.get("type") == "tensor":
            return {**spec, "requires_grad": False}
        if isinstance(spec, Mapping) and spec.get("type") in ("genericlist", "tuple"):
            return {**spec, "value": [off(x) for x in spec.get("value") or []]}
        return spec

    inputs["args"] = [off(s) for s in inputs.get("args") or []]
    if "kwargs" in inputs:
        inputs["kwargs"] = {k: off(v) for k, v in inputs["kwargs"].items()}
    return {"build": config.get("build"), "input": inputs}


def _now() -> str:
    return _dt.datetime.now().replace(microsecond=0).isoformat()


def _dtype_of(config: Mapping[str, Any]) -> str | None:
    for spec in (config.get("input") or {}).get("args") or []:
        if isinstance(spec, Mapping) and spec.get("type") == "tensor":
            return str(spec.get("dtype"))
    return None


def case_extra(
    op_name: str,
    config: Mapping[str, Any],
    metric: Mapping[str, Any],
    op: BenchOp | None = None,
    tf32: bool = False,
) -> dict[str, Any]:
    """What stg adds to a result line: analytic work and the achieved rates.

    ``flops``/``bytes`` (forward), ``median_ms``, ``p25_ms``, ``p75_ms``, ``iqr_ms``,
    ``tflops``, ``gbps``; the same with ``_bwd`` for the backward pass; ``op_class``, the
    PARAM ``dtype`` of the first tensor, the kernel shape (``gemm`` or ``attention``)."""
    work = bench_ops.analysis(op_name, config, op)
    extra: dict[str, Any] = {"op_class": work.op_class, "dtype": _dtype_of(config)}
    if work.shape is not None and work.op_class in ("gemm", "attention"):
        extra[work.op_class] = list(work.shape)
    if tf32 and extra["dtype"] == "float" and work.op_class == "gemm":
        extra["tf32"] = True
    if work.flops is not None:
        extra["flops"] = work.flops
    if work.nbytes is not None:
        extra["bytes"] = work.nbytes
    for pass_name, suffix, flops in (
        ("forward", "", work.flops),
        ("backward", "_bwd", work.backward_flops),
    ):
        times = [float(t) for t in ((metric.get(pass_name) or {}).get("measure.time") or [])]
        if not times:
            continue
        p25, p50, p75 = quartiles(times)
        extra[f"median{suffix}_ms"] = p50
        extra[f"p25{suffix}_ms"] = p25
        extra[f"p75{suffix}_ms"] = p75
        extra[f"iqr{suffix}_ms"] = p75 - p25
        if suffix and flops is not None:
            extra["flops_bwd"] = flops
        if p50 > 0 and flops is not None:
            extra[f"tflops{suffix}"] = flops / (p50 * 1e-3) / 1e12
        if not suffix and p50 > 0 and work.nbytes is not None:
            extra["gbps"] = work.nbytes / (p50 * 1e-3) / 1e9
    return extra


def select_cases(
    cases: Sequence[Case], resume_id: str | None = None, stop_id: str | None = None
) -> list[Case]:
    """The cases PARAM runs with ``--resume-id`` and ``--stop_id`` (its BuildExecutor): cases
    are skipped until the one whose ``<op>|<id>`` is the resume id (which runs), and the run
    stops at the stop id (which does not run). An id that names no case is refused."""
    names = [case.run_id for case in cases]
    for option, wanted in (("--resume-id", resume_id), ("--stop-id", stop_id)):
        if wanted is not None and wanted not in names:
            sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise UserError(
                f"{option} {wanted!r} names no case of the config; ids are <op>|<id>: {sample}"
            )
    chosen: list[Case] = []
    running = resume_id is None
    for case, name in zip(cases, names, strict=True):
        if not running and name == resume_id:
            running = True
        if name == stop_id:
            break
        if running:
            chosen.append(case)
    return chosen


def trace_path(out: Path, index: int) -> Path:
    """Where ``--profile`` writes the Chrome trace of the ``index``-th case of a run whose
    results go to ``out`` (PARAM writes ``<prefix>_trace.json`` for its whole run)."""
    return out.with_name(f"{out.stem}_trace_{index}.json")


def _profiled(runner: Runner, case: Case, target: Path) -> dict[str, Any]:
    """Run one case under torch.profiler (CPU, and CUDA on a GPU) and write its Chrome trace."""
    torch = runner.torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(f"[param|{case.run_id}]"):
            record = runner.run_case(case)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    prof.export_chrome_trace(str(target))
    return record


def run_cases(
    runner: Runner,
    cases: Iterable[Case],
    writer: ResultWriter,
    *,
    argv: Sequence[str] = (),
    on_result: Callable[[dict[str, Any]], None] | None = None,
    traces: list[Path] | None = None,
) -> list[dict[str, Any]]:
    """Run every case, writing the setup line, one line per case and the finish line.

    With ``traces`` (a list), each case runs under torch.profiler: its Chrome trace is written
    to :func:`trace_path` and appended to ``traces``, and PARAM's ``{"trace_file": ...}`` line
    follows the case's line."""
    writer.write(runner.setup_line(argv, str(writer.path)))
    records = []
    for index, case in enumerate(cases):
        if traces is None:
            record = runner.run_case(case)
        else:
            target = trace_path(writer.path, index)
            traces.append(target)
            record = _profiled(runner, case, target)
        writer.write(record)
        if traces is not None:
            writer.write({"trace_file": str(traces[-1])})
        records.append(record)
        if on_result is not None:
            on_result(record)
    failed = sum(1 for r in records if "error" in r)
    writer.write({"finish_time": _now(), "cases": len(records), "failed": failed})
    return records


def iter_errors(records: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    """``<op>|<id>: <error>`` per failed case."""
    for record in records:
        if "error" in record:
            yield f"{record['op_name']}|{record['id']}: {record['error']}"


__all__ = [
    "RunOptions",
    "Runner",
    "case_extra",
    "iter_errors",
    "op_table",
    "resolve_function",
    "run_cases",
    "select_cases",
    "time_back_to_back",
    "time_call",
    "trace_path",
]
