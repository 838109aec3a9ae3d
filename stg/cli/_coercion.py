"""Option values coerced without pydantic where typer's result is certain.

typer (0.29 and later) coerces each option's value through a pydantic ``TypeAdapter`` that it
builds on the option's first use: a command imports pydantic (about 300 modules) and builds an
adapter for every option it declares, given or not (about a hundred for ``stg predict``).
:func:`light_coercion` makes typer's options first try the values whose result is certain: a
``str`` for a ``str`` option, a bool for a bool flag, an ASCII decimal within the option's
bounds for an ``int`` or ``float`` option, whatever an option's ``parser`` returns, and lists
of these. Any other value, and any value typer would refuse, goes through typer's own adapter,
so every result and every error message stays typer's (tests/test_cli_coercion.py compares
the two on each kind of value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, get_args, get_origin

UNDECIDED = object()
"""What :func:`coerce_certain` returns for a value that typer's adapter must coerce."""

INTEGER = re.compile(r"[-+]?[0-9]{1,18}", re.ASCII)
"""Decimal integers as pydantic reads them (it strips blanks and takes ``1_000`` and ``1.0``
too: those go to its adapter)."""
DECIMAL = re.compile(r"[-+]?[0-9]{1,18}(\.[0-9]{1,18})?([eE][-+]?[0-9]{1,3})?", re.ASCII)
"""Decimal numbers that Python's ``float`` and pydantic's both round correctly (``inf``,
``nan`` and the rest go to pydantic's adapter)."""

LEAVES = (str, bool, int, float)


def coerce_certain(annotation: Any, info: Any, value: Any) -> Any:
    """What typer's adapter for ``annotation`` (one value, not a list) with parameter info
    ``info`` returns for ``value``, where that is certain without it; else
    :data:`UNDECIDED`."""
    if info.parser is not None:  # typer runs the parser first, whatever the annotation
        try:
            return info.parser(value)
        except (ValueError, AssertionError):  # pydantic words these as a validation error
            return UNDECIDED
    if annotation is str:
        return value if type(value) is str else UNDECIDED
    if annotation is bool:
        return value if type(value) is bool else UNDECIDED
    if annotation is int:
        if type(value) is int:
            number: int | float = value
        elif type(value) is str and INTEGER.fullmatch(value):
            number = int(value)
        else:
            return UNDECIDED
    elif annotation is float:
        if type(value) in (int, float):
            number = float(value)
        elif type(value) is str and DECIMAL.fullmatch(value):
            number = float(value)
        else:
            return UNDECIDED
    else:
        return UNDECIDED
    if info.clamp:
        return UNDECIDED
    if (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        return UNDECIDED  # pydantic's adapter words the bound
    return number


def handles(annotation: Any, info: Any) -> bool:
    """Whether :func:`coerce_certain` may decide the values of such an option (a list of
    them included); files, paths, choices, tuples and dates always go to typer."""
    if get_origin(annotation) is list:
        args = get_args(annotation)
        return len(args) == 1 and handles(args[0], info)
    return info.parser is not None or annotation in LEAVES


def coerce_values(annotation: Any, info: Any, value: Any) -> Any:
    """:func:`coerce_certain` for an option's value, a list option's included (typer gives
    a list back)."""
    if get_origin(annotation) is not list:
        return coerce_certain(annotation, info, value)
    if not isinstance(value, (list, tuple)):
        value = [value]
    (item_annotation,) = get_args(annotation)
    items = [coerce_certain(item_annotation, info, item) for item in value]
    return UNDECIDED if any(item is UNDECIDED for item in items) else items


def light_coercion() -> None:
    """Make typer's parameters coerce the values :func:`coerce_certain` decides without
    building a pydantic adapter (the others, and every error, still go through it).
    Idempotent; nothing changes on a typer without this coercion layer."""
    try:
        from typer._coercion import RuntimeParam, build_runtime_param
        from typer.core import _TyperParameter
    except ImportError:  # typer < 0.29: click's own types, no pydantic
        return
    original = getattr(_TyperParameter, "get_runtime_param", None)
    if original is None or getattr(original, "_stg_light", False):
        return

    @dataclass(frozen=True)
    class LightRuntimeParam(RuntimeParam):  # type: ignore[misc]
        """Certain values directly; the others through typer's adapter, built then."""

        descriptor: Any

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            result = coerce_values(self.annotation, self.parameter_info, value)
            if result is UNDECIDED:
                full = build_runtime_param(self.descriptor)
                return full._coerce_value(value, param=param, ctx=ctx)
            return result

    def get_runtime_param(self: Any) -> Any:
        descriptor = self.type_descriptor
        if self._runtime_param is None and descriptor.file_annotation is None:
            if handles(descriptor.annotation, descriptor.parameter_info):
                self._runtime_param = LightRuntimeParam(
                    parameter_info=descriptor.parameter_info,
                    annotation=descriptor.annotation,
                    descriptor=descriptor,
                )
        return original(self)

    get_runtime_param._stg_light = True  # type: ignore[attr-defined]
    _TyperParameter.get_runtime_param = get_runtime_param  # type: ignore[method-assign]
