"""Typed records that plugins register, checked when they are registered.

Each record is a frozen dataclass; ``__post_init__`` rejects a malformed record with a
:class:`RecordError` naming the field, so a plugin author sees the mistake at load time.
The plugin host fills in ``plugin`` and ``dist`` (provenance) when it accepts a record.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from stg.core.workload import Workload

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")
KERNEL_OP_CLASSES = ("einsum", "gemm", "attention", "elementwise", "other")


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
    """

    name: str
    embedding: Callable[..., Any]
    block: Callable[..., Any]
    head: Callable[..., Any]
    description: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name("model", self.name)
        for alias in self.aliases:
            _check_name("model alias", alias)
        for field_name in ("embedding", "block", "head"):
            _check_callable("model", self.name, field_name, getattr(self, field_name))


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


@dataclass(frozen=True)
class Predictor:
    """A predictor. ``predict(workload, system)`` returns a JSON-serialisable report dict."""

    name: str
    predict: Callable[..., dict[str, Any]]
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("predictor", self.name)
        _check_callable("predictor", self.name, "predict", self.predict)


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
