"""Convert traces between Chakra v0.0.4, v0.0.1 and feeder JSON, one rank file at a time.

v0.0.4 <-> json is lossless: nodes (ids, names, types, deps, every attribute with its value
kind and doc string, start times, inputs/outputs) and the GlobalMetadata survive
v0.0.4 -> json -> v0.0.4 unchanged. Well-known attributes (``num_ops``, ``pg_name``, ...)
are written with the value kinds of TRACES.md, which repairs foreign files that used others.
Converting to v0.0.1 loses what that schema cannot hold (see
:mod:`stg.trace.chakra_v001`) and fails on what it cannot express. Non-scalar top-level
keys of a JSON source (besides ``workload_graph``) become JSON strings in GlobalMetadata.

Nodes stream through: memory stays bounded for protobuf sources. Output is atomic: files are
written to a temporary directory and moved into place only when every rank converted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from stg.errors import UserError
from stg.trace.reader import TraceAttrs, detect_format, infer_kind, iter_nodes, read_metadata
from stg.trace.writer import comm_group_path, output_paths, write_atomically, write_file_atomically

TARGETS: dict[str, str] = {
    "v0.0.4": "v0.0.4",
    "chakra-v0.0.4": "v0.0.4",
    "v0.0.1": "v0.0.1",
    "chakra-v0.0.1": "v0.0.1",
    "json": "json",
    "chakra-json": "json",
}
EXTENSIONS = {"v0.0.4": ".et", "v0.0.1": ".et", "json": ".json"}


def target_format(name: str) -> str:
    """The canonical target format of a ``--to`` value."""
    try:
        return TARGETS[name]
    except KeyError:
        raise UserError(f"--to {name}: not known; allowed: v0.0.4, v0.0.1, json") from None


def _metadata_attrs(meta: Mapping[str, Any]) -> TraceAttrs:
    src = meta["attrs"]
    attrs = TraceAttrs()
    kinds = getattr(src, "kinds", {})
    docs = getattr(src, "docs", {})
    for name, value in src.items():
        if name in kinds:
            attrs[name] = value
            attrs.kinds[name] = kinds[name]
        else:
            try:
                infer_kind(value)
                attrs[name] = tuple(value) if isinstance(value, list) else value
            except TypeError:
                attrs[name] = json.dumps(value, sort_keys=True)
        if name in docs:
            attrs.docs[name] = docs[name]
    return attrs


def _writer(target: str, source: Path, fmt: str) -> Callable[[BinaryIO], int]:
    nodes = iter_nodes(source, format=fmt)
    if target == "v0.0.1":
        from stg.trace.chakra_v001 import write_stream as write_v001

        return lambda out: write_v001(out, nodes)
    meta = read_metadata(source, format=fmt)
    attrs = _metadata_attrs(meta)
    version = meta["version"] if fmt != "v0.0.1" else ""
    if not version and not attrs:
        version = "0.0.4"
    if target == "json":
        from stg.trace.json_trace import write_stream as write_json

        return lambda out: write_json(out, nodes, attrs, version=version)
    from stg.trace.chakra_v004 import write_stream as write_v004

    return lambda out: write_v004(out, nodes, attrs, version=version)


def convert_file(
    source: str | Path, destination: str | Path, to: str, *, source_format: str | None = None
) -> int:
    """Convert one rank file; return its node count. ``destination`` is replaced atomically."""
    source = Path(source)
    destination = Path(destination)
    target = target_format(to)
    fmt = source_format or detect_format(source)
    if destination.is_dir():
        raise UserError(f"destination {destination} is a directory; give a file name")
    if destination.absolute() == source.absolute():
        raise UserError(f"destination {destination} is the source file")
    counts: list[int] = []
    write_file_atomically(destination, lambda out: counts.append(_writer(target, source, fmt)(out)))
    return counts[0]


def convert_trace(
    source: str | Path, destination: str | Path, to: str, *, source_format: str | None = None
) -> list[Path]:
    """Convert a trace: one rank file, or every rank file of a directory / prefix / pattern
    (with its comm-group file copied beside the output).

    For a single source file ``destination`` is the output file. Otherwise it is an output
    directory (the source's name is kept, with the target's extension) or ``dir/name`` where
    ``name`` follows the ``output_name`` rules of :mod:`stg.trace.writer`. Returns the written
    paths.
    """
    from stg.trace.validate import find_rank_files

    target = target_format(to)
    source = Path(source)
    if source.is_file():
        destination = Path(destination)
        if destination.is_dir():
            destination = destination / _renamed(source.name, EXTENSIONS[target])
        convert_file(source, destination, target, source_format=source_format)
        return [destination]
    files, group_file = find_rank_files(source)
    missing = [rank for rank, f in enumerate(files) if f is None]
    if missing:
        raise UserError(f"{source}: rank files missing for ranks {missing}")
    as_dir = str(destination).endswith(("/", "\\"))
    destination = Path(destination)
    if as_dir or destination.is_dir():
        output_dir, output_name = destination, _base_name(files[0])
    else:
        output_dir, output_name = destination.parent, destination.name
    extension = EXTENSIONS[target]
    names = output_paths(output_name, len(files), extension)
    group_name = comm_group_path(output_name)

    def write(tmp: Path) -> list[Path]:
        written = []
        for path, name in zip(files, names, strict=True):
            assert path is not None
            fmt = source_format or detect_format(path)
            out_path = tmp / name
            with open(out_path, "wb") as out:
                _writer(target, path, fmt)(out)
            written.append(out_path)
        if group_file is not None and group_file.is_file():
            if group_name in names:
                raise UserError(
                    f"output name {output_name!r}: the comm-group file would overwrite a rank file"
                )
            shutil.copyfile(group_file, tmp / group_name)
            written.append(tmp / group_name)
        return written

    return write_atomically(output_dir, output_name, extension, write, "convert")


def _base_name(first: Path | None) -> str:
    """``workload`` for ``workload.0.et`` (so the output is ``workload.%d<ext>``)."""
    assert first is not None
    name = first.name.removesuffix(".gz")
    stem = name.rsplit(".", 2)[0]
    return stem


def _renamed(name: str, extension: str) -> str:
    name = name.removesuffix(".gz")
    stem, dot, _ = name.rpartition(".")
    return (stem if dot else name) + extension
