"""Convert traces between Chakra v0.0.4, v0.0.1 and feeder JSON, one rank file at a time.

v0.0.4 <-> json is lossless: nodes (ids, names, types, deps, every attribute with its value
kind and doc string, start times, inputs/outputs) and the GlobalMetadata survive
v0.0.4 -> json -> v0.0.4 unchanged; ``is_cpu_op``, ``num_ops``, ``tensor_size`` and
``comm_size`` of a third-party trace are written where the source gives them, not added where
it does not (see "Presence" in :mod:`stg.trace.reader`); stg's own traces keep its writers'
rules, so a converted one is what stg generate writes in that format. Well-known attributes
(``num_ops``, ``pg_name``, ...) are written with the value kinds of TRACES.md, which repairs
foreign files that used others, and in their fixed order ahead of the other attributes (a
source that puts others between them gets them reordered).
Converting to v0.0.1 loses what that schema cannot hold (see
:mod:`stg.trace.chakra_v001`) and fails on what it cannot express. Non-scalar top-level
keys of a JSON source (besides ``workload_graph``) become JSON strings in GlobalMetadata.

Nodes stream through: memory stays bounded for protobuf sources (a JSON source is parsed a
second time for the keys its entries give, holding its text). Output is atomic: files are
written to a temporary directory and moved into place only when every rank converted.

Destinations. A single rank file converts into a file (or into an existing directory, keeping
its name). A directory source converts into a directory (created if missing), keeping the
trace's name; a prefix or pattern source converts into a directory (existing, or ending in
``/``) or into ``dir/name``.

No silent overwrite: a conversion is refused (:class:`~stg.errors.UserError`, nothing
written) when it would replace or remove a file that differs from what it writes: a file of
the same name with other bytes, or a rank file of the same output name beyond the new rank
count; a directory destination must moreover not hold rank files of another trace. Re-running
the same conversion is allowed (same bytes). ``force=True`` (``--force``) replaces files of
the same name and removes the extra ranks of the same output name; other files are left
alone.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from stg.errors import TraceError, UserError, check_replaceable
from stg.trace.reader import TraceAttrs, detect_format, infer_kind, iter_nodes, read_metadata
from stg.trace.validate import COMM_GROUP_ATTR
from stg.trace.writer import (
    TRACE_EXTENSIONS,
    comm_group_path,
    output_paths,
    rank_pattern,
    write_atomically,
    write_file_atomically,
)

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


def _writer(
    target: str, source: Path, fmt: str, comm_group_name: str | None = None
) -> Callable[[BinaryIO], int]:
    """Write ``source`` in ``target``. ``comm_group_name`` is what the output's metadata names
    as its comm-group file where the source names one (``""``: none; None: as the source).
    Attributes that read as False or 0 where left out keep their presence (v0.0.4 and JSON)."""
    if target == "v0.0.1":
        from stg.trace.chakra_v001 import write_stream as write_v001

        v001_nodes = iter_nodes(source, format=fmt)
        return lambda out: write_v001(out, v001_nodes)
    meta = read_metadata(source, format=fmt)
    attrs = _metadata_attrs(meta)
    # v0.0.1 has no is_cpu_op, and stg's own files follow its writers' rules in either format
    # (a JSON comm node always states tensor_size): both get the writers' defaults
    presence = fmt != "v0.0.1" and attrs.get("generator") != "stg"
    nodes = iter_nodes(source, format=fmt, presence=presence)
    if comm_group_name is not None and COMM_GROUP_ATTR in attrs:
        if comm_group_name:
            attrs[COMM_GROUP_ATTR] = comm_group_name
        else:
            del attrs[COMM_GROUP_ATTR]
    version = meta["version"] if fmt != "v0.0.1" else ""
    if not version and not attrs:
        version = "0.0.4"
    if target == "json":
        from stg.trace.json_trace import write_stream as write_json

        return lambda out: write_json(out, nodes, attrs, version=version, presence=presence)
    from stg.trace.chakra_v004 import write_stream as write_v004

    return lambda out: write_v004(out, nodes, attrs, version=version, presence=presence)


def convert_file(
    source: str | Path,
    destination: str | Path,
    to: str,
    *,
    source_format: str | None = None,
    force: bool = False,
) -> int:
    """Convert one rank file; return its node count. ``destination`` is replaced atomically,
    and only when it holds the same bytes or ``force`` is set (see module doc)."""
    source = Path(source)
    destination = Path(destination)
    target = target_format(to)
    fmt = source_format or detect_format(source)
    if destination.is_dir():
        raise UserError(f"destination {destination} is a directory; give a file name")
    _check_destination_file(destination, target)
    if destination.absolute() == source.absolute():
        raise UserError(f"destination {destination} is the source file")
    counts: list[int] = []

    def check(tmp: Path) -> None:
        if not force:
            _refuse_overwrite(destination.parent, _differing([(tmp, destination)]))

    write_file_atomically(
        destination, lambda out: counts.append(_writer(target, source, fmt)(out)), check
    )
    return counts[0]


def convert_trace(
    source: str | Path,
    destination: str | Path,
    to: str,
    *,
    source_format: str | None = None,
    force: bool = False,
    comm_group_file: str | Path | None = None,
    notes: list[str] | None = None,
) -> list[Path]:
    """Convert a trace: one rank file, or every rank file of a directory / prefix / pattern
    (with its comm-group file copied beside the output, under the output's default name;
    ``comm_group_file`` names it, else it is found as :func:`stg.trace.validate.locate_comm_groups`
    does, which appends to ``notes`` what it chose).

    For a single source file ``destination`` is the output file. For a directory source it is
    the output directory, created if missing. For a prefix or pattern it is an output
    directory (existing, or ending in ``/``) or ``dir/name`` where ``name`` follows the
    ``output_name`` rules of :mod:`stg.trace.writer`. In a directory the source's name is
    kept, with the target's extension. Without ``force`` nothing different is overwritten
    (see module doc). Returns the written paths.
    """
    from stg.trace.validate import (
        check_rank_set,
        find_rank_files,
        locate_comm_groups,
        read_comm_groups,
    )

    target = target_format(to)
    source = Path(source)
    if source.is_file() and comm_group_file is not None:
        raise UserError(
            "--comm_group_file: one rank file converts alone; give the trace's directory or "
            "prefix to convert its comm-group file too"
        )
    if source.is_file():
        destination = Path(destination)
        if destination.is_dir():
            destination = destination / _renamed(source.name, EXTENSIONS[target])
        _check_destination_file(destination, target)
        convert_file(source, destination, target, source_format=source_format, force=force)
        return [destination]
    extension = EXTENSIONS[target]
    into_dir = source.is_dir() or str(destination).endswith(("/", "\\"))
    destination = Path(destination)
    if source.is_dir() and destination.exists() and not destination.is_dir():
        raise UserError(
            f"destination {destination} is not a directory; a directory source converts into "
            "a directory (created if missing)"
        )
    files, default_group = find_rank_files(source)
    check_rank_set(files)
    group_file, note = locate_comm_groups(files, default_group, comm_group_file)
    if note and notes is not None:
        notes.append(note)
    if group_file is not None and group_file.is_file():
        try:
            read_comm_groups(group_file)  # copied only when it parses strictly
        except TraceError as exc:
            raise UserError(f"comm-group file {exc}; nothing converted") from None
    into_dir = into_dir or destination.is_dir()
    if into_dir:
        output_dir, output_name = destination, _output_name(source, files[0], extension)
    else:
        output_dir, output_name = destination.parent, destination.name
    names = output_paths(output_name, len(files), extension)
    group_name = comm_group_path(output_name)

    copy_groups = group_file is not None and group_file.is_file()

    def write(tmp: Path) -> list[Path]:
        written = []
        for path, name in zip(files, names, strict=True):
            assert path is not None
            fmt = source_format or detect_format(path)
            out_path = tmp / name
            with open(out_path, "wb") as out:
                _writer(target, path, fmt, group_name if copy_groups else "")(out)
            written.append(out_path)
        if copy_groups:
            assert group_file is not None
            if group_name in names:
                raise UserError(
                    f"output name {output_name!r}: the comm-group file would overwrite a rank file"
                )
            shutil.copyfile(group_file, tmp / group_name)
            written.append(tmp / group_name)
        if not force:
            pattern = rank_pattern(output_name, extension)
            differing = _differing((p, output_dir.absolute() / p.name) for p in written)
            stale = _other_rank_files(output_dir, {p.name for p in written}, pattern, into_dir)
            _refuse_overwrite(output_dir, differing + stale)
        return written

    return write_atomically(output_dir, output_name, extension, write, "convert")


def _check_destination_file(destination: Path, target: str) -> None:
    """Refuse an output file that is not a regular file (a device, a pipe), or whose name
    readers take for the other format (a JSON trace named ``.et``, a protobuf one ``.json``)."""
    check_replaceable(destination)
    extension = EXTENSIONS[target]
    name = destination.name.removesuffix(".gz").removesuffix(".GZ")
    for other in TRACE_EXTENSIONS:
        if other != extension and name.lower().endswith(other):
            kind = "JSON" if other == ".json" else "protobuf"
            example = name[: len(name) - len(other)] + extension
            raise UserError(
                f"destination {destination} ends in {other!r}, the extension of {kind} traces "
                f"(readers would take it for one), but --to {target} writes {extension!r} files; "
                f"allowed: a name ending in {extension!r} (e.g. {example!r}) or in another "
                "extension"
            )


_ANY_RANK_FILE = re.compile(r"^(.+)\.(0|[1-9][0-9]*)\.(et|json)(\.gz)?\Z", re.IGNORECASE)


def _differing(pairs: Iterable[tuple[Path, Path]]) -> list[Path]:
    """The existing destinations of ``(new, destination)`` pairs whose bytes differ."""
    out = []
    for new, old in pairs:
        if os.path.lexists(old) and (not old.is_file() or not filecmp.cmp(new, old, shallow=False)):
            out.append(old)
    return out


def _other_rank_files(directory: Path, keep: set[str], pattern: str, any_trace: bool) -> list[Path]:
    """Rank files in ``directory`` that the conversion does not write: those of ``pattern``
    (which the writer would remove) and, with ``any_trace``, those of any other trace."""
    head, _, tail = pattern.replace("%%", "\0").partition("%d")
    own = re.compile(
        re.escape(head.replace("\0", "%"))
        + r"(0|[1-9][0-9]*)"
        + re.escape(tail.replace("\0", "%"))
        + r"\Z"
    )
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    matches = {e: _ANY_RANK_FILE.match(e) for e in entries}
    group_files = {m[1] + ".json" for m in matches.values() if m}
    found = []
    for entry in entries:
        if entry in keep or entry.startswith("."):
            continue
        mine = own.match(entry) is not None
        other = any_trace and matches[entry] is not None and entry not in group_files
        if (mine or other) and (directory / entry).is_file():
            found.append(directory / entry)
    return found


def refuse_different(directory: Path, written: Iterable[Path]) -> None:
    """Refuse (one :class:`UserError` line) to move ``written`` files into ``directory`` where
    a file of the same name holds other bytes (re-running the same conversion is fine)."""
    _refuse_overwrite(directory, _differing((p, directory.absolute() / p.name) for p in written))


def _refuse_overwrite(directory: Path, paths: list[Path]) -> None:
    if not paths:
        return
    shown = ", ".join(p.name for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    raise UserError(
        f"{directory} already holds a different trace ({shown}); this conversion would "
        "overwrite it: choose another destination, remove it, or pass --force to replace it"
    )


def _output_name(source: Path, first: Path | None, extension: str) -> str:
    """The output name in a destination directory: the source's name with the target's
    extension (``workload.0.et`` -> ``workload``, i.e. ``workload.%d<ext>``;
    ``out/rank%d.et`` -> ``rank%d<ext>``)."""
    if "%d" in source.name:
        head, _, tail = source.name.partition("%d")
        tail = tail.removesuffix(".gz")
        stem, dot, ext = tail.rpartition(".")
        if dot and "." + ext.lower() in TRACE_EXTENSIONS:
            tail = stem
        return f"{head}%d{tail}{extension}"
    assert first is not None
    name = first.name.removesuffix(".gz")
    return name.rsplit(".", 2)[0]


def _renamed(name: str, extension: str) -> str:
    name = name.removesuffix(".gz")
    stem, dot, _ = name.rpartition(".")
    return (stem if dot else name) + extension
