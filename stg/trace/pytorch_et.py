"""PyTorch execution traces in: a profiled job -> Chakra v0.0.4 rank files stg predicts.

A PyTorch host execution trace (the JSON that ``torch.profiler.ExecutionTraceObserver``
writes, schema ``<version>-chakra.0.0.4``), optionally with its Kineto (device) trace, goes
through mlc-chakra's own tools, as a Chakra user runs them:

1. with a Kineto trace, ``chakra_trace_link`` (:class:`chakra.src.trace_link.trace_linker.
   TraceLinker`) merges the two into a host + device JSON trace (it needs PARAM's
   ``et_replay`` package, which mlc-chakra does not install);
2. ``chakra_converter PyTorch`` (:class:`chakra.src.converter.pytorch_converter.
   PyTorchConverter`) writes the Chakra v0.0.4 protobuf trace.

The converter keeps each operator's schema and recorded tensors but no work, so stg then
types each node from those records (:mod:`stg.trace.aten`), for its predictors and for the
calibration tables of ``stg bench``:

- a *top-level* aten operator (one with no operator above it: ``aten::linear``, whose
  ``aten::t`` and ``aten::addmm`` run inside it and add nothing; in the backward pass the
  operators under the autograd functions) gets ``tensor_size`` (bytes), ``num_ops`` (FLOPs
  of a matmul; one per written element of a memory-bound operator), ``dtype``, its ``op``
  (the schema's name) and, for a matmul, the ``gemm`` shape (batch, m, n, k); views and
  all other nodes keep no work (their recorded runtime, if linked from Kineto, still
  counts);
- a ``c10d::`` collective (``allreduce_``, ``broadcast_``, ...) becomes a COMM_COLL node with
  its Chakra type, ``comm_size`` (bytes, as TRACES.md counts them) and process group, and the
  process groups that ``## process_group:init ##`` records become the comm-group file;
- repeated dependencies that the converter writes (a parent both as data and control
  dependency) and dependencies on nodes it removed are dropped (stg validate refuses them);
- in a Kineto-linked trace, a top-level operator's runtime is its inclusive duration and
  the nodes inside it get none, so that its time counts once;
- the GlobalMetadata gains ``options`` = {``dtype``: the dtype of the matmuls (most FLOPs),
  ``profile``: ``eager``}, so the time predictor prices the job as the eager PyTorch it is.

Rank files are written atomically beside the comm-group file (:mod:`stg.trace.writer`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stg.core.workload import OP_ATTR, CollectiveType, Node, NodeType
from stg.errors import TraceError, UserError
from stg.trace.aten import STG_DTYPES, OpWork, op_work, schema_name, tensors
from stg.trace.convert import refuse_different
from stg.trace.reader import TraceAttrs, iter_nodes, read_metadata
from stg.trace.validate import COMM_GROUP_ATTR
from stg.trace.writer import comm_group_path, format_comm_groups, output_paths, write_atomically

CHAKRA_HINT = "pip install 'symbolic-tensor-graph[chakra]'"
PROCESS_GROUP_INIT = "## process_group:init ##"
"""The name of the record that lists a job's process groups (PyTorch's
``ExecutionTraceObserver``; its string argument is their JSON description)."""

COLLECTIVES: dict[str, CollectiveType] = {
    "c10d::allreduce_": CollectiveType.ALL_REDUCE,
    "c10d::allreduce_coalesced_": CollectiveType.ALL_REDUCE,
    "c10d::broadcast_": CollectiveType.BROADCAST,
    "c10d::reduce_": CollectiveType.REDUCE,
    "c10d::allgather_": CollectiveType.ALL_GATHER,
    "c10d::_allgather_base_": CollectiveType.ALL_GATHER,
    "c10d::allgather_into_tensor_coalesced_": CollectiveType.ALL_GATHER,
    "c10d::reduce_scatter_": CollectiveType.REDUCE_SCATTER,
    "c10d::_reduce_scatter_base_": CollectiveType.REDUCE_SCATTER,
    "c10d::reduce_scatter_tensor_coalesced_": CollectiveType.REDUCE_SCATTER,
    "c10d::alltoall_": CollectiveType.ALL_TO_ALL,
    "c10d::alltoall_base_": CollectiveType.ALL_TO_ALL,
    "c10d::gather_": CollectiveType.GATHER,
    "c10d::scatter_": CollectiveType.SCATTER,
    "c10d::barrier": CollectiveType.BARRIER,
}
"""c10d operator schemas -> Chakra collective types (torch/csrc/distributed/c10d/Ops.cpp)."""

INPUT_SIZED = frozenset(
    {
        CollectiveType.ALL_REDUCE,
        CollectiveType.BROADCAST,
        CollectiveType.REDUCE,
        CollectiveType.ALL_GATHER,
        CollectiveType.REDUCE_SCATTER,
        CollectiveType.ALL_TO_ALL,
        CollectiveType.GATHER,
        CollectiveType.SCATTER,
    }
)
"""Collectives whose ``comm_size`` is the bytes of their first argument (TRACES.md: an
all-gather's input shard, a reduce-scatter's and an all-reduce's full buffer, an
all-to-all's buffer); a barrier moves none."""


def _attrs(node: Mapping[str, Any]) -> dict[str, Any]:
    return {a.get("name"): a.get("value") for a in node.get("attrs") or [] if isinstance(a, dict)}


def load_host_trace(path: str | Path) -> dict[str, Any]:
    """A PyTorch host execution trace (JSON); one line naming the problem otherwise."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {name}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{name} is not JSON (a PyTorch execution trace is)") from None
    if not is_host_trace(data):
        raise UserError(
            f"{name} is not a PyTorch execution trace (a JSON object with 'schema' "
            "<version>-chakra.<version> and 'nodes', as ExecutionTraceObserver writes)"
        )
    return data


def is_host_trace(data: Any) -> bool:
    """Whether parsed JSON is a PyTorch host execution trace."""
    return (
        isinstance(data, dict)
        and isinstance(data.get("schema"), str)
        and "-chakra." in data["schema"]
        and isinstance(data.get("nodes"), list)
    )


def sniff_host_trace(path: str | Path) -> bool:
    """Whether a file looks like a PyTorch host execution trace (its first bytes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return head.lstrip().startswith("{") and '"schema"' in head and "-chakra." in head


# -- what each node does ------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """A c10d collective of the trace: its type, bytes and process group name."""

    kind: CollectiveType
    size: int
    group: str | None
    """None where the trace does not tell (no process group, or several)."""


@dataclass
class HostTraceWork:
    """The work the typed records of one host trace give: per node id, the top-level
    operators' :class:`~stg.trace.aten.OpWork` and the collectives; and the process groups."""

    ops: dict[int, OpWork] = field(default_factory=dict)
    collectives: dict[int, Collective] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    schemas: dict[int, str] = field(default_factory=dict)
    inside: set[int] = field(default_factory=set)
    """Nodes that run inside a top-level operator or collective (their time is its time)."""
    inclusive_us: dict[int, float] = field(default_factory=dict)
    """The Kineto-linked inclusive duration of each top-level operator (linked traces)."""


def _process_groups(node: Mapping[str, Any], world: int) -> dict[str, tuple[int, ...]]:
    values = (node.get("inputs") or {}).get("values") or []
    groups: dict[str, tuple[int, ...]] = {}
    for value in values:
        try:
            described = json.loads(value) if isinstance(value, str) else None
        except json.JSONDecodeError:
            continue
        for pg in described or []:
            if not isinstance(pg, dict) or "pg_name" not in pg:
                continue
            ranks = [int(r) for r in pg.get("ranks") or []]
            size = int(pg.get("group_size") or len(ranks) or world)
            groups[str(pg["pg_name"])] = tuple(ranks) if ranks else tuple(range(size))
    return groups


def host_trace_work(trace: Mapping[str, Any], world: int = 1) -> HostTraceWork:
    """What every node of a host trace does (see the module docstring)."""
    nodes = [n for n in trace["nodes"] if isinstance(n, dict) and isinstance(n.get("id"), int)]
    by_id = {n["id"]: n for n in nodes}
    schemas = {n["id"]: str(_attrs(n).get("op_schema") or "") for n in nodes}
    found = HostTraceWork(schemas={i: s for i, s in schemas.items() if s})
    for n in nodes:
        if n.get("name") == PROCESS_GROUP_INIT:
            found.groups.update(_process_groups(n, world))

    def has_op_above(node_id: int) -> bool:
        parent = by_id[node_id].get("ctrl_deps")
        seen = set()
        while isinstance(parent, int) and parent in by_id and parent not in seen:
            if schemas.get(parent):
                return True
            seen.add(parent)
            parent = by_id[parent].get("ctrl_deps")
        return False

    for node_id, schema in schemas.items():
        if not schema:
            continue
        node = by_id[node_id]
        inputs = node.get("inputs") or {}
        outputs = node.get("outputs") or {}
        args = tensors(inputs.get("types") or [], inputs.get("shapes") or [])
        results = tensors(outputs.get("types") or [], outputs.get("shapes") or [])
        kind = COLLECTIVES.get(schema_name(schema))
        if kind is not None:
            size = args[0].nbytes if args and kind in INPUT_SIZED else 0
            found.collectives[node_id] = Collective(kind, size, _group_of(found.groups))
            continue
        if schema_name(schema).startswith("c10d::") or has_op_above(node_id):
            continue
        found.ops[node_id] = op_work(schema, args, results)
        inclusive = node.get("inclusive_dur")
        if isinstance(inclusive, int | float):
            found.inclusive_us[node_id] = float(inclusive)
    tops = set(found.ops) | set(found.collectives)
    for node_id in by_id:
        parent = by_id[node_id].get("ctrl_deps")
        seen: set[int] = set()
        while isinstance(parent, int) and parent in by_id and parent not in seen:
            if parent in tops:
                found.inside.add(node_id)
                break
            seen.add(parent)
            parent = by_id[parent].get("ctrl_deps")
    return found


def _group_of(groups: Mapping[str, tuple[int, ...]]) -> str | None:
    """The process group of a c10d operator: a gloo or NCCL trace records it only as an
    object, so it is the job's one process group; none or several leave it unknown."""
    return next(iter(groups)) if len(groups) == 1 else None


def stg_dtype(param_dtype: str | None) -> str | None:
    """stg's dtype of a PARAM dtype name (None: no stg dtype, e.g. integer tensors)."""
    return STG_DTYPES.get(param_dtype or "")


def main_dtype(work: HostTraceWork) -> str:
    """The stg dtype of the matmuls that do the most FLOPs (fp32 without any)."""
    flops: dict[str, int] = {}
    for op in work.ops.values():
        dtype = stg_dtype(op.dtype)
        if op.kind == "gemm" and dtype is not None:
            flops[dtype] = flops.get(dtype, 0) + op.flops
    return max(sorted(flops), key=lambda d: flops[d]) if flops else "fp32"


# -- chakra's tools -----------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """mlc-chakra (and the trace analysis its linker runs) logs and prints each step; keep
    stg's output to its own lines."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def link_kineto(rank: int, host: Path, kineto: Path, output: Path) -> None:
    """mlc-chakra's trace link of a host trace and its Kineto trace into ``output``."""
    try:
        from chakra.src.trace_link.trace_linker import TraceLinker
    except ImportError as exc:
        if "et_replay" in str(exc):
            raise UserError(
                "--kineto: mlc-chakra's trace linker imports PARAM's et_replay package, which "
                "is not installed (it is not on PyPI; mlc-chakra's error names its source); "
                "convert the host trace alone, without --kineto"
            ) from None
        raise UserError(
            f"--kineto needs mlc-chakra, which is not installed: {CHAKRA_HINT}"
        ) from None
    try:
        with _quiet():
            TraceLinker().link(rank, str(host), str(kineto), str(output))
    except Exception as exc:  # the linker's own failures: one line naming the files
        raise UserError(f"linking {host} with {kineto} failed: {exc}") from None


def chakra_convert(source: Path, output: Path) -> None:
    """mlc-chakra's ``chakra_converter PyTorch`` of a (linked) host trace into ``output``."""
    try:
        from chakra.src.converter.pytorch_converter import PyTorchConverter
    except ImportError:
        raise UserError(
            f"converting a PyTorch trace needs mlc-chakra, which is not installed: {CHAKRA_HINT}"
        ) from None
    try:
        with _quiet():
            PyTorchConverter().convert(str(source), str(output), False)
    except Exception as exc:  # the converter's failures (an unsupported schema version, ...)
        lines = str(exc).strip().splitlines()
        why = lines[0] if lines else type(exc).__name__
        raise UserError(f"mlc-chakra's converter failed on {source}: {why}") from None


# -- typing the converted nodes -----------------------------------------------------------------


def typed_node(
    node: Node, work: HostTraceWork, group_ids: Mapping[str, int], present: set[int]
) -> Node:
    """A converted node with the work of its host record (module docstring); ``present``
    holds the ids of the converted file (a dependency on another is dropped)."""
    data = tuple(d for d in dict.fromkeys(node.data_deps) if d in present)
    ctrl = tuple(d for d in dict.fromkeys(node.ctrl_deps) if d not in data and d in present)
    node = replace(node, data_deps=data, ctrl_deps=ctrl)
    if node.id in work.inside:
        node = replace(node, runtime=0)  # linked time already counted by its operator
    elif node.id in work.inclusive_us:
        node = replace(node, runtime=round(work.inclusive_us[node.id]))
    coll = work.collectives.get(node.id)
    if coll is not None:
        if coll.group is None:
            raise UserError(
                f"node {node.id} is a collective, but the trace records "
                + ("no process group" if not work.groups else f"{len(work.groups)} process groups")
                + " (## process_group:init ##); stg tells a collective's group only where the "
                "job has exactly one"
            )
        return replace(
            node,
            type=NodeType.COMM_COLL,
            comm_type=coll.kind,
            comm_size=coll.size,
            comm_group=group_ids[coll.group],
            num_ops=0,
            tensor_size=0,
            is_cpu_op=False,
        )
    op = work.ops.get(node.id)
    if op is None or op.kind == "view" or node.type is not NodeType.COMP:
        return node
    attrs = dict(node.attrs)
    attrs[OP_ATTR] = schema_name(work.schemas[node.id])
    if op.gemm is not None:
        attrs["gemm"] = list(op.gemm)
    return replace(
        node,
        # a memory-bound kernel counts one op per element it writes (TRACES.md's ASTRA-sim
        # rule: a COMP node that moves bytes needs num_ops > 0)
        num_ops=op.flops if op.kind == "gemm" else max(op.elements, 1),
        tensor_size=op.nbytes,
        dtype=stg_dtype(op.dtype) or node.dtype,
        attrs=attrs,
    )


@dataclass(frozen=True)
class ImportedRank:
    """One rank's converted nodes and GlobalMetadata attributes."""

    nodes: list[Node]
    attrs: TraceAttrs
    version: str


def import_rank(
    host_path: Path,
    rank: int,
    world: int,
    kineto: Path | None,
    group_ids: dict[str, int],
    groups: dict[int, tuple[int, ...]],
) -> ImportedRank:
    """Link (with a Kineto trace), convert and type one rank's trace."""
    trace = load_host_trace(host_path)
    with tempfile.TemporaryDirectory(prefix="stg-pytorch-et-") as scratch:
        source = host_path
        if kineto is not None:  # the linker renumbers the nodes: type the linked trace
            source = Path(scratch) / "linked.json"
            link_kineto(rank, host_path, kineto, source)
            trace = load_host_trace(source)
        work = host_trace_work(trace, world)
        for name, members in sorted(work.groups.items()):
            if len(members) > 1 and name not in group_ids:
                group_ids[name] = len(group_ids) + 1
                groups[group_ids[name]] = members
        converted = Path(scratch) / "rank.et"
        chakra_convert(source, converted)
        try:
            meta = read_metadata(converted)
            present = {n.id for n in iter_nodes(converted)}
            nodes = [typed_node(n, work, group_ids, present) for n in iter_nodes(converted)]
        except TraceError as exc:
            raise UserError(f"the converted trace of {host_path} cannot be read: {exc}") from None
    attrs = TraceAttrs()
    for name, value in (meta.get("attrs") or {}).items():
        attrs[name] = value
    attrs["rank"] = rank
    attrs["world_size"] = world
    attrs["options"] = json.dumps({"dtype": main_dtype(work), "profile": "eager"}, sort_keys=True)
    return ImportedRank(nodes, attrs, str(meta.get("version") or "0.0.4"))


def import_pytorch_trace(
    hosts: Sequence[Path],
    output_dir: str | Path,
    output_name: str,
    kineto: Sequence[Path] | None = None,
    *,
    force: bool = False,
) -> list[Path]:
    """Convert the host traces of ranks 0..N-1 (with their Kineto traces) into the Chakra
    v0.0.4 rank files ``output_name`` in ``output_dir`` and their comm-group file; without
    ``force`` a file of the same name with other bytes is not replaced (as stg convert)."""
    from stg.trace.chakra_v004 import write_stream

    if kineto is not None and len(kineto) != len(hosts):
        raise UserError(
            f"--kineto: {len(kineto)} Kineto traces for {len(hosts)} host traces; give one per rank"
        )
    for path in [*hosts, *(kineto or [])]:
        if not Path(path).is_file():
            raise UserError(f"{path} does not exist")
    group_ids: dict[str, int] = {}
    groups: dict[int, tuple[int, ...]] = {}
    world = len(hosts)
    ranks = [
        import_rank(
            Path(h), r, world, None if kineto is None else Path(kineto[r]), group_ids, groups
        )
        for r, h in enumerate(hosts)
    ]
    for gid, members in groups.items():
        if max(members) >= world:
            name = next(n for n, i in group_ids.items() if i == gid)
            raise UserError(
                f"process group {name!r} of the trace spans ranks {min(members)}-{max(members)}, "
                f"but {world} host trace{' was' if world == 1 else 's were'} given; give one per "
                "rank (a pattern with %d)"
            )
    names = output_paths(output_name, world, ".et")
    group_name = comm_group_path(output_name)

    def write(tmp: Path) -> list[Path]:
        written = []
        for rank, name in zip(ranks, names, strict=True):
            attrs = TraceAttrs(rank.attrs)
            attrs.kinds.update(rank.attrs.kinds)
            if groups:
                attrs[COMM_GROUP_ATTR] = group_name
            with open(tmp / name, "wb") as out:
                write_stream(out, rank.nodes, attrs, version=rank.version)
            written.append(tmp / name)
        if groups:
            (tmp / group_name).write_text(format_comm_groups(groups), encoding="utf-8")
            written.append(tmp / group_name)
        if not force:
            refuse_different(Path(output_dir), written)
        return written

    return write_atomically(output_dir, output_name, ".et", write, "pytorch import")


__all__ = [
    "COLLECTIVES",
    "Collective",
    "HostTraceWork",
    "chakra_convert",
    "host_trace_work",
    "import_pytorch_trace",
    "is_host_trace",
    "link_kineto",
    "load_host_trace",
    "main_dtype",
    "sniff_host_trace",
    "typed_node",
]
