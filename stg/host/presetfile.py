"""Presets as data: read a TOML file of ``[[preset]]`` tables into :class:`Preset` records.

A file holds one family of presets (``models/preset_data/llama.toml``); a plugin ships its
own and registers what :func:`load_presets` returns through ``stg_register_presets``. Each
table has the fields of :class:`Preset`; ``source`` is one citation, or a table that names
the source of each value (``dims``, a dimension, ``published_parameters``, ...), which the
record holds joined into one line. A file that is not such a table is a :class:`RecordError`
naming the file and the preset.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from stg.host.records import PRESET_DIMS, Preset, RecordError

PRESET_FIELDS = tuple(f.name for f in fields(Preset))
"""The keys of a ``[[preset]]`` table: those of :class:`Preset`."""
SOURCE_KEYS = (
    "model",
    "dims",
    *PRESET_DIMS,
    "aliases",
    "published_parameters",
    "published_active_parameters",
    "tied_embeddings",
    "vocab_divisible_by",
)
"""What a ``source`` table may give the source of: the model, all dimensions or one, and
the aliases, the published counts, tied embeddings and padding."""


def load_presets(path: str | os.PathLike[str] | Traversable) -> tuple[Preset, ...]:
    """The presets of one TOML file (a path, or a resource of a package:
    ``importlib.resources.files("my_plugin") / "presets.toml"``), in the file's order."""
    name = str(path)
    try:
        data = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as exc:
        raise RecordError(f"preset file {name}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"preset file {name}: cannot read it: {exc}") from None
    extra = sorted(set(data) - {"preset"})
    if extra:
        raise RecordError(
            f"preset file {name}: unknown top-level key {extra[0]!r}; allowed: [[preset]] tables"
        )
    tables = data.get("preset", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise RecordError(f"preset file {name}: 'preset' must be [[preset]] tables")
    return tuple(_preset(name, k, table) for k, table in enumerate(tables))


def _read(path: str | os.PathLike[str] | Traversable) -> str:
    resource = Path(path) if isinstance(path, str | os.PathLike) else path
    return resource.read_text(encoding="utf-8")


def _preset(file: str, index: int, table: Mapping[str, Any]) -> Preset:
    """One ``[[preset]]`` table (the ``index``-th of ``file``) as a record."""
    where = f"preset file {file}, preset {table.get('name', index + 1)!r}"
    unknown = [key for key in table if key not in PRESET_FIELDS]
    if unknown:
        raise RecordError(
            f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(PRESET_FIELDS)}"
        )
    values = dict(table)
    if "source" in values:
        values["source"] = _source(where, values["source"])
    if "aliases" in values:
        aliases = values["aliases"]
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise RecordError(f"{where}: aliases must be a list of names")
        values["aliases"] = tuple(aliases)
    tied = values.get("tied_embeddings", False)
    if not isinstance(tied, bool):
        raise RecordError(f"{where}: tied_embeddings must be true or false")
    for key in ("name", "model", "description"):
        if key in values and not isinstance(values[key], str):
            raise RecordError(f"{where}: {key} must be a string")
    missing = [key for key in ("name", "model", "dims", "source") if key not in values]
    if missing:
        raise RecordError(f"{where}: {missing[0]!r} is missing")
    try:
        return Preset(**values)
    except RecordError as exc:
        raise RecordError(f"preset file {file}: {exc}") from None


def _source(where: str, source: object) -> str:
    """A ``source``: one citation, or ``{value: citation}`` joined as ``value: citation; ...``."""
    if isinstance(source, str):
        return source
    if not isinstance(source, dict) or not source:
        raise RecordError(f"{where}: source must be a citation or a table of them")
    for key, citation in source.items():
        if key not in SOURCE_KEYS:
            raise RecordError(
                f"{where}: source of {key!r}: not a preset value; allowed: {', '.join(SOURCE_KEYS)}"
            )
        if not isinstance(citation, str) or not citation.strip():
            raise RecordError(f"{where}: source of {key!r} must be a citation")
    return "; ".join(f"{key}: {citation}" for key, citation in source.items())


_SOURCE_PART = re.compile(rf"; (?=(?:{'|'.join(SOURCE_KEYS)}): )")


def source_parts(source: str) -> list[tuple[str | None, str]]:
    """A preset's source as (value, citation) pairs: those of a ``source`` table, in its
    order; a single citation is one pair whose value is None."""
    parts = _SOURCE_PART.split(source)
    pairs: list[tuple[str | None, str]] = []
    for part in parts:
        key, _, citation = part.partition(": ")
        if key not in SOURCE_KEYS or not citation:
            return [(None, source)]
        pairs.append((key, citation))
    return pairs
