"""Statistics of trace files, computed by draining them through the
:class:`~stg.trace.feeder.ETFeeder`.

Used by ``stg feed`` and ``stg inspect trace``. One pass per rank file with bounded memory
(the feeder's window plus one small integer per node id for the critical path). A valid file
is drained by the compiled copy of the feeder protocol in :mod:`stg.trace.decode` (same
windowing, same rounds: tests/test_decode.py compares the two on fuzzed graphs); a file with
any feeder error, or a ``--dot`` request, goes through the ETFeeder itself, which reports the
error and the counts up to it.

The drain is level-synchronous: each *round* issues every ready node, then completes them
all. With a window that holds the whole trace, the number of rounds is the critical path
length in nodes; a smaller window can only add rounds.
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from stg.core.workload import CollectiveType, NodeType
from stg.errors import TraceError, UserError, check_replaceable, reported_write_faults
from stg.trace.feeder import DEFAULT_WINDOW, DepsMode, ETFeeder, ETFeederNode, FeederError

_RANK_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)(?P<ext>\.[A-Za-z0-9]+)?(?:\.gz)?$")


@dataclass(frozen=True, slots=True)
class TraceFile:
    """One rank file: ``name`` is the trace name shared by its ranks (``workload``)."""

    name: str
    rank: int
    path: Path


def find_trace_files(path: str | os.PathLike[str]) -> list[TraceFile]:
    """The rank files that ``path`` names, sorted by trace name then rank.

    ``path`` is a file, a directory (all ``<name>.<rank>.<ext>`` files in it), or a prefix
    (``out/workload`` or ``out/workload.%d.et``: the files ``out/workload.<rank>.*``). The
    comm-group file ``<name>.json`` of a trace is never taken for a rank file of another
    (``llama3.1.json`` beside ``llama3.1.0.et`` is not rank 1 of ``llama3``).
    Raises :class:`~stg.errors.UserError` when nothing matches or a trace's rank set is
    partial (:func:`stg.trace.validate.check_rank_set`).
    """
    given = Path(path)
    if given.is_file():  # one rank file named alone: no rank set to check
        match = _RANK_FILE.match(given.name)
        if match:
            return [TraceFile(match["prefix"], int(match["rank"]), given)]
        return [TraceFile(given.name, 0, given)]
    found: list[TraceFile] = []
    pattern: re.Pattern[str] | None = None
    if given.is_dir():
        for child in given.iterdir():
            match = _RANK_FILE.match(child.name)
            if match and child.is_file():
                found.append(TraceFile(match["prefix"], int(match["rank"]), child))
    else:
        folder = given.parent
        name = given.name
        if "%d" in name:
            head, _, tail = name.partition("%d")
            pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"$")
        if folder.is_dir():
            for child in folder.iterdir():
                if not child.is_file():
                    continue
                if pattern is not None:
                    m = pattern.match(child.name)
                    if m:
                        found.append(TraceFile(head.rstrip("._-") or name, int(m[1]), child))
                    continue
                match = _RANK_FILE.match(child.name)
                if match and match["prefix"] == name:
                    found.append(TraceFile(name, int(match["rank"]), child))
    if found and pattern is None:
        found = _without_group_files(found, given if given.is_dir() else given.parent)
    if not found:
        raise UserError(
            f"{given}: no trace files (expected a file, a directory of <name>.<rank>.et "
            "files, or a prefix such as out/workload)"
        )
    found.sort(key=lambda t: (t.name, t.rank, t.path.name))
    _check_rank_sets(found)
    return found


def _check_rank_sets(found: list[TraceFile]) -> None:
    """Refuse a trace whose rank set is partial (see
    :func:`stg.trace.validate.check_rank_set`)."""
    from stg.trace.validate import check_rank_set

    traces: dict[tuple[Path, str], dict[int, Path]] = {}
    for trace in found:
        traces.setdefault((trace.path.parent, trace.name), {})[trace.rank] = trace.path
    for ranks in traces.values():
        check_rank_set([ranks.get(r) for r in range(max(ranks) + 1)])


def _without_group_files(found: list[TraceFile], folder: Path) -> list[TraceFile]:
    """``found`` less the files named like the comm-group file of a trace in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    group_files = set()
    for name in names:
        match = _RANK_FILE.match(name)
        if match:
            group_files.add(match["prefix"] + ".json")
    return [t for t in found if t.path.name not in group_files]


def check_comm_groups(
    path: str | os.PathLike[str], files: list[TraceFile], explicit: Path | None = None
) -> None:
    """Refuse (one :class:`~stg.errors.UserError` line), as ``stg validate`` and ``stg
    convert`` do, a trace of ``files`` whose metadata names a comm-group file that is missing
    or does not parse as one. ``explicit`` (``--comm_group_file``, checked by the caller) takes
    its place; one rank file named alone has none."""
    if explicit is not None or Path(path).is_file():
        return
    from stg.trace.validate import check_recorded_comm_groups

    traces: dict[tuple[Path, str], dict[int, Path]] = {}
    for trace in files:
        traces.setdefault((trace.path.parent, trace.name), {})[trace.rank] = trace.path
    for (folder, _), ranks in traces.items():
        check_recorded_comm_groups([ranks[r] for r in sorted(ranks)], folder)


def select_rank(files: list[TraceFile], rank: int | None) -> list[TraceFile]:
    """The files of ``rank`` (all files when None); a UserError names the ranks present."""
    if rank is None:
        return files
    chosen = [f for f in files if f.rank == rank]
    if not chosen:
        ranks = sorted({f.rank for f in files})
        raise UserError(f"--rank {rank}: no such rank; ranks present: {_ranges(ranks)}")
    return chosen


def _ranges(values: list[int]) -> str:
    parts: list[str] = []
    start = prev = None
    for v in [*values, None]:
        if start is not None and (v is None or v != prev + 1):  # type: ignore[operator]
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if v is not None and start is None:
            start = v
        prev = v
    return ", ".join(parts)


@dataclass(slots=True)
class TraceStats:
    """What one pass over a rank file measures.

    ``flops`` sums ``num_ops`` (floating-point operations); byte counts are in bytes.
    ``collective_bytes`` and ``collective_counts`` are keyed by collective type name.
    ``critical_path`` is the longest dependency chain in nodes and ``critical_path_us`` the
    largest sum of ``runtime`` (microseconds) along a chain.
    """

    path: str
    name: str
    rank: int
    deps: str
    nodes: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    flops: int = 0
    tensor_bytes: int = 0
    collective_counts: dict[str, int] = field(default_factory=dict)
    collective_bytes: dict[str, int] = field(default_factory=dict)
    send_count: int = 0
    send_bytes: int = 0
    recv_count: int = 0
    recv_bytes: int = 0
    critical_path: int = 0
    critical_path_us: int = 0
    rounds: int = 0
    max_width: int = 0
    error: str | None = None
    unreadable: bool = False
    """The error is the reader's: the file is not a readable trace (else the feeder's: the
    trace reads but cannot be fed)."""

    @property
    def mean_width(self) -> float:
        """Mean number of nodes issued per round."""
        return self.nodes / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with sorted keys inside the per-type tables."""
        data = asdict(self)
        del data["unreadable"]
        for key in ("by_type", "collective_counts", "collective_bytes"):
            data[key] = dict(sorted(data[key].items()))
        data["mean_width"] = round(self.mean_width, 6)
        return data


class _IdValues:
    """One integer per node id (0 when unset): an array for dense ids, a dict for the rest."""

    __slots__ = ("_array", "_count", "_dict")

    def __init__(self) -> None:
        self._array = array("q")
        self._dict: dict[int, int] = {}
        self._count = 0

    def get(self, key: int) -> int:
        if 0 <= key < len(self._array):
            return self._array[key]
        return self._dict.get(key, 0)

    def set(self, key: int, value: int) -> None:
        self._count += 1
        arr = self._array
        if 0 <= key < len(arr):
            arr[key] = value
        elif 0 <= key < 2 * self._count + 65536:  # keep the array proportional to the nodes
            arr.frombytes(bytes(8 * (max(key + 1, 2 * len(arr)) - len(arr))))
            arr[key] = value
        else:
            self._dict[key] = value


def analyze(
    trace: TraceFile,
    *,
    deps: DepsMode = "data+ctrl",
    window: int = DEFAULT_WINDOW,
    format: str | None = None,
    dot: IO[str] | None = None,
) -> TraceStats:
    """Drain one rank file and measure it; with ``dot``, also write its graph as DOT.

    A malformed trace does not raise: its :attr:`TraceStats.error` holds the one-line message
    (the counts then cover the nodes completed before the error).
    """
    if dot is None:
        fast = _fast_analyze(trace, deps, window, format)
        if fast is not None:
            return fast
    stats = TraceStats(path=str(trace.path), name=trace.name, rank=trace.rank, deps=deps)
    try:
        with ETFeeder(trace.path, deps=deps, window=window, format=format) as feeder:
            _drain(feeder, stats, dot)
    except TraceError as exc:
        stats.error = str(exc)
        stats.unreadable = not isinstance(exc, FeederError)
    return stats


def error_line(stats: Iterable[TraceStats]) -> str | None:
    """The one error line of ``stg feed`` and ``stg inspect trace`` (None: no error): the first
    unreadable rank file's error, else the first feeder error, and what the other rank files
    with an error share with it."""
    errors = [s for s in stats if s.error is not None]
    if not errors:
        return None
    first = next((s for s in errors if s.unreadable), errors[0])
    rest = [s for s in errors if s is not first]
    if not rest:
        return first.error

    def reason(s: TraceStats) -> tuple[bool, str]:
        return s.unreadable, str(s.error).removeprefix(f"{s.path}: ")

    files = f"rank file{'' if len(rest) == 1 else 's'}"
    if all(reason(s) == reason(first) for s in rest):
        return f"{first.error} (the same in {len(rest)} more {files})"
    unreadable = sum(s.unreadable for s in rest)
    unfed = len(rest) - unreadable
    parts = [f"{unreadable} unreadable"] if unreadable else []
    parts += [f"{unfed} that cannot be fed"] if unfed else []
    return f"{first.error} (and {len(rest)} more {files}: {', '.join(parts)})"


def exit_code(stats: Iterable[TraceStats]) -> int:
    """The exit code of ``stg feed`` and ``stg inspect trace``: 2 when a rank file is not a
    readable trace, 1 when one reads but cannot be fed, else 0."""
    errors = [s for s in stats if s.error is not None]
    if any(s.unreadable for s in errors):
        return 2
    return 1 if errors else 0


_DRAIN_FIELDS = (
    "nodes", "rounds", "max_width", "critical_path", "critical_path_us", "flops", "tensor_bytes",
    "send_count", "send_bytes", "recv_count", "recv_bytes",
)  # fmt: skip


def _fast_analyze(
    trace: TraceFile, deps: str, window: int, format: str | None
) -> TraceStats | None:
    """:func:`analyze` through the compiled drain of :mod:`stg.trace.decode` (the same
    protocol, step by step), or None: then the ETFeeder drains the file (errors, options the
    feeder refuses, no compiled decoder)."""
    from stg.trace import decode
    from stg.trace.feeder import DEPS_MODES
    from stg.trace.reader import FORMATS, detect_format

    if not decode.enabled() or deps not in DEPS_MODES or format not in (None, *FORMATS):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return None
    try:
        fmt = format or detect_format(trace.path)
    except (TraceError, OSError, EOFError, zlib.error):
        return None
    out = decode.drain(trace.path, fmt, window, deps == "data+ctrl")
    if out is None:
        return None
    stats = TraceStats(path=str(trace.path), name=trace.name, rank=trace.rank, deps=deps)
    for key in _DRAIN_FIELDS:
        setattr(stats, key, out[key])
    stats.by_type = {NodeType(t).name: count for t, count in out["by_type"]}
    for ctype, count, size in out["collectives"]:
        name = "UNSET" if ctype is None else CollectiveType(ctype).name
        stats.collective_counts[name] = count
        stats.collective_bytes[name] = size
    return stats


def _drain(feeder: ETFeeder, stats: TraceStats, dot: IO[str] | None) -> None:
    use_ctrl = feeder.deps == "data+ctrl"
    depth = _IdValues()
    span = _IdValues()
    by_type = stats.by_type
    coll_counts = stats.collective_counts
    coll_bytes = stats.collective_bytes
    type_names = {t: t.name for t in NodeType}
    coll_names: dict[CollectiveType | None, str] = {c: c.name for c in CollectiveType}
    coll_names[None] = "UNSET"
    if dot is not None:
        dot.write(f"digraph {_dot_id(f'{stats.name}.{stats.rank}')} {{\n")
        dot.write("  node [shape=box, style=filled, fontname=Helvetica];\n")
    while feeder.has_nodes_to_issue():
        wave: list[ETFeederNode] = []
        node = feeder.get_next_issuable_node()
        while node is not None:
            wave.append(node)
            node = feeder.get_next_issuable_node()
        if not wave:
            raise FeederError(f"{feeder.source_name}: nodes remain but none can be issued")
        stats.rounds += 1
        stats.max_width = max(stats.max_width, len(wave))
        for fnode in wave:
            n = fnode.node
            parents = n.data_deps + n.ctrl_deps if use_ctrl else n.data_deps
            d = s = 0
            for p in parents:
                pd = depth.get(p)
                if pd > d:
                    d = pd
                ps = span.get(p)
                if ps > s:
                    s = ps
            d += 1
            s += n.runtime
            depth.set(n.id, d)
            span.set(n.id, s)
            if d > stats.critical_path:
                stats.critical_path = d
            if s > stats.critical_path_us:
                stats.critical_path_us = s
            stats.nodes += 1
            tname = type_names[n.type]
            by_type[tname] = by_type.get(tname, 0) + 1
            if n.type is NodeType.COMP:
                stats.flops += n.num_ops
            stats.tensor_bytes += n.tensor_size
            if n.type is NodeType.COMM_COLL:
                cname = coll_names[n.comm_type]
                coll_counts[cname] = coll_counts.get(cname, 0) + 1
                coll_bytes[cname] = coll_bytes.get(cname, 0) + n.comm_size
            elif n.type is NodeType.COMM_SEND:
                stats.send_count += 1
                stats.send_bytes += n.comm_size
            elif n.type is NodeType.COMM_RECV:
                stats.recv_count += 1
                stats.recv_bytes += n.comm_size
            if dot is not None:
                _dot_node(dot, fnode, use_ctrl)
        for fnode in wave:
            feeder.free_children_nodes(fnode.id)
        for fnode in wave:
            feeder.remove_node(fnode.id)
    if dot is not None:
        dot.write("}\n")


_DOT_COLORS = {
    NodeType.COMP: "lightblue",
    NodeType.COMM_COLL: "orange",
    NodeType.COMM_SEND: "palegreen",
    NodeType.COMM_RECV: "palegreen",
    NodeType.MEM_LOAD: "khaki",
    NodeType.MEM_STORE: "khaki",
}


def _dot_id(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_node(out: IO[str], fnode: ETFeederNode, use_ctrl: bool) -> None:
    n = fnode.node
    name = n.name if len(n.name) <= 60 else n.name[:57] + "..."
    label = f"{n.id} {n.type.name}\n{name}"
    if n.type is NodeType.COMM_COLL and n.comm_type is not None:
        label += f"\n{n.comm_type.name} {n.comm_size} B"
    elif n.type in (NodeType.COMM_SEND, NodeType.COMM_RECV):
        label += f"\n{n.comm_size} B"
    color = _DOT_COLORS.get(n.type, "white")
    out.write(f"  n{n.id} [label={_dot_id(label)}, fillcolor={color}];\n")
    for p in n.data_deps:
        out.write(f"  n{p} -> n{n.id};\n")
    if use_ctrl:
        for p in n.ctrl_deps:
            if p not in n.data_deps:
                out.write(f"  n{p} -> n{n.id} [style=dashed];\n")


def write_dot(
    trace: TraceFile,
    out_path: str | os.PathLike[str],
    *,
    deps: DepsMode = "data+ctrl",
    window: int = DEFAULT_WINDOW,
    format: str | None = None,
) -> TraceStats:
    """Write one rank's graph as Graphviz DOT to ``out_path``, atomically.

    Nodes appear in issue order; data deps are solid edges, ctrl deps dashed (only with
    ``deps="data+ctrl"``). Nothing is written when the trace is malformed (see ``error``).
    """
    target = Path(out_path)
    folder = target.parent
    if not folder.is_dir():
        raise UserError(f"--dot {target}: directory {folder} does not exist")
    check_replaceable(target)
    with reported_write_faults(target):
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as out:
                stats = analyze(trace, deps=deps, window=window, format=format, dot=out)
            if stats.error is None:
                os.chmod(tmp_name, 0o666 & ~_umask())
                os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    return stats


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def iter_stats(
    files: list[TraceFile],
    *,
    deps: DepsMode = "data+ctrl",
    window: int = DEFAULT_WINDOW,
    format: str | None = None,
    jobs: int | None = 1,
) -> Iterator[TraceStats]:
    """:func:`analyze` each file, in the order of ``files``, with up to ``jobs`` worker
    processes (None or 0: every core)."""
    from stg.trace.parallel import file_sizes, map_ranks

    tasks = [(trace, deps, window, format) for trace in files]
    sizes = file_sizes([t.path for t in files])
    yield from map_ranks(_analyze_task, tasks, jobs, sizes=sizes)


def _analyze_task(task: tuple[TraceFile, Any, int, str | None]) -> TraceStats:
    trace, deps, window, format = task
    return analyze(trace, deps=deps, window=window, format=format)


# -- rendering (for the CLI) ------------------------------------------------------------------

FEED_KEYS: tuple[str, ...] = (
    "path", "name", "rank", "deps", "nodes", "rounds", "max_width", "mean_width", "by_type",
    "error",
)  # fmt: skip


def feed_report(stats: list[TraceStats], window: int) -> dict[str, Any]:
    """The JSON document of ``stg feed --json``."""
    ranks = []
    for s in stats:
        data = s.to_dict()
        ranks.append({k: data[k] for k in FEED_KEYS})
    return {"window": window, "ranks": ranks, "invalid": sum(s.error is not None for s in stats)}


def inspect_report(stats: list[TraceStats]) -> dict[str, Any]:
    """The JSON document of ``stg inspect trace --json``: per-rank stats and totals."""
    ok = [s for s in stats if s.error is None]
    total: dict[str, Any] = {
        "ranks": len(stats),
        "invalid": len(stats) - len(ok),
        "nodes": sum(s.nodes for s in ok),
        "flops": sum(s.flops for s in ok),
        "tensor_bytes": sum(s.tensor_bytes for s in ok),
        "send_bytes": sum(s.send_bytes for s in ok),
        "recv_bytes": sum(s.recv_bytes for s in ok),
        "collective_bytes": _sum_tables(s.collective_bytes for s in ok),
        "critical_path": max((s.critical_path for s in ok), default=0),
    }
    return {"ranks": [s.to_dict() for s in stats], "total": total}


def _sum_tables(tables: Iterator[dict[str, int]] | Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for table in tables:
        for key, value in table.items():
            out[key] = out.get(key, 0) + value
    return dict(sorted(out.items()))


def _types(table: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(table.items())) or "-"


def _label(s: TraceStats) -> str:
    return f"{s.name}.{s.rank}"


def render_feed(stats: list[TraceStats]) -> str:
    """The text table of ``stg feed``: one line per rank."""
    header = ("trace", "nodes", "rounds", "max width", "mean width", "nodes by type")
    rows = [header]
    for s in stats:
        if s.error is not None:
            rows.append((_label(s), "invalid", "-", "-", "-", "-"))
        else:
            rows.append(
                (
                    _label(s),
                    f"{s.nodes:,}",
                    f"{s.rounds:,}",
                    f"{s.max_width:,}",
                    f"{s.mean_width:.2f}",
                    _types(s.by_type),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [row[i].rjust(widths[i]) for i in range(1, len(widths))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines) + "\n"


def render_inspect(stats: list[TraceStats]) -> str:
    """The text report of ``stg inspect trace``: one block per rank, then totals."""
    out: list[str] = []
    for s in stats:
        out.append(f"{_label(s)}  ({s.path})")
        if s.error is not None:
            out.append("  invalid (see the error)")
            continue
        out.append(f"  nodes          {s.nodes:,}  ({_types(s.by_type)})")
        out.append(f"  FLOPs          {s.flops:,}")
        out.append(f"  tensor bytes   {s.tensor_bytes:,}")
        for cname in sorted(s.collective_counts):
            count = s.collective_counts[cname]
            out.append(f"  {cname:<14} {count:,} ops, {s.collective_bytes[cname]:,} bytes")
        if s.send_count:
            out.append(f"  send           {s.send_count:,} ops, {s.send_bytes:,} bytes")
        if s.recv_count:
            out.append(f"  recv           {s.recv_count:,} ops, {s.recv_bytes:,} bytes")
        out.append(
            f"  critical path  {s.critical_path:,} nodes, {s.critical_path_us:,} us of runtime"
        )
    if len(stats) > 1:
        total = inspect_report(stats)["total"]
        out.append(
            f"total  {total['ranks']} ranks, {total['nodes']:,} nodes, "
            f"{total['flops']:,} FLOPs, longest critical path {total['critical_path']:,} nodes"
        )
    return "\n".join(out) + "\n"
