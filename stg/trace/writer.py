"""Output naming, record framing and atomic writing, shared by all emitters.

Naming (TRACES.md): rank files are ``output_name % rank``; an ``output_name`` without ``%d``
gets ``.%d`` plus the emitter's extension appended (``workload`` -> ``workload.0.et``). The
comm-group file is ``output_name`` with ``.%d`` (or a bare ``%d``) removed and its extension
replaced by ``.json`` (``workload.%d.et`` -> ``workload.json``).

Atomic writing (:func:`write_workload`): the emitter writes every file into a fresh temporary
directory on the file system of ``output_dir``, so that every move below is a rename within
one file system (``output_dir`` may be a mount point, e.g. a Docker volume):

* if ``output_dir`` does not exist, the temporary directory is made beside it (in its parent)
  and renamed to it: one atomic step;
* if it exists, the temporary directory is made inside it, and each file of this run
  replaces its namesake with an atomic rename. Files of the same output name left from an
  earlier run are removed, so the directory holds one consistent trace: rank files beyond
  this run's world size (``workload.7.et`` when this run has 4 ranks) and, when this run
  writes its comm-group file under another name (``stg generate --comm_group_file``), the
  earlier comm-group file of the default name (``workload.json``, removed only when it is a
  comm-group map). Other files are left alone. Replaced and removed files are first moved
  into the temporary directory, and if any step fails every file is put back, so a failure
  leaves the old state and no partial file. (A crash of the machine in the middle of this
  switch can leave a mix of complete old and new files, never a truncated one.)

An unwritable destination is reported as a one-line :class:`stg.errors.UserError` before
anything is written. A fault of the file system while writing (a full disk or quota, a
read-only file system, no permission: :data:`stg.errors.WRITE_FAULTS`) is reported as one
:class:`stg.errors.OutputError` line naming the destination, after the temporary files are
removed and any moved file is put back.

Leftovers of killed runs: a run holds an exclusive ``flock`` on its temporary directory (or,
for :func:`write_file_atomically`, its temporary file) ``.NAME.stg-tmp-*`` from creation until
it is moved into place or removed. A run into the same place first removes such entries that
are older than its own start and whose lock is free (their run was killed); entries of runs
still in progress keep their lock and are left alone. Files that a killed run had already
moved out of ``output_dir`` into its backup (``.old``) and not yet replaced are first moved
back.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import stg
from stg.core.workload import COMM_TYPES
from stg.errors import OutputError, UserError, check_replaceable, is_write_fault, output_error

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, so no cleanup of leftovers
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from stg.core.workload import Node, Workload
    from stg.host.records import Emitter

_DIRECTIVE = re.compile(r"%.")
TRACE_EXTENSIONS: tuple[str, ...] = (".et", ".json")  # what readers tell formats apart by


def check_output_name(output_name: str) -> None:
    """Reject names that cannot be used: path separators, stray ``%`` directives."""
    if not output_name or output_name in (".", ".."):
        raise UserError(f"output_name={output_name!r} must be a non-empty file name")
    if "/" in output_name or "\\" in output_name or "\0" in output_name:
        raise UserError(
            f"output_name={output_name!r} must be a file name without directories; "
            "use output_dir for the directory"
        )
    directives = [d for d in _DIRECTIVE.findall(output_name) if d != "%%"]
    if (
        output_name.replace("%%", "").count("%") != len(directives)
        or any(d != "%d" for d in directives)
        or len(directives) > 1
    ):
        raise UserError(
            f"output_name={output_name!r} may contain '%d' once (the rank) and no other "
            "'%' directive (write '%%' for a literal '%')"
        )


def rank_pattern(output_name: str, extension: str) -> str:
    """The ``%d`` pattern of the rank files: ``output_name`` with ``.%d<extension>`` appended
    when it has no ``%d``."""
    check_output_name(output_name)
    if "%d" in output_name.replace("%%", ""):
        _check_extension(output_name, extension)
        return output_name
    return f"{output_name}.%d{extension}"


def _check_extension(output_name: str, extension: str) -> None:
    """Refuse a rank-file extension that readers take for the other format: a protobuf trace
    named ``.json`` is read as JSON, a JSON trace named ``.et`` as protobuf."""
    if extension.lower() not in TRACE_EXTENSIONS:
        return
    tail = output_name.replace("%%", "\0").partition("%d")[2].lower().removesuffix(".gz")
    for other in TRACE_EXTENSIONS:
        if other != extension.lower() and tail.endswith(other):
            base = output_name[:-3] if output_name.lower().endswith(".gz") else output_name
            example = base[: len(base) - len(other)] + extension
            kind = "JSON" if other == ".json" else "protobuf"
            raise UserError(
                f"output_name={output_name!r} ends in {other!r}, the extension of {kind} "
                f"traces, but this format writes {extension!r} files; allowed: a name ending "
                f"in {extension!r} (e.g. {example!r}) or one without '%d' "
                f"('.%d{extension}' is appended)"
            )


def output_paths(output_name: str, world_size: int, extension: str) -> list[str]:
    """The rank file names ``[name of rank 0, name of rank 1, ...]``."""
    pattern = rank_pattern(output_name, extension)
    return [pattern % rank for rank in range(world_size)]


def comm_group_path(output_name: str) -> str:
    """The comm-group file name for ``output_name``: the name without its rank part, plus
    ``.json``, as the original STG does.

    The rank part is ``%d`` with the ``.`` before it and the extension after it
    (``workload.%d.et`` -> ``workload.json``, ``rank%d.et`` -> ``rank.json``, ``w.%d`` ->
    ``w.json``, ``w.%d.v1.et`` -> ``w.v1.json``). A name without ``%d`` gets the rank part
    ``.%d<extension>`` appended, so its comm-group file is the name plus ``.json``, dots and
    all (``llama3.1-70b`` -> ``llama3.1-70b.json``).
    """
    check_output_name(output_name)
    escaped = output_name.replace("%%", "\0")
    head, rank, tail = escaped.partition("%d")
    if rank:
        head = head.removesuffix(".")
        tail = tail.removesuffix(".gz")
        stem, dot, _ = tail.rpartition(".")
        if dot:
            tail = stem
    name = (head + tail).replace("\0", "%")
    if not name or name in (".", ".."):
        raise UserError(f"output_name={output_name!r} leaves no name for the comm-group file")
    return name + ".json"


def format_comm_groups(groups: Mapping[int, Sequence[int]]) -> str:
    """The comm-group JSON text: ``{"1": [0, 1], ...}``, keys in numeric order, members
    sorted, one group per line; groups with fewer than two members are left out."""
    lines = [
        f"  {json.dumps(str(gid))}: {json.dumps(sorted(int(m) for m in groups[gid]))}"
        for gid in sorted(groups)
        if len(groups[gid]) > 1
    ]
    if not lines:
        return "{}\n"
    return "{\n" + ",\n".join(lines) + "\n}\n"


def used_comm_groups(workload: Workload) -> dict[int, tuple[int, ...]]:
    """The groups of ``workload.comm_groups`` with more than one member."""
    return {
        int(gid): tuple(sorted(members))
        for gid, members in workload.comm_groups.items()
        if len(members) > 1
    }


def write_comm_groups(workload: Workload, directory: Path, output_name: str) -> Path:
    """Write the comm-group file of ``workload`` into ``directory``; return its path.

    Call it after writing the rank files: it refuses to overwrite one of them.
    """
    path = Path(directory) / comm_group_path(output_name)
    if path.exists():
        raise UserError(
            f"output_name={output_name!r}: the comm-group file {path.name} would overwrite a "
            "rank file; choose a name with '.%d'"
        )
    path.write_text(format_comm_groups(used_comm_groups(workload)), encoding="utf-8")
    return path


def _metadata_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), default=str)
    return str(value)


def generator_metadata(
    workload: Workload, rank: int, output_name: str | None = None
) -> dict[str, Any]:
    """The GlobalMetadata attributes of one rank file of a generated workload; with the
    ``output_name`` it is written under, ``comm_group_file`` names its comm-group file (the
    workload's ``comm_group_file`` metadata, else the default name) for readers to find."""
    attrs: dict[str, Any] = {
        "generator": "stg",
        "generator_version": stg.__version__,
        "rank": rank,
        "world_size": workload.world_size,
    }
    if output_name is not None:
        named = workload.metadata.get("comm_group_file")
        attrs["comm_group_file"] = named or comm_group_path(output_name)
    for key in sorted(workload.metadata):
        if key not in attrs:
            attrs[key] = _metadata_value(workload.metadata[key])
    return attrs


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def frame(payload: bytes) -> bytes:
    """One record: the payload preceded by its length as a varint (never empty)."""
    if not payload:
        raise ValueError("refusing to write an empty record: Chakra readers stop at one")
    return varint(len(payload)) + payload


def rank_files(
    workload: Workload, node_record: Callable[[Node], bytes]
) -> Iterator[tuple[int, list[bytes]]]:
    """Yield ``(rank, records)`` for each rank: the framed node records in id order.

    ``node_record(node) -> bytes`` encodes one node; each non-comm template is encoded once
    per rank class and each comm node once per distinct resolved content.
    """
    static: dict[int, list[bytes | None]] = {}
    orders: dict[int, list[int]] = {}
    comm_cache: dict[tuple[Any, ...], bytes] = {}
    for graph in workload.ranks:
        rank_class = graph.rank_class
        templates = rank_class.nodes
        key = rank_class.index
        if key not in static:
            order = sorted(range(len(templates)), key=lambda i: templates[i].id)
            orders[key] = order
            static[key] = [
                None if t.type in COMM_TYPES else node_record(graph.resolve(t)) for t in templates
            ]
        cached = static[key]
        records: list[bytes] = []
        append = records.append
        for i in orders[key]:
            record = cached[i]
            if record is None:
                node = graph.resolve(templates[i])
                ckey = (key, i, node.comm_group, node.comm_src, node.comm_dst)
                record = comm_cache.get(ckey)
                if record is None:
                    record = comm_cache[ckey] = node_record(node)
            append(record)
        yield graph.rank, records


WRITING = "writing rank files"
"""The phase :func:`write_rank_files` reports to a progress callback."""

_progress: contextvars.ContextVar[Callable[[str, int, int], None] | None] = contextvars.ContextVar(
    "stg_write_progress", default=None
)
"""The progress callback of the :func:`write_workload` call in progress, for the emitters'
:func:`write_rank_files` calls (the emitter interface does not pass one)."""


def write_rank_files(
    workload: Workload,
    directory: Path,
    output_name: str,
    extension: str,
    node_record: Callable[[Node], bytes],
    file_bytes: Callable[[int, list[bytes]], bytes],
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Path]:
    """Write every rank's file into ``directory`` (``file_bytes(rank, records)`` assembles it
    from the rank's encoded node records), then the comm-group file; return the paths.

    ``progress(WRITING, files written, rank count)`` is called after each rank file (default:
    the callback given to the enclosing :func:`write_workload`)."""
    directory = Path(directory)
    names = output_paths(output_name, workload.world_size, extension)
    report = progress if progress is not None else _progress.get()
    written: list[Path] = []
    for rank, records in rank_files(workload, node_record):
        path = directory / names[rank]
        path.write_bytes(file_bytes(rank, records))
        written.append(path)
        if report is not None:
            report(WRITING, len(written), workload.world_size)
    written.append(write_comm_groups(workload, directory, output_name))
    return written


def _rank_file_regex(output_name: str, extension: str) -> re.Pattern[str]:
    """Matches the names of the rank files of ``output_name``, of any rank."""
    pattern = rank_pattern(output_name, extension)
    head, _, tail = pattern.replace("%%", "\0").partition("%d")
    head, tail = head.replace("\0", "%"), tail.replace("\0", "%")
    return re.compile(re.escape(head) + r"(0|[1-9][0-9]*)" + re.escape(tail) + r"\Z")


def _stale_rank_files(
    directory: Path, output_name: str, extension: str, keep: set[str]
) -> list[Path]:
    regex = _rank_file_regex(output_name, extension)
    stale = []
    for entry in sorted(os.listdir(directory)):
        if entry not in keep and regex.match(entry) and (directory / entry).is_file():
            stale.append(directory / entry)
    return stale


_COMM_GROUP_SCAN_LIMIT = 64 << 20
"""Larger files are never taken for an earlier comm-group file."""


def _stale_comm_groups(
    directory: Path, output_name: str, extension: str, written: set[str]
) -> list[Path]:
    """The earlier comm-group file of ``output_name`` under its default name, when this run
    writes its comm-group file under another name (a written file that is not a rank file)
    and that default file is a comm-group map, as stg writes it; else nothing."""
    default = comm_group_path(output_name)
    regex = _rank_file_regex(output_name, extension)
    if default in written or all(regex.match(name) for name in written):
        return []
    path = directory / default
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _COMM_GROUP_SCAN_LIMIT:
            return []
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return []
    is_map = isinstance(data, dict) and all(
        isinstance(key, str)
        and key.isdigit()
        and isinstance(members, list)
        and all(type(m) is int for m in members)
        for key, members in data.items()
    )
    return [path] if is_map else []


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _denied(output: Path, reason: str = "permission denied") -> OutputError:
    return OutputError(f"cannot write output_dir={output}: {reason}")


def _unwritable(directory: Path) -> str:
    """Why ``directory`` cannot be written: a read-only file system, else no permission."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & getattr(os, "ST_RDONLY", 0))
    except (OSError, AttributeError):
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def _make_dirs(directory: Path, output: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return what was created (outermost
    first). Errors name ``output``, the path the caller is writing."""
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        raise _denied(output, f"{existing} is not a directory")
    if existing == directory:
        return []
    if not _writable(existing):
        raise _denied(output, _unwritable(existing))
    missing = []
    p = directory
    while p != existing:
        missing.append(p)
        p = p.parent
    created: list[Path] = []
    for p in reversed(missing):
        try:
            p.mkdir()
        except OSError as exc:
            _remove_dirs(created)
            raise _denied(output, exc.strerror or str(exc)) from None
        created.append(p)
    return created


def _prepare_parent(output_dir: Path) -> tuple[Path, list[Path]]:
    """Create missing parents of ``output_dir``; return (staging parent, created dirs).

    The staging parent is ``output_dir`` itself when it exists (the files it replaces are on
    its file system, which may differ from its parent's: a mount point), else its parent."""
    parent = output_dir.parent
    created = _make_dirs(parent, output_dir)
    if output_dir.exists():
        if not output_dir.is_dir():
            _remove_dirs(created)
            raise _denied(output_dir, "it exists and is not a directory")
        if not _writable(output_dir):
            raise _denied(output_dir, _unwritable(output_dir))
        return output_dir, created
    if not _writable(parent):
        _remove_dirs(created)
        raise _denied(output_dir, _unwritable(parent))
    return parent, created


def _remove_dirs(created: list[Path]) -> None:
    for p in reversed(created):
        try:
            p.rmdir()
        except OSError:
            pass


_TMP_MARK = ".stg-tmp-"
_LOCK_TRIES = 20


def _try_lock(fd: int, path: Path) -> bool | None:
    """Take an exclusive lock on ``fd`` without waiting. True: taken and ``path`` still names
    that file; False: another process holds it, or ``path`` now names something else; None:
    this system or file system has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    try:
        here, held = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_ino, here.st_dev) == (held.st_ino, held.st_dev)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _locked_tmp_dir(prefix: str, parent: Path) -> tuple[Path, int | None]:
    """A fresh temporary directory ``parent/prefix*`` and the open descriptor that holds its
    lock (None without locks). Retries when a cleaner of leftovers got to it first."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    for _ in range(_LOCK_TRIES):
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            fd = os.open(tmp, flags)
        except FileNotFoundError:
            continue
        locked = _try_lock(fd, tmp)
        if locked is None:
            os.close(fd)
            return tmp, None
        if locked:
            return tmp, fd
        os.close(fd)  # a cleaner holds it and removes it
    raise OSError(f"could not lock a temporary directory in {parent}")


def _locked_tmp_file(prefix: str, parent: Path) -> tuple[int, Path, int | None]:
    """``(write fd, path, lock fd)`` of a fresh temporary file ``parent/prefix*``; the lock fd
    (None without locks) shares the lock, so it outlives closing the write fd."""
    for _ in range(_LOCK_TRIES):
        handle, name = tempfile.mkstemp(prefix=prefix, dir=parent)
        tmp = Path(name)
        locked = _try_lock(handle, tmp)
        if locked is None:
            return handle, tmp, None
        if locked:
            return handle, tmp, os.dup(handle)
        os.close(handle)
    raise OSError(f"could not lock a temporary file in {parent}")


def remove_stale_tmp(
    places: Sequence[Path], prefix: str, started: float, output_dir: Path | None = None
) -> list[Path]:
    """Remove ``prefix*`` entries (``.NAME.stg-tmp-*``) of killed runs from ``places``: those
    older than ``started`` whose lock is free. Backups in a stale directory's ``.old`` that
    are missing from ``output_dir`` are moved back first. Returns what was removed; never
    raises (a leftover that cannot be removed stays)."""
    removed: list[Path] = []
    if fcntl is None:
        return removed
    seen: set[Path] = set()
    for place in places:
        if place in seen:
            continue
        seen.add(place)
        try:
            entries = sorted(e for e in os.listdir(place) if e.startswith(prefix))
        except OSError:
            continue
        for entry in entries:
            path = place / entry
            try:
                info = os.lstat(path)
                if info.st_mtime >= started or not (
                    stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)
                ):
                    continue
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                continue
            try:
                if not _try_lock(fd, path):
                    continue
                if stat.S_ISDIR(info.st_mode):
                    if output_dir is not None:
                        _restore_backups(path / ".old", output_dir)
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                if not os.path.lexists(path):
                    removed.append(path)
            except OSError:
                continue
            finally:
                os.close(fd)
    return removed


def _restore_backups(backup: Path, output_dir: Path) -> None:
    """Move files that a killed switch had moved out of ``output_dir`` back where nothing has
    replaced them."""
    if not backup.is_dir() or not output_dir.is_dir():
        return
    for saved in sorted(backup.iterdir()):
        final = output_dir / saved.name
        if saved.is_file() and not os.path.lexists(final):
            try:
                os.rename(saved, final)
            except OSError:
                pass


def write_workload(
    workload: Workload,
    emitter: Emitter,
    output_dir: str | Path,
    output_name: str,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Path]:
    """Write ``workload`` with ``emitter`` into ``output_dir`` atomically (see module doc).

    Returns the final paths of the written files, rank files first in rank order.
    ``progress(WRITING, done, rank count)`` reports the rank files written: after each one
    where the emitter uses :func:`write_rank_files`, else at the start and the end.
    """

    def write(tmp: Path) -> list[Path]:
        if progress is None:
            return [Path(p) for p in emitter.write(workload, tmp, output_name)]
        progress(WRITING, 0, workload.world_size)
        token = _progress.set(progress)
        try:
            paths = [Path(p) for p in emitter.write(workload, tmp, output_name)]
        finally:
            _progress.reset(token)
        progress(WRITING, workload.world_size, workload.world_size)
        return paths

    return write_atomically(output_dir, output_name, emitter.extension, write, emitter.name)


def write_atomically(
    output_dir: str | Path,
    output_name: str,
    extension: str,
    write: Callable[[Path], list[Path]],
    writer_name: str = "writer",
) -> list[Path]:
    """Run ``write(tmp)``, which writes files into a fresh temporary directory and returns
    their paths, then move them into ``output_dir`` atomically (see module doc)."""
    started = time.time()
    output_dir = Path(output_dir).absolute()
    rank_pattern(output_name, extension)  # reject a bad name before touching disk
    comm_group_path(output_name)
    staging_parent, created = _prepare_parent(output_dir)
    prefix = f".{output_dir.name}{_TMP_MARK}"
    remove_stale_tmp([output_dir.parent, output_dir], prefix, started, output_dir)
    try:
        tmp, lock = _locked_tmp_dir(prefix, staging_parent)
    except OSError as exc:
        _remove_dirs(created)
        raise _denied(output_dir, exc.strerror or str(exc)) from None
    try:
        staged = write(tmp)
        for p in staged:
            if p.parent != tmp or not p.is_file():
                raise RuntimeError(f"{writer_name} returned {p}, not a file it wrote into {tmp}")
        umask = os.umask(0)
        os.umask(umask)
        for p in staged:
            os.chmod(p, 0o666 & ~umask)
        if not output_dir.exists():
            os.chmod(tmp, 0o777 & ~umask)
            os.rename(tmp, output_dir)
            return [output_dir / p.name for p in staged]
        switched = _switch_files(tmp, staged, output_dir, output_name, extension)
        shutil.rmtree(tmp, ignore_errors=True)
        return switched
    except BaseException as exc:
        _discard(tmp)
        _remove_dirs(created)
        if is_write_fault(exc):
            raise _denied(output_dir, exc.strerror or str(exc)) from None
        raise
    finally:
        _close(lock)


def _discard(tmp: Path) -> None:
    """Remove the temporary directory of a failed write, unless its backup still holds files
    that the switch could not put back (the next run into the same place puts them back)."""
    backup = tmp / ".old"
    try:
        if backup.is_dir() and any(backup.iterdir()):
            return
    except OSError:
        return
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)


def write_file_atomically(
    path: str | Path,
    write: Callable[[BinaryIO], object],
    check: Callable[[Path], object] | None = None,
) -> Path:
    """Write one file through ``write(stream)`` into a temporary file beside it, then rename
    it into place; on any failure the old file (if any) is untouched. ``check(tmp)``, called
    with the complete temporary file before the rename, may raise to keep the old file. A
    fault of the file system (:data:`stg.errors.WRITE_FAULTS`) is raised as one
    :class:`stg.errors.OutputError` line naming ``path``, after the temporary file is gone."""
    started = time.time()
    path = Path(path).absolute()
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a directory")
    check_replaceable(path)
    parent = path.parent
    try:
        created = _make_dirs(parent, path)
    except UserError as exc:
        raise UserError(str(exc).replace("output_dir=", "", 1)) from None
    if not _writable(parent):
        raise OutputError(f"cannot write {path}: {_unwritable(parent)}")
    prefix = f".{path.name}{_TMP_MARK}"
    remove_stale_tmp([parent], prefix, started)
    try:
        handle, tmp, lock = _locked_tmp_file(prefix, parent)
    except OSError as exc:
        _remove_dirs(created)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
        if check is not None:
            check(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        _remove_dirs(created)
        if is_write_fault(exc):
            raise output_error(path, exc) from None
        raise
    finally:
        _close(lock)
    return path


def _switch_files(
    tmp: Path, staged: list[Path], output_dir: Path, output_name: str, extension: str
) -> list[Path]:
    names = {p.name for p in staged}
    backup = tmp / ".old"
    backup.mkdir()
    moved_out: list[tuple[Path, Path]] = []  # (original, backup)
    moved_in: list[Path] = []
    stale = _stale_rank_files(output_dir, output_name, extension, names)
    stale += _stale_comm_groups(output_dir, output_name, extension, names)
    try:
        for final in [output_dir / n for n in sorted(names)] + stale:
            if final.exists() or final.is_symlink():
                saved = backup / final.name
                os.rename(final, saved)
                moved_out.append((final, saved))
        for p in staged:
            final = output_dir / p.name
            os.rename(p, final)
            moved_in.append(final)
    except BaseException:
        _put_back(moved_in, moved_out)
        raise
    return [output_dir / p.name for p in staged]


def _put_back(moved_in: list[Path], moved_out: list[tuple[Path, Path]]) -> None:
    """Undo a switch: remove the new files, move the old ones back. What cannot be moved back
    stays in the backup, which the temporary directory then keeps (see :func:`_discard`)."""
    restored = {final for final, _ in moved_out}
    for final in moved_in:
        if final not in restored:
            try:
                final.unlink(missing_ok=True)
            except OSError:
                pass
    for final, saved in reversed(moved_out):
        try:
            os.replace(saved, final)
        except OSError:
            pass
