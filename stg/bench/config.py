"""PARAM's compute-benchmark config format: operators, arg-sets, data specs and macros.

A config maps operator names to ``{"input_data_generator", "build_data_generator"?,
"build_iterator"?, "input_iterator"?, "config": [{"build"?: [arg-sets], "input":
[arg-sets]}]}``; an arg-set is ``{"args": [specs], "kwargs": {name: spec}}`` and a data spec
is ``{"type": ..., ...}`` (see :data:`DATA_TYPES`). Every build arg-set is crossed with every
input arg-set. This module turns a config into :class:`Case` s without running anything.

Macros, as PARAM's ``RangeConfigIterator`` expands them (``input_iterator`` or
``build_iterator`` set to ``"RangeConfigIterator"``):

- ``"__range__": [attribute names]`` on a spec: a tensor's ``shape`` (an element
  ``[min, max, step]`` is an inclusive range) and ``dtype`` (a list), an int's ``value``
  (``[min, max, step]``), a str's, bool's or device's ``value`` (a list), a genericlist's or
  tuple's ``value`` (its items expanded). Every ranged attribute is crossed with every other:
  arguments in order, the first one varying slowest, then the kwargs.
- ``"__copy__": [{"shape": [i, [j, k]]}]`` on a tensor argument: after expansion, element
  ``i`` of this argument's shape becomes element ``k`` of argument ``j``'s shape (applied
  argument by argument, in order).

Run ids are ``"<config index>|<build id>|<input id>"``; an id is an index, or
``"<arg-set>_<combination>"`` under RangeConfigIterator. Unlike PARAM (whose prefix
accumulates over several build entries: ``0|0|0``, ``0|0|1|0``, ...), the build part is that
build's own id, so ids are stable keys.

A mistake in one operator, config item or arg-set makes an error :class:`Case` (one line
naming where and what) and the others still run; only a file that is not a JSON object is an
error for the whole config.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stg.errors import UserError

DATA_TYPES = (
    "int",
    "long",
    "float",
    "double",
    "bool",
    "str",
    "device",
    "none",
    "genericlist",
    "tuple",
    "tensor",
    "dtype",
)
"""Data spec types: PARAM's (lib/pytorch/data_impl.py), plus stg's ``dtype`` (a torch dtype
by PARAM's name, ``{"type": "dtype", "value": "bfloat16"}``: what PARAM lacks to build
``torch.nn.Linear`` in bf16)."""

TENSOR_DTYPES = (
    "float",
    "double",
    "float16",
    "bfloat16",
    "int",
    "long",
    "int8",
    "uint8",
    "int16",
    "bool",
)
"""Tensor dtypes of PARAM's data generator (``pytorch_dtype_map`` in data_impl.py)."""

ITERATORS = ("DefaultConfigIterator", "RangeConfigIterator")
"""The config iterators PARAM registers (lib/iterator.py)."""
DATA_GENERATORS = ("PyTorch:DefaultDataGenerator",)
"""The data generator PARAM registers (lib/pytorch/data_impl.py)."""
RANGE = "__range__"
COPY = "__copy__"
RECORDED_OUTPUTS = "outputs"
"""An input arg-set's list of the tensors the operator returned where it was recorded
(``stg bench replay`` writes it from an execution trace, for the analysis of the results'
bytes; it is kept in the case's config, and PARAM ignores it)."""
META_ATTRS = (RANGE, COPY, "__list__")
"""Macro attributes, removed from a spec once expanded (PARAM's META_ATTRS)."""


class ConfigError(UserError):
    """A config that cannot be read at all (not a JSON object)."""


class CaseError(ValueError):
    """One operator, config item, arg-set or case is malformed (recorded, never raised out)."""


@dataclass(frozen=True)
class Case:
    """One measurement to make: an operator, its run id and its materialized config; or the
    reason why the part of the config it stands for cannot run (``error``)."""

    op_name: str
    id: str
    build: Any = None
    input: Mapping[str, Any] | None = None
    error: str | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The ``config`` of the case's result line (PARAM's layout)."""
        return {"build": self.build, "input": self.input}

    @property
    def run_id(self) -> str:
        """``<op>|<id>``: how PARAM's ``--resume-id``/``--stop_id`` name a case."""
        return f"{self.op_name}|{self.id}"


@dataclass
class Expansion:
    """The cases of a config, and warnings (operators skipped as PARAM skips them)."""

    cases: list[Case] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """the operators without an ``input_data_generator``"""

    @property
    def errors(self) -> list[Case]:
        return [c for c in self.cases if c.error is not None]


def load_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file; one-line :class:`ConfigError` otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {str(path)!r} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config {str(path)!r} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {str(path)!r} must be a JSON object of operator names, "
            f"got {type(data).__name__}"
        )
    return data


def expand(config: Mapping[str, Any]) -> Expansion:
    """Every case of ``config`` in PARAM's order: operators, config items, builds, inputs."""
    out = Expansion()
    for op_name, info in config.items():
        if not isinstance(info, Mapping):
            if op_name.startswith("__"):
                continue  # a meta key such as stg bench model's "__stg__"
            out.cases.append(Case(op_name, "-", error="the operator's entry must be an object"))
            continue
        if "input_data_generator" not in info:
            if not op_name.startswith("__"):
                out.skipped.append(op_name)
                out.warnings.append(
                    f"{op_name}: no input_data_generator, skipped (as PARAM skips it)"
                )
            continue
        out.cases.extend(_op_cases(op_name, info))
    return out


# -- one operator ----------------------------------------------------------------------------


def _op_cases(op_name: str, info: Mapping[str, Any]) -> Iterator[Case]:
    try:
        _check_choice("input_data_generator", info.get("input_data_generator"), DATA_GENERATORS)
        if info.get("build_data_generator") is not None:
            _check_choice("build_data_generator", info.get("build_data_generator"), DATA_GENERATORS)
        input_range = _iterator(info, "input_iterator")
        build_range = _iterator(info, "build_iterator")
        items = info.get("config")
        if not isinstance(items, list):
            raise CaseError('"config" must be a list of {"build", "input"} items')
    except CaseError as exc:
        yield Case(op_name, "-", error=str(exc))
        return
    for ci, item in enumerate(items):
        if not isinstance(item, Mapping):
            yield Case(op_name, str(ci), error=f"config[{ci}] must be an object")
            continue
        inputs = item.get("input")
        if not isinstance(inputs, list) or not inputs:
            yield Case(
                op_name, str(ci), error=f'config[{ci}] needs "input": a non-empty list of arg-sets'
            )
            continue
        builds = item.get("build")
        if builds is not None and not isinstance(builds, list):
            yield Case(op_name, str(ci), error=f'config[{ci}]: "build" must be a list of arg-sets')
            continue
        if builds:
            for build_id, build, raw in _argsets(builds, build_range, f"config[{ci}].build"):
                if isinstance(build, CaseError):
                    yield Case(op_name, f"{ci}|{build_id}", build=raw, error=str(build))
                    continue
                yield from _inputs(op_name, f"{ci}|{build_id}", build, inputs, input_range, ci)
        else:
            yield from _inputs(op_name, f"{ci}|0", builds, inputs, input_range, ci)


def _inputs(
    op_name: str, prefix: str, build: Any, inputs: list[Any], ranged: bool, ci: int
) -> Iterator[Case]:
    for input_id, argset, raw in _argsets(inputs, ranged, f"config[{ci}].input"):
        if isinstance(argset, CaseError):
            yield Case(op_name, f"{prefix}|{input_id}", build, raw, error=str(argset))
        else:
            yield Case(op_name, f"{prefix}|{input_id}", build=build, input=argset)


def _iterator(info: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` names RangeConfigIterator (absent: DefaultConfigIterator)."""
    name = info.get(key)
    if name is None:
        return False
    _check_choice(key, name, ITERATORS)
    return name == "RangeConfigIterator"


def _check_choice(key: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise CaseError(f"{key} {value!r} is not known; allowed: {', '.join(allowed)}")


def _argsets(
    argsets: list[Any], ranged: bool, where: str
) -> Iterator[tuple[str, dict[str, Any] | CaseError, Any]]:
    """(id, materialized arg-set or the error, the arg-set as written) per combination, in
    PARAM's iterator order."""
    for v, argset in enumerate(argsets):
        here = f"{where}[{v}]"
        try:
            if not ranged:
                yield str(v), _materialized(argset, here, allow_macros=False), argset
                continue
            combos = list(_expand_argset(argset, here))
        except CaseError as exc:
            yield (f"{v}_?" if ranged else str(v)), CaseError(str(exc)), argset
            continue
        for c, combo in enumerate(combos):
            try:
                yield f"{v}_{c}", _materialized(combo, here, allow_macros=False), combo
            except CaseError as exc:
                yield f"{v}_{c}", exc, combo


# -- expansion ---------------------------------------------------------------------------------


def _argset_parts(argset: Any, where: str) -> tuple[list[Any], dict[str, Any]]:
    if not isinstance(argset, Mapping):
        raise CaseError(f'{where} must be an object {{"args": [...], "kwargs": {{...}}}}')
    args = argset.get("args", [])
    kwargs = argset.get("kwargs", {})
    if not isinstance(args, list):
        raise CaseError(f'{where}: "args" must be a list of data specs')
    if not isinstance(kwargs, Mapping):
        raise CaseError(f'{where}: "kwargs" must be an object of data specs')
    return args, dict(kwargs)


def _expand_argset(argset: Any, where: str) -> Iterator[dict[str, Any]]:
    args, kwargs = _argset_parts(argset, where)
    choices = [_alternatives(spec, f"{where}.args[{i}]") for i, spec in enumerate(args)]
    names = list(kwargs)
    choices += [_alternatives(kwargs[n], f"{where}.kwargs.{n}") for n in names]
    for combo in itertools.product(*choices):
        new_args = [copy.deepcopy(x) for x in combo[: len(args)]]
        _apply_copies(new_args, where)
        result: dict[str, Any] = {"args": [_strip(x) for x in new_args]}
        if "kwargs" in argset:
            result["kwargs"] = {
                n: _strip(copy.deepcopy(x)) for n, x in zip(names, combo[len(args) :], strict=True)
            }
        yield result


def _ranged(spec: Mapping[str, Any], where: str) -> list[str]:
    names = spec.get(RANGE, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CaseError(f"{where}: bad macro: {RANGE} must be a list of attribute names")
    missing = [n for n in names if n not in spec]
    if missing:
        raise CaseError(f"{where}: bad macro: {RANGE} names {missing[0]!r}, which the spec lacks")
    return names


def _alternatives(spec: Any, where: str) -> list[Any]:
    """The values of one spec under RangeConfigIterator (a one-element list if not ranged)."""
    if not isinstance(spec, Mapping) or spec.get("type") not in DATA_TYPES:
        _check_type(spec, where)
    names = _ranged(spec, where)
    kind = spec["type"]
    if not names:
        return [spec]
    if kind == "tensor":
        allowed = ("shape", "dtype")
    elif kind in ("none", "float", "double", "dtype"):
        allowed = ()
    else:
        allowed = ("value",)
    bad = [n for n in names if n not in allowed]
    if bad:
        what = (
            "float ranges are not supported (as in PARAM)"
            if kind in ("float", "double")
            else f"a {kind} ranges over {', '.join(allowed) or 'nothing'}"
        )
        raise CaseError(f"{where}: bad macro: {RANGE} names {bad[0]!r}; {what}")
    keys = [k for k in spec if k in names]
    values: list[list[Any]] = []
    for key in keys:
        raw = spec[key]
        if kind == "tensor" and key == "shape":
            values.append(_shape_range(raw, f"{where}.shape"))
        elif kind in ("int", "long"):
            values.append(list(_int_range(raw, f"{where}.value")))
        elif kind in ("genericlist", "tuple"):
            if not isinstance(raw, list):
                raise CaseError(f"{where}: bad macro: a ranged {kind} value must list specs")
            items = [_alternatives(item, f"{where}.value[{i}]") for i, item in enumerate(raw)]
            values.append([list(p) for p in itertools.product(*items)])
        else:
            if not isinstance(raw, list) or not raw:
                raise CaseError(f"{where}: bad macro: a ranged {key} must be a non-empty list")
            values.append(list(raw))
    result = []
    for combo in itertools.product(*values):
        expanded = dict(spec)
        for key, value in zip(keys, combo, strict=True):
            expanded[key] = copy.deepcopy(value)
        result.append(expanded)
    return result


def _int_range(raw: Any, where: str) -> range:
    if (
        not isinstance(raw, list)
        or len(raw) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
    ):
        raise CaseError(f"{where}: bad macro: a range must be [min, max, step] of integers")
    low, high, step = raw
    if step <= 0 or high < low:
        raise CaseError(f"{where}: bad macro: range {raw} needs min <= max and step > 0")
    return range(low, high + 1, step)


def _shape_range(raw: Any, where: str) -> list[list[Any]]:
    if not isinstance(raw, list):
        raise CaseError(f"{where}: bad macro: a ranged shape must be a list")
    elements: list[Sequence[Any]] = []
    for i, x in enumerate(raw):
        if isinstance(x, list):
            elements.append(_int_range(x, f"{where}[{i}]"))
        else:
            elements.append([x])
    return [list(p) for p in itertools.product(*elements)]


def _apply_copies(args: list[Any], where: str) -> None:
    for index, arg in enumerate(args):
        if not isinstance(arg, dict) or COPY not in arg:
            continue
        here = f"{where}.args[{index}].{COPY}"
        if arg.get("type") != "tensor":
            raise CaseError(f"{here}: bad macro: {COPY} applies to tensor arguments only")
        rules = arg[COPY]
        if not isinstance(rules, list):
            raise CaseError(f"{here}: bad macro: must be a list of {{attribute: [i, [j, k]]}}")
        for rule in rules:
            if not isinstance(rule, Mapping):
                raise CaseError(f"{here}: bad macro: must be a list of {{attribute: [i, [j, k]]}}")
            for attr, mapping in rule.items():
                _copy_one(args, index, attr, mapping, here)


def _copy_one(args: list[Any], index: int, attr: str, mapping: Any, where: str) -> None:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (
        isinstance(mapping, list)
        and len(mapping) == 2
        and is_int(mapping[0])
        and isinstance(mapping[1], list)
        and len(mapping[1]) == 2
        and all(is_int(x) for x in mapping[1])
    ):
        raise CaseError(f"{where}: bad macro: {{{attr!r}: {mapping!r}}} must be [i, [j, k]]")
    target_index, (source_arg, source_index) = mapping
    if not 0 <= source_arg < len(args):
        raise CaseError(
            f"{where}: bad macro: copies from argument {source_arg}; the arg-set has {len(args)}"
        )
    target = args[index].get(attr)
    source = args[source_arg].get(attr) if isinstance(args[source_arg], Mapping) else None
    if not isinstance(target, list) or not isinstance(source, list):
        raise CaseError(
            f"{where}: bad macro: {attr!r} must be a list on argument {index} and {source_arg}"
        )
    if not 0 <= target_index < len(target) or not 0 <= source_index < len(source):
        raise CaseError(
            f"{where}: bad macro: copies {attr}[{source_index}] of argument {source_arg} "
            f"(length {len(source)}) into {attr}[{target_index}] (length {len(target)})"
        )
    target[target_index] = source[source_index]


def _strip(spec: Any) -> Any:
    """A spec without macro attributes (nested specs too)."""
    if isinstance(spec, dict):
        out = {k: v for k, v in spec.items() if k not in META_ATTRS}
        if out.get("type") in ("genericlist", "tuple") and isinstance(out.get("value"), list):
            out["value"] = [_strip(x) for x in out["value"]]
        return out
    return spec


# -- checks ------------------------------------------------------------------------------------


def _materialized(argset: Any, where: str, *, allow_macros: bool) -> dict[str, Any]:
    """A checked copy of an arg-set whose macros are expanded."""
    args, kwargs = _argset_parts(argset, where)
    for i, spec in enumerate(args):
        check_spec(spec, f"{where}.args[{i}]", allow_macros=allow_macros)
    for name, spec in kwargs.items():
        check_spec(spec, f"{where}.kwargs.{name}", allow_macros=allow_macros)
    out: dict[str, Any] = {"args": copy.deepcopy(args)}
    if "kwargs" in argset:
        out["kwargs"] = copy.deepcopy(kwargs)
    recorded = argset.get(RECORDED_OUTPUTS)
    if recorded is not None:
        if not isinstance(recorded, list):
            raise CaseError(f'{where}: "{RECORDED_OUTPUTS}" must be a list of data specs')
        for i, spec in enumerate(recorded):
            check_spec(spec, f"{where}.{RECORDED_OUTPUTS}[{i}]")
        out[RECORDED_OUTPUTS] = copy.deepcopy(recorded)
    return out


def _check_type(spec: Any, where: str) -> None:
    if not isinstance(spec, Mapping):
        raise CaseError(f'{where}: a data spec must be an object with a "type"')
    kind = spec.get("type")
    if kind not in DATA_TYPES:
        raise CaseError(f"{where}: unknown type {kind!r}; allowed: {', '.join(DATA_TYPES)}")


def check_spec(spec: Any, where: str, *, allow_macros: bool = False) -> None:
    """Raise :class:`CaseError` naming ``where`` unless ``spec`` is a valid data spec."""
    _check_type(spec, where)
    if not allow_macros:
        for macro in (RANGE, COPY):
            if macro in spec:
                raise CaseError(
                    f'{where}: bad macro: {macro} needs "input_iterator": '
                    '"RangeConfigIterator" (or "build_iterator" for a build)'
                )
    kind = spec["type"]
    value = spec.get("value")
    if kind == "tensor":
        dtype = spec.get("dtype")
        if dtype not in TENSOR_DTYPES:
            raise CaseError(
                f"{where}: tensor dtype {dtype!r} is not known; allowed: {', '.join(TENSOR_DTYPES)}"
            )
        shape = spec.get("shape")
        if not isinstance(shape, list):
            raise CaseError(f'{where}: a tensor needs a "shape" list')
        for i, n in enumerate(shape):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                hint = " (a __copy__ target left unfilled?)" if n == -1 else ""
                raise CaseError(
                    f"{where}: shape {shape} has {n!r} at index {i}; sizes are integers >= 0{hint}"
                )
        grad = spec.get("requires_grad", True)
        if not isinstance(grad, bool):
            raise CaseError(f"{where}: requires_grad must be true or false")
    elif kind in ("int", "long", "float", "double"):
        numeric = (int,) if kind in ("int", "long") else (int, float)
        if "value" in spec:
            if not isinstance(value, numeric) or isinstance(value, bool):
                raise CaseError(f"{where}: a {kind} value must be a number, got {value!r}")
        else:
            bounds = spec.get("value_range")
            if (
                not isinstance(bounds, list)
                or len(bounds) != 2
                or not all(isinstance(x, numeric) and not isinstance(x, bool) for x in bounds)
                or bounds[0] > bounds[1]
            ):
                raise CaseError(f'{where}: a {kind} needs "value" or "value_range": [min, max]')
    elif kind == "bool":
        if not isinstance(value, bool):
            raise CaseError(f"{where}: a bool value must be true or false, got {value!r}")
    elif kind in ("str", "device"):
        if (kind == "device" or "value" in spec) and not isinstance(value, str):
            raise CaseError(f"{where}: a {kind} value must be a string, got {value!r}")
    elif kind == "dtype":
        if value not in TENSOR_DTYPES:
            raise CaseError(
                f"{where}: dtype {value!r} is not known; allowed: {', '.join(TENSOR_DTYPES)}"
            )
    elif kind in ("genericlist", "tuple"):
        if not isinstance(value, list):
            raise CaseError(f"{where}: a {kind} value must be a list of data specs")
        for i, item in enumerate(value):
            check_spec(item, f"{where}.value[{i}]", allow_macros=allow_macros)


__all__ = [
    "DATA_TYPES",
    "TENSOR_DTYPES",
    "Case",
    "CaseError",
    "ConfigError",
    "Expansion",
    "check_spec",
    "expand",
    "load_config",
]
