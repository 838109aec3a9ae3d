"""The space of a sweep: a spec (TOML or YAML file, or inline ranges) and its configurations.

A spec maps option names to values: any field of :class:`stg.core.options.GenerateOptions`
(``dp``, ``tp``, ``micro_batch``, ``activation_recompute``, ``model``, ...; dashes work for
underscores) and ``system`` (presets or system files). A scalar is fixed; a list, or a string
range, is swept:

- ``1,2,4,8``: these values;
- ``1..8``: every integer from 1 to 8;
- ``pow2:1..16``: the powers of two from 1 to 16.

``recompute_modules`` joins the modules of one configuration with ``+``
(``core_attn,core_attn+mlp``: two configurations).

Configurations are the cartesian product, in the order the keys are given. Those whose
options are impossible (a degree that does not divide a size, too many ranks for the system)
are counted by reason, never raised.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stg.core.options import GenerateOptions, OptionError, resolve_model
from stg.errors import UserError

OUTPUT_FIELDS = frozenset({"format", "output_dir", "output_name"})
INTERNAL_FIELDS = frozenset(f.name for f in fields(GenerateOptions) if f.metadata.get("internal"))
"""GenerateOptions fields that are no option (``preset_fills``): neither swept nor tabled"""
SYSTEM_KEY = "system"


def option_fields() -> dict[str, str]:
    """Sweepable GenerateOptions fields and their declared types."""
    return {
        f.name: (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str"))
        for f in fields(GenerateOptions)
        if f.name not in OUTPUT_FIELDS | INTERNAL_FIELDS
    }


def canonical_name(name: str) -> str:
    """``micro-batch`` -> ``micro_batch``; ``cp`` and ``mp`` -> ``sp`` and ``tp``; an unknown
    name is one error line listing the allowed ones."""
    key = name.strip().lower().replace("-", "_")
    key = {"cp": "sp", "mp": "tp", "model_type": "model", "precision_plan": "precision"}.get(
        key, key
    )
    if key != SYSTEM_KEY and key not in option_fields():
        raise UserError(
            f"{name!r} is not a sweepable option; allowed: system, "
            + ", ".join(sorted(option_fields()))
        )
    return key


_RANGE = re.compile(r"^\s*(pow2:)?\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")


def expand(text: str) -> list[str]:
    """``1,2,4`` / ``1..8`` / ``pow2:1..16`` as a list of value strings."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.match(part)
        if match is None:
            out.append(part)
            continue
        pow2, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if high < low:
            raise UserError(f"range {part!r} is empty (its end is below its start)")
        if pow2:
            if low < 1:
                raise UserError(f"range {part!r}: powers of two start at 1 or more")
            value = 1
            while value <= high:
                if value >= low:
                    out.append(str(value))
                value *= 2
        else:
            if high - low > 100_000:
                raise UserError(f"range {part!r} has more than 100,000 values")
            out.extend(str(v) for v in range(low, high + 1))
    if not out:
        raise UserError(f"{text!r} names no value")
    return out


_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")


def convert(name: str, value: Any) -> Any:
    """One value of option ``name`` in the field's type (strings parsed as on the CLI)."""
    if name == SYSTEM_KEY:
        return str(value)
    kind = option_fields()[name]
    if name == "recompute_modules":  # one configuration's modules joined by "+"
        items = value if isinstance(value, list | tuple) else str(value).split("+")
        return tuple(str(v).strip().lower() for v in items if str(v).strip())
    if name == "pipeline_layers":  # one configuration's chunk layer counts joined by "+"
        items = value if isinstance(value, list | tuple) else str(value).split("+")
        words = [str(v).strip() for v in items if str(v).strip()]
        if not all(word.isdigit() for word in words):
            raise UserError(
                f"pipeline_layers={value!r} is not a list of layer counts; allowed: integers "
                ">= 0 joined by '+' (e.g. 0+4+4+4)"
            )
        return tuple(int(word) for word in words)
    if name == "precision":
        from stg.core.precision import load_plan

        return load_plan(str(value)) if value not in ("", None) else ()
    if value is None or (isinstance(value, str) and value.lower() in ("none", "unset")):
        if "None" in kind:
            return None
    if "bool" in kind:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise UserError(f"{name}={value!r} is not a boolean; allowed: true, false")
    if "int" in kind:
        if isinstance(value, bool):
            raise UserError(f"{name}={value!r} is not an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UserError(f"{name}={value!r} is not an integer") from None
    if "float" in kind:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"{name}={value!r} is not a number") from None
    if name == "activation_recompute":
        word = str(value).strip().lower()
        return {"true": "full", "false": "none"}.get(word, word)
    return str(value)


def values_of(name: str, raw: Any) -> list[Any]:
    """Every value of one spec entry: a list, a range string, or a scalar."""
    if name == "pipeline_layers" and isinstance(raw, list | tuple) and raw:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in raw):
            raw = [raw]  # one configuration written as a list of counts
    if isinstance(raw, list | tuple):
        items: list[Any] = []
        for item in raw:
            items.extend(expand(item) if isinstance(item, str) and _RANGE.match(item) else [item])
    elif isinstance(raw, str) and name != "precision":
        items = expand(raw)
    else:
        items = [raw]
    return list(dict.fromkeys(convert(name, v) for v in items))


def load_spec(path: str | Path) -> dict[str, Any]:
    """A spec file: TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML). Top-level
    keys are options; tables named ``fixed`` or ``sweep`` are read as if at the top."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"spec {str(path)!r}: no such file")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise UserError(
                f"spec {path}: reading YAML needs PyYAML (pip install pyyaml), or write "
                "the spec as TOML"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UserError(f"spec {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"spec {path}: not valid TOML ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"spec {path}: expected a table of options")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("fixed", "sweep") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


@dataclass(frozen=True)
class Spec:
    """Option name -> its values (one value: fixed), in the order given."""

    axes: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def swept(self) -> list[str]:
        return [k for k, v in self.axes.items() if len(v) > 1]

    @property
    def size(self) -> int:
        size = 1
        for values in self.axes.values():
            size *= len(values)
        return size


def make_spec(*sources: Mapping[str, Any]) -> Spec:
    """A spec from raw entries; later sources win (inline options over the file)."""
    axes: dict[str, list[Any]] = {}
    for source in sources:
        for name, raw in source.items():
            key = canonical_name(name)
            axes.pop(key, None)
            axes[key] = values_of(key, raw)
    axes.setdefault(SYSTEM_KEY, ["a100-80g"])
    return Spec(axes)


@dataclass(frozen=True)
class Config:
    """One valid configuration: its index in the product, options and system."""

    index: int
    given: dict[str, Any]
    options: GenerateOptions
    system: str

    def option_values(self) -> dict[str, Any]:
        hidden = OUTPUT_FIELDS | INTERNAL_FIELDS
        out = {k: v for k, v in self.options.as_dict().items() if k not in hidden}
        out["precision"] = json.dumps([list(p) for p in self.options.precision])
        return out


def config_id(config: Config, system_data: Mapping[str, Any], extra: Mapping[str, Any]) -> str:
    """A stable id of what one row answers: options, the system's description, and the run's
    settings (predictor, simulator command)."""
    blob = json.dumps(
        {"options": config.option_values(), "system": system_data, "run": dict(extra)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def normalize_reason(message: str) -> str:
    """An error message with its numbers as N, so that reasons group."""
    return re.sub(r"\d+(\.\d+)?", "N", message.split(";")[0]).strip()


def enumerate_configs(
    spec: Spec, registry: Any, capacity: Mapping[str, int] | None = None
) -> tuple[list[Config], Counter[str]]:
    """The valid configurations of ``spec`` and the invalid ones counted by reason."""
    from stg.core.pipeline import validate_options

    names = list(spec.axes)
    valid: list[Config] = []
    invalid: Counter[str] = Counter()
    resolved: dict[Any, Any] = {}
    for index, combo in enumerate(itertools.product(*(spec.axes[n] for n in names))):
        given = dict(zip(names, combo, strict=True))
        system = given.pop(SYSTEM_KEY)
        try:
            key = given.get("model")
            if key not in resolved:
                resolved[key] = resolve_model({"model": key} if key else {}, registry)[0]
            preset = {k: v for k, v in resolved[key].items() if k not in given}
            merged = {**preset, **given}
            if "preset_fills" in merged:
                merged["preset_fills"] = tuple(n for n in merged["preset_fills"] if n not in given)
            if "model" in resolved[key]:
                merged["model"] = resolved[key]["model"]
            options = GenerateOptions(**merged)
            validate_options(options, registry)
            limit = (capacity or {}).get(system, 0)
            if limit and options.world_size > limit:
                raise OptionError(
                    f"world size {options.world_size} exceeds the {limit} GPUs of {system}"
                )
        except (UserError, TypeError, ValueError) as exc:
            invalid[normalize_reason(str(exc))] += 1
            continue
        valid.append(Config(index, given, options, system))
    return valid, invalid


__all__ = [
    "Config",
    "Spec",
    "canonical_name",
    "config_id",
    "enumerate_configs",
    "expand",
    "load_spec",
    "make_spec",
    "normalize_reason",
    "values_of",
]
