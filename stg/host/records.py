"""Typed records that plugins register, checked when they are registered.

Each record is a frozen dataclass; ``__post_init__`` rejects a malformed record with a
:class:`RecordError` naming the field, so a plugin author sees the mistake at load time.
The plugin host fills in ``plugin`` and ``dist`` (provenance) when it accepts a record.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pathlib import Path

    from stg.core.workload import Workload

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")
KERNEL_OP_CLASSES = ("einsum", "gemm", "attention", "elementwise", "other")
BENCH_OP_CLASSES = ("gemm", "attention", "stream", "norm", "softmax", "other")
"""Op classes of :class:`BenchOp`: what a measurement of the op calibrates (GEMMs, fused
attention, and the memory-bound kernel classes of :mod:`stg.perf.kernel_time`)."""
BENCH_OP_NAME_RE = re.compile(r"^[A-Za-z_]\w*(?:(?:\.|::)[A-Za-z_]\w*)*$")
"""Operator names as PARAM's configs spell them: ``torch.mm``, ``torch.nn.Linear``,
``aten::add``, ``mylib.fused_rope``."""
MODEL_OPTIONS: tuple[str, ...] = (
    "attention_window",
    "attention_chunk",
    "full_attention_every",
    "attention_sinks",
    "attention_output_gate",
    "layer_pattern",
    "mlp_activation",
    "ssm_state",
    "ssm_heads",
    "ssm_head_dim",
    "ssm_groups",
    "ssm_chunk",
    "linear_key_heads",
    "linear_value_heads",
    "linear_head_dim",
    "index_topk",
    "index_heads",
    "index_head_dim",
    "tie_embeddings",
)
"""Options that only some models read (attention variants, hybrid stacks): one that is set
while no part of the chosen model reads it is refused
(:func:`stg.core.options.check_options_read`); a preset may set them."""
PRESET_DIMS = (
    "dvocal",
    "dmodel",
    "dff",
    "seq",
    "head",
    "kvhead",
    "dhead",
    "num_stacks",
    "experts",
    "kexperts",
    "capacity_factor",
    "shared_experts",
    "dense_layers",
    "dense_dff",
    "q_lora_rank",
    "kv_lora_rank",
    "drope",
    *MODEL_OPTIONS,
    "causal",
)
"""The options a :class:`Preset` may set: the model's dimensions (fields of
:class:`stg.core.options.GenerateOptions`), never parallelism, batch or output."""


class RecordError(ValueError):
    """A plugin registered something malformed."""


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RecordError(
            f"{kind} name {name!r} must be lower-case letters, digits, '_', '-' or '.', "
            "starting with a letter or digit"
        )


def _check_callable(kind: str, name: str, field_name: str, value: object) -> None:
    if not callable(value):
        raise RecordError(f"{kind} {name!r}: {field_name} must be callable, got {value!r}")


@dataclass(frozen=True)
class Model:
    """A model template: forward-only builders for the three parts of a decoder LM.

    ``embedding`` builds what runs on the first pipeline stage before the layer stack,
    ``block`` one layer of the stack, ``head`` what runs on the last stage after it (final
    norm, LM head, loss). Each is called as ``fn(builder, x)`` with a
    :class:`stg.core.symbolic.GraphBuilder` and the incoming activation (``None`` for the embedding)
    and returns the outgoing activation (``None`` for the head).

    ``block`` is ``None`` for a model without a repeated layer stack (a convolutional network,
    whose stages differ in shape): its embedding builds the body and its head receives the
    embedding's output as it is (any dimensions); ``--num_stacks`` does not apply and there
    is nothing to split into pipeline stages.

    ``stack`` (optional) makes the layer stack of several block kinds (DeepSeek-V3: dense
    layers, then MoE layers): ``stack(options)`` gets the run's options as a mapping and
    returns runs ``(kind, block_function, count)`` in layer order, whose counts sum to
    ``options["num_stacks"]``. Without it every layer is ``block`` (kind ``"block"``).
    """

    name: str
    embedding: Callable[..., Any]
    block: Callable[..., Any] | None
    head: Callable[..., Any]
    description: str = ""
    aliases: tuple[str, ...] = ()
    stack: Callable[[Mapping[str, Any]], Sequence[tuple[str, Callable[..., Any], int]]] | None = (
        None
    )

    def __post_init__(self) -> None:
        _check_name("model", self.name)
        for alias in self.aliases:
            _check_name("model alias", alias)
        for field_name in ("embedding", "block", "head"):
            if field_name == "block" and self.block is None:
                continue
            _check_callable("model", self.name, field_name, getattr(self, field_name))
        if self.stack is not None:
            _check_callable("model", self.name, "stack", self.stack)

    def layer_runs(
        self, options: Mapping[str, Any]
    ) -> tuple[tuple[str, Callable[..., Any], int], ...]:
        """The layer stack for ``options`` as runs ``(kind, block function, count)``, checked:
        kinds are names (``block``, ``dense``, ...; ``embedding`` and ``head`` are taken), one
        function per kind, counts are integers >= 0 summing to ``options["num_stacks"]``.
        A malformed stack is a :class:`stg.errors.UserError` naming the model."""
        from stg.errors import UserError

        layers = int(options["num_stacks"])
        if self.stack is None:
            if self.block is None:  # no layer stack
                return ()
            return (("block", self.block, layers),)
        runs = tuple(tuple(run) for run in self.stack(options))
        functions: dict[str, Callable[..., Any]] = {}
        for run in runs:
            if len(run) != 3:
                raise UserError(
                    f"model {self.name!r}: stack() must return (kind, block function, count) "
                    f"runs, got {run!r}"
                )
            kind, function, count = run
            if (
                not isinstance(kind, str)
                or not NAME_RE.match(kind)
                or kind in ("embedding", "head")
            ):
                raise UserError(
                    f"model {self.name!r}: stack() kind {kind!r} must be a lower-case name "
                    "other than embedding and head"
                )
            if not callable(function) or functions.setdefault(kind, function) is not function:
                raise UserError(
                    f"model {self.name!r}: stack() kind {kind!r} must name one block function"
                )
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise UserError(
                    f"model {self.name!r}: stack() count of {kind!r} must be an integer >= 0, "
                    f"got {count!r}"
                )
        total = sum(run[2] for run in runs)
        if total != layers:
            raise UserError(f"model {self.name!r}: stack() has {total} layers; num_stacks={layers}")
        return tuple((kind, function, count) for kind, function, count in runs if count)  # type: ignore[misc]


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule: the order in which one stage runs its micro-batch steps.

    ``order(stage, stages, micro_batches, chunks)`` returns a list of
    ``(direction, micro_batch, chunk)`` with direction ``"F"`` or ``"B"``; every
    (direction, micro_batch, chunk) appears exactly once, and forward precedes backward.
    """

    name: str
    order: Callable[[int, int, int, int], list[tuple[str, int, int]]]
    description: str = ""
    supports_chunks: bool = False

    def __post_init__(self) -> None:
        _check_name("pipeline schedule", self.name)
        _check_callable("pipeline schedule", self.name, "order", self.order)


@dataclass(frozen=True)
class Emitter:
    """An output format. ``write(workload, directory, output_name)`` writes every file into
    ``directory`` (a fresh temporary directory that the caller moves into place) and returns
    the paths it wrote. ``extension`` is appended to output names without ``%d``."""

    name: str
    write: Callable[[Workload, Path, str], list[Path]]
    extension: str
    description: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name("emitter", self.name)
        _check_callable("emitter", self.name, "write", self.write)
        if not isinstance(self.extension, str) or not self.extension.startswith("."):
            raise RecordError(f"emitter {self.name!r}: extension must start with '.'")


PREDICTOR_NEEDS = ("options", "workload")
"""What a :class:`Predictor` needs to answer: the generation options alone, or the built
workload."""


@dataclass(frozen=True)
class Predictor:
    """A predictor. ``predict(workload, system)`` returns a JSON-serialisable report dict.

    ``predict_options(options, system, **kwargs)``, where given, makes the same report from
    the GenerateOptions alone, without building the workload: ``stg sweep`` and ``stg
    search`` call it when it exists (keywords it may take: ``registry``, ``kernels``,
    ``explain``).

    ``needs`` says what ``stg predict`` must build for it: ``"workload"`` (the default) hands
    ``predict`` the whole generated workload; ``"options"`` (which requires
    ``predict_options``) answers from the options alone, and the workload is built only if
    another selected predictor needs it."""

    name: str
    predict: Callable[..., dict[str, Any]]
    description: str = ""
    predict_options: Callable[..., dict[str, Any]] | None = None
    needs: Literal["options", "workload"] = "workload"

    def __post_init__(self) -> None:
        _check_name("predictor", self.name)
        _check_callable("predictor", self.name, "predict", self.predict)
        if self.predict_options is not None:
            _check_callable("predictor", self.name, "predict_options", self.predict_options)
        if self.needs not in PREDICTOR_NEEDS:
            raise RecordError(
                f"predictor {self.name!r}: needs {self.needs!r} must be one of "
                f"{', '.join(PREDICTOR_NEEDS)}"
            )
        if self.needs == "options" and self.predict_options is None:
            raise RecordError(f"predictor {self.name!r}: needs='options' requires predict_options")


@dataclass(frozen=True)
class Kernel:
    """A kernel for one op class at one precision: throughput and memory per element.

    ``op_class`` is ``"einsum"`` (matmuls; also spelled ``"gemm"``), ``"attention"`` (the
    score and context matmuls and softmax) or ``"elementwise"`` (also ``"other"``); ``dtype``
    one of fp32, tf32, bf16, fp16, fp8, int8. ``speedup`` scales the FLOP term of the roofline
    (2.0 = twice as fast as the system's peak for that dtype predicts); ``cast_alpha`` (s per
    element) and ``cast_beta`` (s) price a cast into this precision (both 0: the roofline
    prices it); ``bytes_per_element`` is what a tensor saved in this precision occupies
    (``None``: the dtype's width). ``systems`` names the system descriptions the kernel runs
    on (empty: every system). See :mod:`stg.perf.kernels` for how predictors use kernels.
    """

    name: str
    op_class: str
    dtype: str
    speedup: float = 1.0
    bytes_per_element: float | None = None
    cast_alpha: float = 0.0
    cast_beta: float = 0.0
    description: str = ""
    systems: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name("kernel", self.name)
        if self.op_class not in KERNEL_OP_CLASSES:
            raise RecordError(
                f"kernel {self.name!r}: op_class {self.op_class!r} must be one of "
                f"{', '.join(KERNEL_OP_CLASSES)}"
            )
        for field_name in ("cast_alpha", "cast_beta"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise RecordError(f"kernel {self.name!r}: {field_name} must be a number >= 0")
        if self.bytes_per_element is not None and not (
            isinstance(self.bytes_per_element, int | float) and self.bytes_per_element > 0
        ):
            raise RecordError(f"kernel {self.name!r}: bytes_per_element must be > 0 or None")
        if isinstance(self.systems, str) or not all(isinstance(x, str) for x in self.systems):
            raise RecordError(f"kernel {self.name!r}: systems must be a tuple of system names")
        if self.dtype not in {"fp32", "tf32", "bf16", "fp16", "fp8", "int8"}:
            raise RecordError(
                f"kernel {self.name!r}: dtype {self.dtype!r} must be one of "
                "fp32, tf32, bf16, fp16, fp8, int8"
            )
        if (
            isinstance(self.speedup, bool)
            or not isinstance(self.speedup, int | float)
            or not 0 < self.speedup < float("inf")
        ):
            raise RecordError(f"kernel {self.name!r}: speedup must be a finite number > 0")


@dataclass(frozen=True)
class BenchOp:
    """An operator that ``stg bench compute`` runs, as PARAM's operator registry holds them.

    ``name`` is the operator's key in a PARAM compute config (``torch.mm``,
    ``mylib.fused_rope``). ``function`` is what runs: a callable, or the dotted import path of
    one (``"torch.mm"``), resolved only when a benchmark runs, so registering needs no torch.
    With ``buildable`` the function is a constructor (``torch.nn.Linear``): it is called with
    the config's build arg-set, and what it returns, moved to the device, with each input
    arg-set. An ``inplace`` op modifies its first input: its tensors are made with
    ``requires_grad`` false (PARAM's in-place trap) and it has no backward pass.

    What a measurement means, from the case's materialized config (the ``config`` of a result
    line: ``{"build": ..., "input": {"args": [...], "kwargs": {...}}}``): ``flops`` and
    ``nbytes`` (forward FLOPs and bytes moved), ``backward_flops``, and ``shape``, the kernel
    shape that calibrates the predictors (``gemm``: [batch, m, n, k]; ``attention``:
    [batch, heads, s_q, s_kv, head_dim, causal]); ``op_class`` is one of
    ``BENCH_OP_CLASSES``. Each of the four is optional and may raise on a config it cannot
    read (the case then has no such figure).
    """

    name: str
    function: Callable[..., Any] | str
    buildable: bool = False
    inplace: bool = False
    op_class: str = "other"
    flops: Callable[[Mapping[str, Any]], float] | None = None
    nbytes: Callable[[Mapping[str, Any]], float] | None = None
    backward_flops: Callable[[Mapping[str, Any]], float] | None = None
    shape: Callable[[Mapping[str, Any]], Sequence[int] | None] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not BENCH_OP_NAME_RE.match(self.name):
            raise RecordError(
                f"bench operator name {self.name!r} must be dotted identifiers "
                "(torch.mm, mylib.my_op, aten::add)"
            )
        if isinstance(self.function, str):
            if not BENCH_OP_NAME_RE.match(self.function) or "::" in self.function:
                raise RecordError(
                    f"bench operator {self.name!r}: function {self.function!r} must be a "
                    "callable or a dotted import path (torch.mm)"
                )
        else:
            _check_callable("bench operator", self.name, "function", self.function)
        if self.op_class not in BENCH_OP_CLASSES:
            raise RecordError(
                f"bench operator {self.name!r}: op_class {self.op_class!r} must be one of "
                f"{', '.join(BENCH_OP_CLASSES)}"
            )
        for field_name in ("flops", "nbytes", "backward_flops", "shape"):
            value = getattr(self, field_name)
            if value is not None:
                _check_callable("bench operator", self.name, field_name, value)
        if self.buildable and self.inplace:
            raise RecordError(f"bench operator {self.name!r}: buildable ops cannot be inplace")


@dataclass(frozen=True)
class Preset:
    """A named, published configuration of a model template (``--model NAME``).

    ``model`` is the registered model the preset builds (a name, an alias or ``dist:name``);
    ``dims`` the dimensions it fills (keys from ``PRESET_DIMS``: ``dmodel``, ``num_stacks``,
    ...; every value a positive integer, ``capacity_factor`` a positive number,
    ``attention_sinks``, ``attention_output_gate``, ``tie_embeddings`` and ``causal`` booleans,
    ``layer_pattern`` and ``mlp_activation`` strings). Options given explicitly override them.
    ``source`` cites where the numbers come from (the paper, its table, the released config).
    ``published_parameters`` and ``published_active_parameters`` are the parameter counts the
    source states (total, and per token for mixtures of experts), as plain numbers (46.7e9), for
    comparison with what the template builds; ``tied_embeddings`` says that the published model
    shares one matrix between the word embedding and the LM head and counts it once (a template
    without ``tie_embeddings`` true in ``dims`` gives the LM head its own weight, dvocal·dmodel
    more). ``vocab_divisible_by`` pads the preset's vocabulary, as Megatron-LM's
    ``--make-vocab-size-divisible-by`` does, to a multiple of ``vocab_divisible_by · tp``
    (GPT-3's 50,257 tokens: 50,304 at tp 1, 51,200 at tp 8), so that every tensor-parallel
    degree divides it; an explicit ``--dvocal`` is kept.
    """

    name: str
    model: str
    dims: Mapping[str, int | float]
    source: str
    description: str = ""
    aliases: tuple[str, ...] = ()
    published_parameters: float | None = None
    published_active_parameters: float | None = None
    tied_embeddings: bool = False
    vocab_divisible_by: int | None = None

    def __post_init__(self) -> None:
        _check_name("preset", self.name)
        if self.vocab_divisible_by is not None and (
            isinstance(self.vocab_divisible_by, bool)
            or not isinstance(self.vocab_divisible_by, int)
            or self.vocab_divisible_by < 1
        ):
            raise RecordError(
                f"preset {self.name!r}: vocab_divisible_by must be a positive integer or None"
            )
        for alias in self.aliases:
            _check_name("preset alias", alias)
        if not isinstance(self.model, str) or not self.model:
            raise RecordError(f"preset {self.name!r}: model must name a registered model")
        if not isinstance(self.source, str) or not self.source.strip():
            raise RecordError(
                f"preset {self.name!r}: source must cite the paper or released config"
            )
        if not isinstance(self.dims, Mapping):
            raise RecordError(f"preset {self.name!r}: dims must be a mapping of option -> value")
        for key, value in self.dims.items():
            if key not in PRESET_DIMS:
                raise RecordError(
                    f"preset {self.name!r}: dims key {key!r} is not allowed; allowed: "
                    f"{', '.join(PRESET_DIMS)}"
                )
            if key in ("attention_sinks", "attention_output_gate", "causal", "tie_embeddings"):
                if not isinstance(value, bool):
                    raise RecordError(
                        f"preset {self.name!r}: {key}={value!r} must be true or false"
                    )
                continue
            if key in ("layer_pattern", "mlp_activation"):
                if not isinstance(value, str) or not value:
                    raise RecordError(
                        f"preset {self.name!r}: {key}={value!r} must be a non-empty string"
                    )
                continue
            number = int | float if key == "capacity_factor" else int
            if isinstance(value, bool) or not isinstance(value, number) or not value > 0:
                kind = "number" if key == "capacity_factor" else "integer"
                raise RecordError(
                    f"preset {self.name!r}: {key}={value!r} must be a positive {kind}"
                )
        for field_name in ("published_parameters", "published_active_parameters"):
            value = getattr(self, field_name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise RecordError(f"preset {self.name!r}: {field_name} must be > 0 or None")
        # a read-only copy, in the order given: the record stays immutable
        object.__setattr__(self, "dims", MappingProxyType(dict(self.dims)))
