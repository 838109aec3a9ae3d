"""Check that a multi-rank trace (on disk or in memory) is one a simulator can run.

Checks, each reported as a :class:`Violation` with a short ``check`` code:

per rank
    ``file`` (unreadable or malformed rank file), ``duplicate-id``, ``dangling-dep`` (a data or
    ctrl dep naming no node of the file), ``repeated-dep`` (a parent listed twice, within or
    across data and ctrl deps), ``cycle`` (iterative Kahn; one cycle is shown),
    ``attr-type`` (a TRACES.md attribute stored under another value kind: Chakra's C++ feeder
    would read 0), ``comm-field`` (a comm node without its type, size, group or peer and tag;
    a tag at or above 500,000,000; a peer out of range; ``is_cpu_op`` true on a comm node; a
    ``pg_name`` that is not a decimal comm-group id), ``roofline`` (a COMP node with
    ``num_ops`` 0 and ``tensor_size`` > 0: ASTRA-sim's roofline times it as 0/0 and the rank
    never finishes), ``negative-size`` (a node with a negative ``num_ops``, ``tensor_size`` or
    ``comm_size``: a count of operations or bytes, which no consumer can take negative; an
    error for every consumer), ``collective-type`` (a collective ASTRA-sim does not simulate),
    ``duration`` (in a trace whose metadata names the ``system`` it was generated for, a COMP
    node that does work without ``duration_micros``: ASTRA-sim would replay it in 1 ns).
across ranks
    ``rank-files`` (an in-memory workload whose ranks are out of order), ``comm-group`` (the
    comm-group file: decimal keys >= 1, sorted in-range members, no one-rank groups, every used
    group present, the user is a member), ``collective-mismatch`` (members of a group issue
    different sequences of (type, size)), ``unmatched-send`` / ``unmatched-recv`` (sends and
    receives matched by (source, destination, tag, size), first in first out), ``deadlock``
    (when all else is valid, the ranks are run together: a receive waits for its matched send,
    a collective completes when all members reached it; nodes that can never run are a
    deadlock).

Warnings (reported, not failures): a comp or comm node without ``is_cpu_op``.

``consumer`` says whose consumption rules apply. ``"astra-sim"`` (the default): the rules of
ASTRA-sim and Chakra's C++ feeder are errors: ``schema`` (not v0.0.1: ASTRA-sim reads the v0.0.4
schema), ``roofline``, ``duration``, ``attr-type``, ``collective-type``,
``is_cpu_op`` false on comm nodes and ``pg_name`` a decimal string. ``"chakra"`` (any reader
of the Chakra schema, e.g. Chakra's Python tools): those become warnings, and a ``pg_name``
stored as an integer names its comm group. Their messages name the rank file, the node and
the rule.

A partial rank set (ranks missing below the highest found, or fewer rank files than the
``world_size`` the trace's metadata declares) is not validated: :func:`check_rank_set` refuses
it, as every reader of a trace does.

Collectives are taken in id order, the order in which ASTRA-sim issues ready nodes. A
collective without ``pg_name`` belongs to the group of all ranks.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stg.core.workload import SYSTEM_METADATA, CollectiveType, Node, NodeType
from stg.errors import TraceError, UserError
from stg.trace.decode import Skeleton
from stg.trace.parallel import file_sizes, map_ranks
from stg.trace.reader import detect_format, iter_nodes, read_metadata
from stg.trace.writer import comm_group_path

if TYPE_CHECKING:
    from stg.core.workload import Workload

MAX_TAG = 500_000_000
SIMULATED = frozenset(
    {CollectiveType.ALL_REDUCE, CollectiveType.ALL_GATHER, CollectiveType.REDUCE_SCATTER,
     CollectiveType.ALL_TO_ALL}
)  # fmt: skip
EXPECTED_KINDS: dict[str, str] = {
    "is_cpu_op": "bool_val",
    "num_ops": "int64_val",
    "tensor_size": "uint64_val",
    "comm_type": "int64_val",
    "comm_size": "int64_val",
    "pg_name": "string_val",
    "comm_src": "int32_val",
    "comm_dst": "int32_val",
    "comm_tag": "int32_val",
    "comm_priority": "int32_val",
    "involved_dim": "bool_list",
}
SIZE_FIELDS = {
    "num_ops": "the operations the node does",
    "tensor_size": "the bytes it moves",
    "comm_size": "the bytes it communicates",
}  # a node's counts: never negative (the negative-size check)
WORLD = 0  # group key of collectives without pg_name
CONSUMERS = ("astra-sim", "chakra")  # whose consumption rules validate enforces (see above)


@dataclass(frozen=True)
class Violation:
    """One problem found. ``rank`` and ``node`` locate it when they apply."""

    check: str
    message: str
    rank: int | None = None
    node: int | None = None
    severity: str = "error"


@dataclass
class ValidationReport:
    """What :func:`validate_trace` or :func:`validate_workload` found."""

    ranks: int = 0
    nodes: int = 0
    files: list[str] = field(default_factory=list)
    comm_group_file: str | None = None
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the reader chose on its own (e.g. which comm-group file it found)."""

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if v.severity == "error"]

    @property
    def warnings(self) -> list[Violation]:
        return [v for v in self.violations if v.severity != "error"]

    @property
    def ok(self) -> bool:
        """True when no error (warnings allowed) was found."""
        return not self.errors

    def counts(self) -> dict[str, int]:
        """Number of errors per check code."""
        out: dict[str, int] = defaultdict(int)
        for v in self.errors:
            out[v.check] += 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return {
            "ok": self.ok,
            "ranks": self.ranks,
            "nodes": self.nodes,
            "files": self.files,
            "comm_group_file": self.comm_group_file,
            "errors": self.counts(),
            "violations": [asdict(v) for v in self.violations],
        } | ({"notes": list(self.notes)} if self.notes else {})


@dataclass
class _RankComm:
    """The communication of one rank, for the cross-rank checks."""

    colls: dict[int, list[tuple[int, int, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )  # group -> [(node id, type, size)]
    sends: list[tuple[int, int, int, int]] = field(default_factory=list)  # (id, dst, tag, size)
    recvs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (id, src, tag, size)


class _Checker:
    def __init__(
        self, report: ValidationReport, world_size: int | None, consumer: str = "astra-sim"
    ) -> None:
        if consumer not in CONSUMERS:
            raise UserError(f"--consumer={consumer}: must be one of {', '.join(CONSUMERS)}")
        self.report = report
        self.world = world_size
        self.astra = consumer == "astra-sim"

    def consumer_rule(
        self, check: str, where: str, node: int, message: str, rule: str, rank: int | None
    ) -> None:
        """A violation of a consumption rule of ASTRA-sim (see module doc): an error for
        ``consumer="astra-sim"``, a warning otherwise. ``where`` names the rank file."""
        self.add(
            check,
            f"{where}: node {node}: {message} (ASTRA-sim rule: {rule})",
            rank,
            node,
            "error" if self.astra else "warning",
        )

    def roofline(self, where: str, rank: int | None, nid: int, num_ops: int, size: int) -> None:
        """ASTRA-sim's roofline: a COMP node with bytes to move needs ops to do."""
        if num_ops <= 0 < size:
            self.consumer_rule(
                "roofline",
                where,
                nid,
                f"COMP node has num_ops {num_ops} and tensor_size {size}",
                "a COMP node with tensor_size > 0 needs num_ops > 0, or its roofline time is "
                "0/0 and the rank never finishes; count one op per element moved, or set "
                "tensor_size 0 for a free node",
                rank,
            )

    def sizes(self, where: str, rank: int | None, node: Any) -> None:
        """A node's ``num_ops``, ``tensor_size`` and ``comm_size`` count operations and bytes:
        none is negative (``where`` names the rank file)."""
        for name in SIZE_FIELDS:
            value = getattr(node, name)
            if value < 0:
                self.add(
                    "negative-size",
                    f"{where}: node {node.id} ({node.name}): {name} is {value}; it counts "
                    f"{SIZE_FIELDS[name]}, which no consumer can take negative",
                    rank,
                    node.id,
                )

    def duration(self, where: str, rank: int | None, node: Any, system: str) -> None:
        """A trace generated for ``system`` carries every COMP node's kernel time."""
        if node.runtime <= 0 and (node.num_ops > 0 or node.tensor_size > 0):
            self.consumer_rule(
                "duration",
                where,
                node.id,
                f"COMP node has no duration_micros, but the trace was generated for system "
                f"{system} (its metadata's system)",
                "ASTRA-sim replays a COMP node for duration_micros (with roofline-enabled 0, "
                "as stg's system configuration sets it), 1 ns where it is 0; regenerate the "
                "trace with stg generate --system",
                rank,
            )

    def add(
        self,
        check: str,
        message: str,
        rank: int | None = None,
        node: int | None = None,
        severity: str = "error",
    ) -> None:
        self.report.violations.append(Violation(check, message, rank, node, severity))

    # -- one rank --------------------------------------------------------------------------

    def structure(
        self,
        rank: int | None,
        nodes: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]],
        where: str = "",
    ) -> dict[int, list[int]]:
        """Ids, deps and acyclicity of one rank's graph, given ``(id, data_deps, ctrl_deps)``
        per node. Returns each node's existing parents (each once)."""
        ids: set[int] = set()
        for nid, _, _ in nodes:
            if nid in ids:
                self.add("duplicate-id", f"node id {nid} appears more than once{where}", rank, nid)
            ids.add(nid)
        parents: dict[int, list[int]] = {}
        for nid, data_deps, ctrl_deps in nodes:
            plist = parents.setdefault(nid, [])
            if (
                not ctrl_deps
                and len(set(data_deps)) == len(data_deps)
                and ids.issuperset(data_deps)
            ):
                plist.extend(data_deps)  # the common case, checked in bulk
                continue
            seen: set[int] = set()
            for kind, deps in (("data", data_deps), ("ctrl", ctrl_deps)):
                for dep in deps:
                    if dep in seen:
                        self.add(
                            "repeated-dep",
                            f"node {nid} lists parent {dep} twice ({kind} deps){where}",
                            rank,
                            nid,
                        )
                        continue
                    seen.add(dep)
                    if dep in ids:
                        plist.append(dep)
                    else:
                        self.add(
                            "dangling-dep",
                            f"node {nid} has {kind} dep {dep}, which is "
                            f"not a node of this rank{where}",
                            rank,
                            nid,
                        )
        self._acyclic(rank, parents, where)
        return parents

    def _acyclic(self, rank: int | None, parents: Mapping[int, list[int]], where: str) -> None:
        indegree = {nid: len(ps) for nid, ps in parents.items()}
        children: dict[int, list[int]] = defaultdict(list)
        for nid, ps in parents.items():
            for p in ps:
                children[p].append(nid)
        ready = deque(nid for nid, d in indegree.items() if d == 0)
        done = 0
        while ready:
            nid = ready.popleft()
            done += 1
            for child in children.get(nid, ()):
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        if done == len(indegree):
            return
        left = {nid for nid, d in indegree.items() if d > 0}
        start = min(left)
        path = [start]
        index = {start: 0}
        node = start
        while True:
            node = min(p for p in parents[node] if p in left)
            if node in index:
                cycle = [*path[index[node] :], node]
                break
            index[node] = len(path)
            path.append(node)
        shown = " -> ".join(str(c) for c in reversed(cycle))
        self.add(
            "cycle",
            f"{len(left)} nodes cannot run because of a dependency cycle, e.g. {shown}{where}",
            rank,
            cycle[0],
        )

    def comm_node(
        self,
        rank: int | None,
        n: Node,
        comm: _RankComm,
        kinds: Mapping[str, str] | None,
        where: str | None = None,
    ) -> None:
        """Field and value-kind checks of one node; collect its communication.

        ``kinds`` are the value kinds a v0.0.4 file used (None when there is no such file);
        ``where`` names the rank file in messages.
        """
        where = where or f"rank {rank}"
        typed = "the value kind TRACES.md gives; Chakra's C++ feeder reads another kind as 0"
        for name, kind in (kinds or {}).items():
            expected = EXPECTED_KINDS.get(name)
            if expected and kind != expected:
                self.consumer_rule(
                    "attr-type",
                    where,
                    n.id,
                    f"attribute {name} is {kind}, must be {expected}",
                    typed,
                    rank,
                )
        attrs = n.attrs
        for name in ("comm_priority", "involved_dim", "pg_name"):
            if name in attrs:
                kind = getattr(attrs, "kinds", {}).get(name)
                if kind and kind != EXPECTED_KINDS[name]:
                    self.consumer_rule(
                        "attr-type",
                        where,
                        n.id,
                        f"attribute {name} is {kind}, must be {EXPECTED_KINDS[name]}",
                        typed,
                        rank,
                    )
        t = n.type
        if t is NodeType.COMP:
            self.roofline(where, rank, n.id, n.num_ops, n.tensor_size)
        if (
            kinds is not None
            and "is_cpu_op" not in kinds
            and t in (NodeType.COMP, NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV)
        ):
            self.add("comm-field", f"node {n.id} has no is_cpu_op attribute", rank, n.id, "warning")
        if t is NodeType.COMM_COLL:
            if n.is_cpu_op:
                self.consumer_rule(
                    "comm-field",
                    where,
                    n.id,
                    "collective has is_cpu_op true",
                    "is_cpu_op must be false on comm nodes",
                    rank,
                )
            if n.comm_type is None:
                self.add("comm-field", f"collective {n.id} has no comm_type", rank, n.id)
                return
            if n.comm_type not in SIMULATED:
                self.consumer_rule(
                    "collective-type",
                    where,
                    n.id,
                    f"collective is {n.comm_type.name}",
                    "only ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER and ALL_TO_ALL are simulated",
                    rank,
                )
            group = n.comm_group
            if "pg_name" in attrs:
                value = attrs["pg_name"]
                as_int = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                self.consumer_rule(
                    "comm-field",
                    where,
                    n.id,
                    f"collective has pg_name {value!r}, not a decimal comm-group id",
                    "pg_name is the comm-group id as a decimal string; an integer crashes "
                    "ASTRA-sim",
                    rank,
                )
                if self.astra or not as_int:
                    return  # no comm group to match it in
                group = int(value)
            group = WORLD if group is None else group
            comm.colls[group].append((n.id, int(n.comm_type), n.comm_size))
        elif t in (NodeType.COMM_SEND, NodeType.COMM_RECV):
            verb, peer_name = (
                ("send", "comm_dst") if t is NodeType.COMM_SEND else ("recv", "comm_src")
            )
            peer = getattr(n, peer_name)
            if n.is_cpu_op:
                self.consumer_rule(
                    "comm-field",
                    where,
                    n.id,
                    f"{verb} has is_cpu_op true",
                    "is_cpu_op must be false on comm nodes",
                    rank,
                )
            missing = [name for name in (peer_name, "comm_tag") if getattr(n, name) is None]
            if missing:
                self.add("comm-field", f"{verb} {n.id} has no {' or '.join(missing)}", rank, n.id)
                return
            assert peer is not None and n.comm_tag is not None
            if peer == rank or peer < 0 or (self.world is not None and peer >= self.world):
                upto = "" if self.world is None else f" in 0..{self.world - 1}"
                self.add(
                    "comm-field",
                    f"{verb} {n.id} has {peer_name}={peer}; must be another rank{upto}",
                    rank,
                    n.id,
                )
                return
            if not 0 <= n.comm_tag < MAX_TAG:
                self.add(
                    "comm-field",
                    f"{verb} {n.id} has comm_tag={n.comm_tag}; must be in 0..{MAX_TAG - 1}",
                    rank,
                    n.id,
                )
            own = n.comm_src if t is NodeType.COMM_SEND else n.comm_dst
            if own is not None and rank is not None and own != rank:
                other = "comm_src" if t is NodeType.COMM_SEND else "comm_dst"
                self.add(
                    "comm-field", f"{verb} {n.id} on rank {rank} has {other}={own}", rank, n.id
                )
            entry = (n.id, peer, n.comm_tag, n.comm_size)
            (comm.sends if t is NodeType.COMM_SEND else comm.recvs).append(entry)

    # -- across ranks ----------------------------------------------------------------------

    def groups(self, groups: Mapping[int, Sequence[int]], used: Mapping[int, set[int]]) -> None:
        """The comm-group table against the groups the ranks use."""
        for gid, members in groups.items():
            if gid < 1:
                self.add("comm-group", f"group id {gid} must be >= 1 (0 means all ranks)")
            if len(members) < 2:
                self.add(
                    "comm-group",
                    f"group {gid} has {len(members)} member(s); a collective "
                    "on a one-rank group never completes",
                )
            if list(members) != sorted(set(members)):
                self.add(
                    "comm-group", f"group {gid} members {list(members)} must be sorted and unique"
                )
            world = self.world or 0
            bad = [m for m in members if not 0 <= m < world]
            if bad:
                self.add("comm-group", f"group {gid} has ranks {bad} outside 0..{world - 1}")
        for gid in sorted(used):
            if gid == WORLD:
                continue
            if gid not in groups:
                rank = min(used[gid])
                self.add(
                    "comm-group",
                    f"group {gid} is used by rank {rank} but not defined in the comm-group file",
                    rank,
                )
                continue
            outsiders = sorted(used[gid] - set(groups[gid]))
            if outsiders:
                self.add(
                    "comm-group",
                    f"ranks {outsiders} use group {gid} but are not among "
                    f"its members {list(groups[gid])}",
                    outsiders[0],
                )

    def collectives(
        self,
        groups: Mapping[int, Sequence[int]],
        comms: Mapping[int, _RankComm],
        ranks: Iterable[int],
    ) -> list[list[tuple[int, int]]]:
        """Every member of a group issues the same (type, size) sequence on it. Returns the
        collective instances: for each, the ``(rank, node id)`` of every member."""
        instances: list[list[tuple[int, int]]] = []
        used = sorted({g for c in comms.values() for g in c.colls})
        for gid in used:
            members = list(ranks) if gid == WORLD else list(groups.get(gid, ()))
            members = [m for m in members if m in comms]
            if not members:
                continue
            ref = members[0]
            ref_seq = sorted(comms[ref].colls.get(gid, []))
            seqs = {m: sorted(comms[m].colls.get(gid, [])) for m in members}
            if all(len(seq) == len(ref_seq) for seq in seqs.values()):
                for k in range(len(ref_seq)):
                    instances.append([(m, seqs[m][k][0]) for m in members])
            for m in members[1:]:
                seq = sorted(comms[m].colls.get(gid, []))
                if [s[1:] for s in seq] == [s[1:] for s in ref_seq]:
                    continue
                k = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(seq, ref_seq, strict=False))
                        if a[1:] != b[1:]
                    ),
                    min(len(seq), len(ref_seq)),
                )
                name = "all ranks" if gid == WORLD else f"group {gid}"
                self.add(
                    "collective-mismatch",
                    f"{name}: rank {m}'s collective #{k + 1} is "
                    f"{_describe(seq, k)} but rank {ref}'s is {_describe(ref_seq, k)}",
                    m,
                    seq[k][0] if k < len(seq) else None,
                )
        return instances

    def point_to_point(
        self, comms: Mapping[int, _RankComm]
    ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Sends and receives pair up by (src, dst, tag, size), first in first out. Returns
        the pairs as ``((src rank, send id), (dst rank, recv id))``."""
        pairs: list[tuple[tuple[int, int], tuple[int, int]]] = []
        sends: dict[tuple[int, int, int, int], deque[int]] = defaultdict(deque)
        for rank in sorted(comms):
            for nid, dst, tag, size in sorted(comms[rank].sends):
                sends[(rank, dst, tag, size)].append(nid)
        for rank in sorted(comms):
            for nid, src, tag, size in sorted(comms[rank].recvs):
                queue = sends.get((src, rank, tag, size))
                if queue:
                    pairs.append(((src, queue.popleft()), (rank, nid)))
                    continue
                self.add(
                    "unmatched-recv",
                    f"recv {nid} waits for rank {src} (tag {tag}, "
                    f"{size} bytes) but no such send exists: the rank would deadlock",
                    rank,
                    nid,
                )
        for (src, dst, tag, size), queue in sorted(sends.items()):
            for nid in queue:
                self.add(
                    "unmatched-send",
                    f"send {nid} to rank {dst} (tag {tag}, {size} bytes) has no matching recv",
                    src,
                    nid,
                )
        return pairs

    def deadlock(
        self,
        graphs: Mapping[int, Mapping[int, list[int]]],
        pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]],
        instances: Sequence[Sequence[tuple[int, int]]],
    ) -> None:
        """Run all ranks together (Kahn over the multi-rank graph): a receive waits for its
        send, a collective completes when every member reached it. Nodes that never run mean
        the ranks deadlock."""
        children: dict[int, dict[int, list[int]]] = {}
        indegree: dict[int, dict[int, int]] = {}
        shared: dict[int, dict[int, list[int]]] = {}
        for rank, parents in graphs.items():
            key = id(parents)
            if key not in shared:
                kids: dict[int, list[int]] = defaultdict(list)
                for nid, ps in parents.items():
                    for p in ps:
                        kids[p].append(nid)
                shared[key] = kids
            children[rank] = shared[key]
            indegree[rank] = {nid: len(ps) for nid, ps in parents.items()}
        waiting_send: dict[tuple[int, int], tuple[int, int]] = {}
        recv_of: dict[tuple[int, int], tuple[int, int]] = {}
        for send_key, recv_key in pairs:
            recv_of[send_key] = recv_key
            waiting_send[recv_key] = send_key
            indegree[recv_key[0]][recv_key[1]] += 1
        instance_of: dict[tuple[int, int], int] = {}
        for index, members in enumerate(instances):
            for member in members:
                instance_of[member] = index
        arrived = [0] * len(instances)
        ready = deque((r, n) for r, degs in indegree.items() for n, d in degs.items() if d == 0)
        released = 0
        total = sum(len(d) for d in indegree.values())

        def release(rank: int, nid: int) -> None:
            nonlocal released
            released += 1
            degs = indegree[rank]
            for child in children[rank].get(nid, ()):
                degs[child] -= 1
                if degs[child] == 0:
                    ready.append((rank, child))
            target = recv_of.get((rank, nid))
            if target is not None:
                indegree[target[0]][target[1]] -= 1
                if indegree[target[0]][target[1]] == 0:
                    ready.append(target)

        while ready:
            node = ready.popleft()
            index = instance_of.get(node)
            if index is None:
                release(*node)
                continue
            arrived[index] += 1
            if arrived[index] == len(instances[index]):
                for member in instances[index]:
                    release(*member)
        if released == total:
            return
        stuck = 0
        for rank in sorted(indegree):
            degs = indegree[rank]
            blocked = sorted(n for n, d in degs.items() if d > 0)
            if not blocked:
                continue
            stuck += 1
            if stuck > 16:
                continue
            waiting = self._waiting_point(rank, degs, waiting_send, instance_of, arrived, instances)
            self.add("deadlock", f"rank {rank}: {len(blocked)} nodes never run; {waiting}", rank)
        if stuck > 16:
            self.add("deadlock", f"... and {stuck - 16} more ranks are stuck")

    @staticmethod
    def _waiting_point(
        rank: int,
        degs: Mapping[int, int],
        waiting_send: Mapping[tuple[int, int], tuple[int, int]],
        instance_of: Mapping[tuple[int, int], int],
        arrived: Sequence[int],
        instances: Sequence[Sequence[tuple[int, int]]],
    ) -> str:
        for nid in sorted(degs):
            if degs[nid] == 1 and (rank, nid) in waiting_send:
                src, send = waiting_send[(rank, nid)]
                return f"recv {nid} waits for send {send} of rank {src}, which cannot run"
        for nid in sorted(degs):
            index = instance_of.get((rank, nid))
            if degs[nid] == 0 and index is not None and arrived[index] < len(instances[index]):
                ranks = [r for r, _ in instances[index]]
                return f"collective {nid} waits for the other members of ranks {ranks}"
        return "they wait on nodes above"


def _describe(seq: Sequence[tuple[int, int, int]], k: int) -> str:
    if k >= len(seq):
        return "missing"
    nid, ctype, size = seq[k]
    return f"{CollectiveType(ctype).name} of {size} bytes (node {nid})"


# ---------------------------------------------------------------------------------------------
# Files


def find_rank_files(path_or_prefix: str | Path) -> tuple[list[Path | None], Path | None]:
    """The rank files (index = rank; ``None`` for a missing rank) and the comm-group file of a
    trace given as a directory, a prefix (``out/workload``), a pattern
    (``out/workload.%d.et``) or one rank file. Raises :class:`UserError` when nothing is
    found."""
    text = str(path_or_prefix)
    path = Path(text)
    if "%d" in path.name:
        parent, pattern = path.parent, path.name
        found = _match_pattern(parent, pattern)
        if not found:
            raise UserError(f"no rank files match {text}")
        return _by_rank(found), _group_file(parent, pattern)
    if path.is_dir():
        sets = _rank_file_sets(path)
        if not sets:
            raise UserError(f"no rank files (<name>.<rank>.et or .json) in directory {text}")
        if len(sets) > 1:
            names = ", ".join(sorted(p.replace("%d", "N") for p in sets))
            raise UserError(f"directory {text} holds several traces ({names}); pass a prefix")
        ((pattern, found),) = sets.items()
        return _by_rank(found), _group_file(path, pattern)
    if path.is_file():
        return [path], None
    parent = path.parent
    if parent.is_dir():
        sets = {
            p: f for p, f in _rank_file_sets(parent).items() if p.startswith(path.name + ".%d.")
        }
        if len(sets) == 1:
            ((pattern, found),) = sets.items()
            return _by_rank(found), _group_file(parent, pattern)
        if len(sets) > 1:
            raise UserError(f"prefix {text} matches several traces: {', '.join(sorted(sets))}")
    raise UserError(
        f"{text} does not exist (expected a directory, a rank file or a prefix "
        "such as out/workload)"
    )


def _match_pattern(parent: Path, pattern: str) -> dict[int, Path]:
    head, _, tail = pattern.partition("%d")
    regex = re.compile(re.escape(head) + r"(0|[1-9][0-9]*)" + re.escape(tail) + r"\Z")
    found: dict[int, Path] = {}
    if parent.is_dir():
        for entry in parent.iterdir():
            m = regex.match(entry.name)
            if m and entry.is_file():
                found[int(m.group(1))] = entry
    return found


def _rank_file_sets(directory: Path) -> dict[str, dict[int, Path]]:
    """``{pattern: {rank: path}}`` of the rank files in ``directory``. The comm-group file of
    one trace is never taken for a rank file of another (``llama3.1.json`` beside
    ``llama3.1.0.et`` is not rank 1 of ``llama3``)."""
    sets: dict[str, dict[int, Path]] = defaultdict(dict)
    for entry in directory.iterdir():
        m = re.match(r"^(.+)\.(0|[1-9][0-9]*)\.(et|json|et\.gz|json\.gz)$", entry.name)
        if m and entry.is_file():
            sets[f"{m.group(1)}.%d.{m.group(3)}"][int(m.group(2))] = entry
    group_files = {pattern.rpartition(".%d.")[0] + ".json" for pattern in sets}
    pruned = {
        pattern: {r: f for r, f in found.items() if f.name not in group_files}
        for pattern, found in sets.items()
    }
    return {pattern: found for pattern, found in pruned.items() if found}


def _by_rank(found: Mapping[int, Path]) -> list[Path | None]:
    return [found.get(r) for r in range(max(found) + 1)]


def _group_file(parent: Path, pattern: str) -> Path:
    return parent / comm_group_path(pattern.removesuffix(".gz"))


def read_comm_groups(path: Path) -> dict[int, tuple[int, ...]]:
    """Parse a comm-group file strictly; raise :class:`TraceError` naming the problem."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not a readable JSON comm-group file: {exc}") from None
    if not isinstance(data, dict):
        raise TraceError(f'{path}: must be a JSON object {{"1": [0, 1], ...}}')
    groups: dict[int, tuple[int, ...]] = {}
    for key, members in data.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise TraceError(f"{path}: key {key!r} must be a decimal group id")
        if not isinstance(members, list) or any(
            isinstance(m, bool) or not isinstance(m, int) for m in members
        ):
            raise TraceError(f"{path}: group {key} must be a list of ranks")
        groups[int(key)] = tuple(members)
    return groups


def declared_world_size(files: Sequence[Path | None]) -> int | None:
    """The ``world_size`` that the metadata of the first readable rank file declares (stg
    writes it into every v0.0.4 and JSON rank file), or None where none is declared."""
    value = _trace_attrs(files).get("world_size")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _trace_attrs(files: Sequence[Path | None]) -> Mapping[str, Any]:
    """The metadata attributes of the first rank file that has readable metadata."""
    for path in files:
        if path is None:
            continue
        try:
            attrs = read_metadata(path).get("attrs") or {}
        except (TraceError, OSError):
            continue
        return attrs
    return {}


def check_rank_set(files: Sequence[Path | None]) -> None:
    """Refuse a partial rank set, as :func:`find_rank_files` finds it for a directory, prefix
    or pattern (one rank file named alone is no set): a rank missing below the highest one
    found, or fewer rank files than the world size the trace's metadata declares (what a run
    killed while moving its files into place leaves). Raises :class:`UserError` with one line
    naming the missing ranks."""
    present = [f for f in files if f is not None]
    if not present:
        return
    world = max(len(files), declared_world_size(files) or 0)
    missing = [r for r in range(world) if r >= len(files) or files[r] is None]
    if not missing:
        return
    trace = _RANK_SUFFIX.sub("", str(present[0]))
    raise UserError(
        f"trace {trace}: {len(present)} of {world} rank files present; missing "
        f"{'rank' if len(missing) == 1 else 'ranks'} {_rank_ranges(missing)}"
    )


_RANK_SUFFIX = re.compile(r"\.(0|[1-9][0-9]*)\.(et|json)(\.gz)?\Z", re.IGNORECASE)


def _rank_ranges(ranks: Sequence[int], shown: int = 8) -> str:
    """``[3, 8, 9, 10]`` -> ``3, 8..10`` (the first ``shown`` runs, then ``...``)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:shown]]
    return ", ".join(text) + (", ..." if len(runs) > shown else "")


COMM_GROUP_SCAN_LIMIT = 64 << 20
"""JSON files larger than this are not read when looking for a comm-group file."""


def locate_comm_groups(
    files: Sequence[Path | None], default: Path | None, explicit: str | Path | None = None
) -> tuple[Path | None, str | None]:
    """The comm-group file of a trace (``default`` from :func:`find_rank_files`) and a note
    for the user when the reader chose it on its own.

    ``explicit`` (``--comm_group_file``) wins and must be a file. Otherwise the file that the
    trace's metadata names (attribute ``comm_group_file``, a file name beside the rank files,
    which ``stg generate`` records), which must exist. Otherwise ``default``
    (``<name>.json`` beside the rank files) when it exists. When it does not, and the trace's
    directory holds exactly one other JSON file that parses as a comm-group map and is not a
    rank file (``stg generate --comm_group_file comm_group.json`` writes such a trace), that
    file is used and the note names it; with several such files the default is kept (and
    reported missing where groups are used) and the note lists them."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise UserError(f"--comm_group_file {explicit}: no such file")
        return path, None
    if default is None:
        return default, None
    named = recorded_comm_group_file(files, default.parent)
    if named is not None:
        if not named.is_file():
            raise _missing_named(named)
        return named, None
    if default.exists():
        return default, None
    candidates = find_comm_group_files(default.parent, files)
    if len(candidates) == 1:
        (found,) = candidates
        return found, (
            f"comm groups: {default.name} is absent; using {found.name}, the only comm-group "
            f"file in {default.parent} (--comm_group_file chooses another)"
        )
    if candidates:
        names = ", ".join(c.name for c in candidates)
        return default, (
            f"comm groups: {default.name} is absent and several files could be the comm-group "
            f"file ({names}); choose one with --comm_group_file"
        )
    return default, None


def _missing_named(named: Path) -> UserError:
    return UserError(
        f"comm-group file {named} is missing (the trace's metadata names it); "
        "restore it or choose one with --comm_group_file"
    )


def check_recorded_comm_groups(files: Sequence[Path | None], directory: Path) -> Path | None:
    """The comm-group file that the trace's metadata names (see :func:`locate_comm_groups`),
    refused with one :class:`UserError` line when it is missing or does not parse as one;
    None where the metadata names none. For readers that do not use the groups
    (``stg feed``, ``stg inspect trace``)."""
    named = recorded_comm_group_file(files, directory)
    if named is None:
        return None
    if not named.is_file():
        raise _missing_named(named)
    try:
        read_comm_groups(named)
    except TraceError as exc:
        raise UserError(f"comm-group file {exc}") from None
    return named


COMM_GROUP_ATTR = "comm_group_file"
"""The GlobalMetadata attribute that names a trace's comm-group file (see
:func:`locate_comm_groups`)."""


def recorded_comm_group_file(files: Sequence[Path | None], directory: Path) -> Path | None:
    """The comm-group file that the trace's metadata names, in ``directory``; None where the
    metadata names none (or names something other than a plain file name)."""
    name = _trace_attrs(files).get(COMM_GROUP_ATTR)
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return None
    return directory / name


def find_comm_group_files(directory: Path, rank_files: Sequence[Path | None] = ()) -> list[Path]:
    """The JSON files in ``directory`` that parse as a comm-group map (``{"1": [0, 1], ...}``)
    and are not rank files, by name."""
    own = {p.name for p in rank_files if p is not None}
    found = []
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    for entry in entries:
        name = entry.name
        if name in own or not name.lower().endswith(".json") or name.startswith("."):
            continue
        if re.match(r"^(.+)\.(0|[1-9][0-9]*)\.json$", name, re.IGNORECASE):
            continue  # a rank file of a JSON trace
        try:
            if not entry.is_file() or entry.stat().st_size > COMM_GROUP_SCAN_LIMIT:
                continue
            read_comm_groups(entry)
        except (OSError, TraceError):
            continue
        found.append(entry)
    return found


def validate_trace(
    path_or_prefix: str | Path,
    progress: Callable[[str, int, int], None] | None = None,
    *,
    consumer: str = "astra-sim",
    jobs: int | None = None,
    comm_group_file: str | Path | None = None,
) -> ValidationReport:
    """Validate every rank file of a trace on disk (see module doc).

    Raises :class:`UserError` when no rank file is found, the rank set is partial
    (:func:`check_rank_set`) or ``consumer`` is not one of :data:`CONSUMERS`; everything wrong
    inside the files is reported as violations (an unreadable file under check ``file``).
    ``progress(label, done, total)`` is called after each rank file. ``jobs`` worker processes
    check the rank files (None or 0: every core); the report does not depend on it.
    ``comm_group_file`` names the comm-group file (else the trace's default name, or the one
    comm-group file found beside the trace: see :func:`locate_comm_groups`).

    Each rank file is checked on its own and reduced to a summary: its collectives per group,
    its sends and receives, and its communication skeleton (each comm node's nearest comm
    ancestors). The cross-rank checks run on those summaries. A rank file with any violation
    or warning, or one the fast decoder hands back, is checked by the reference code instead
    (same messages); a deadlock found on skeletons is re-checked on the whole graphs.
    """
    files, default_group = find_rank_files(path_or_prefix)
    if default_group is not None:
        check_rank_set(files)
    group_path, note = locate_comm_groups(files, default_group, comm_group_file)
    report = ValidationReport(ranks=len(files), files=[str(f) for f in files if f])
    if note:
        report.notes.append(note)
    cross_rank = group_path is not None
    world = len(files) if cross_rank else None
    checker = _Checker(report, world, consumer)
    comms: dict[int, _RankComm] = {}
    graphs: dict[int, Mapping[int, list[int]] | Skeleton] = {}
    skeletons: set[int] = set()
    timed_for = _trace_attrs(files).get(SYSTEM_METADATA)
    tasks = [
        _RankTask(
            index,
            path,
            index if cross_rank else _rank_in_name(path.name),
            world,
            consumer,
            timed_for if isinstance(timed_for, str) and timed_for else None,
        )
        for index, path in enumerate(files)
        if path is not None
    ]
    sizes = file_sizes([t.path for t in tasks])
    for task, result in zip(tasks, map_ranks(check_rank, tasks, jobs, sizes=sizes), strict=True):
        report.violations.extend(result.violations)
        if result.nodes is None:
            continue
        report.nodes += result.nodes
        graphs[task.index] = result.graph
        if result.skeleton:
            skeletons.add(task.index)
        comms[task.index] = result.comm
        if progress is not None:
            progress("validating rank files", task.index + 1, len(files))
    _check_schema(checker, tasks, graphs)
    groups: dict[int, tuple[int, ...]] = {}
    used = _used_groups(comms)
    if group_path is not None:
        report.comm_group_file = str(group_path)
        if group_path.exists():
            try:
                groups = read_comm_groups(group_path)
            except TraceError as exc:
                checker.add("comm-group", str(exc))
        elif any(g != WORLD for g in used):
            checker.add(
                "comm-group",
                f"comm-group file {group_path} is missing but collectives "
                "use groups " + ", ".join(str(g) for g in sorted(used) if g != WORLD),
            )
    unreadable = [v.rank for v in report.errors if v.check == "file"]
    if cross_rank and unreadable:
        checker.add(
            "file",
            f"cross-rank checks skipped: rank files {unreadable} are unreadable",
            severity="warning",
        )
    elif cross_rank:
        checker.groups(groups, used)
        instances = checker.collectives(groups, comms, range(len(files)))
        pairs = checker.point_to_point(comms)
        if not report.errors:
            _deadlock(checker, graphs, skeletons, tasks, pairs, instances)
    return report


def _check_schema(checker: _Checker, tasks: Sequence[_RankTask], readable: Mapping) -> None:
    """ASTRA-sim reads the Chakra v0.0.4 schema: its feeder fails on a v0.0.1 trace (``Node 0
    in ctrl_dep graph, but not found in index``). A JSON trace is Chakra's feeder JSON, which
    the node rules check as they check v0.0.4."""
    first = next((t for t in tasks if t.index in readable), None)
    if first is None:
        return
    fmt = detect_format(first.path)
    if fmt == "v0.0.1":
        checker.add(
            "schema",
            f"{first.path.name}: the trace is Chakra {fmt} (ASTRA-sim rule: ASTRA-sim reads "
            "the Chakra v0.0.4 schema only; convert it with `stg convert SOURCE DEST --to "
            "v0.0.4`)",
            first.rank,
            severity="error" if checker.astra else "warning",
        )


def _deadlock(
    checker: _Checker,
    graphs: dict[int, Mapping[int, list[int]] | Skeleton],
    skeletons: set[int],
    tasks: Sequence[_RankTask],
    pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]],
    instances: Sequence[Sequence[tuple[int, int]]],
) -> None:
    """The deadlock check: on the compact skeletons when they show no deadlock (the same
    verdict as on the whole graphs), else on the whole graphs, for the reference's messages."""
    from stg.trace.decode import deadlock_free

    compact = {
        index: g if isinstance(g, Skeleton) else Skeleton.from_parents(dict(g))
        for index, g in graphs.items()
    }
    if deadlock_free(compact, list(pairs), [list(i) for i in instances]):
        return
    whole: dict[int, Mapping[int, list[int]]] = {}
    for task in tasks:
        graph = graphs.get(task.index)
        if graph is None:
            continue
        if task.index in skeletons:
            graph = _reference_rank(task).graph
        whole[task.index] = graph.parents() if isinstance(graph, Skeleton) else graph
    checker.deadlock(whole, pairs, instances)


@dataclass(frozen=True)
class _RankTask:
    index: int
    path: Path
    rank: int | None
    world: int | None
    consumer: str
    timed_for: str | None = None
    """the system the trace's metadata says it was generated for: COMP nodes need durations"""


@dataclass
class _RankResult:
    violations: list[Violation]
    nodes: int | None  # None: the file is unreadable
    comm: _RankComm | None = None
    graph: Mapping[int, list[int]] | Skeleton = field(default_factory=dict)
    skeleton: bool = False  # graph holds only the comm nodes (nearest comm ancestors)


def check_rank(task: _RankTask) -> _RankResult:
    """The per-rank part of :func:`validate_trace` (run in a worker process)."""
    from stg.trace import decode

    if task.timed_for is not None:  # the duration rule: checked node by node
        return _reference_rank(task)
    try:
        fmt = detect_format(task.path)
    except TraceError:
        return _reference_rank(task)
    summary = decode.rank_summary(
        task.path, fmt, task.world, task.rank, task.consumer == "astra-sim"
    )
    if summary is None:
        return _reference_rank(task)
    comm = _RankComm()
    comm.colls.update(summary["colls"])
    comm.sends.extend(summary["sends"])
    comm.recvs.extend(summary["recvs"])
    return _RankResult(
        [], summary["nodes"], comm, summary["skeleton"], skeleton=not summary["whole"]
    )


def _reference_rank(task: _RankTask) -> _RankResult:
    """Check one rank file node by node (the reference: every message, in file order)."""
    report = ValidationReport()
    checker = _Checker(report, task.world, task.consumer)
    rank, path = task.rank, task.path
    comm = _RankComm()
    try:
        fmt = detect_format(path)
        nodes = []
        for n in iter_nodes(path, format=fmt):
            kinds = getattr(n.attrs, "field_kinds", {}) if fmt == "v0.0.4" else None
            checker.sizes(path.name, rank, n)
            checker.comm_node(rank, n, comm, kinds, path.name)
            if task.timed_for is not None and n.type is NodeType.COMP:
                checker.duration(path.name, rank, n, task.timed_for)
            nodes.append((n.id, n.data_deps, n.ctrl_deps))
    except TraceError as exc:
        checker.add("file", str(exc), rank)
        return _RankResult(report.violations, None)
    graph = checker.structure(rank, nodes)
    return _RankResult(report.violations, len(nodes), comm, graph)


def _rank_in_name(name: str) -> int | None:
    m = re.search(r"\.(0|[1-9][0-9]*)\.(et|json)(\.gz)?$", name)
    return int(m.group(1)) if m else None


def _used_groups(comms: Mapping[int, _RankComm]) -> dict[int, set[int]]:
    used: dict[int, set[int]] = defaultdict(set)
    for rank, comm in comms.items():
        for gid in comm.colls:
            used[gid].add(rank)
    return used


def validate_workload(workload: Workload, *, consumer: str = "astra-sim") -> ValidationReport:
    """Validate an in-memory workload: the checks of :func:`validate_trace` without files.

    The graph structure, the node sizes and the roofline rule are checked once per rank
    class (ranks of a class share them); the communication of every rank is resolved and
    matched across ranks.
    """
    report = ValidationReport(ranks=workload.world_size)
    checker = _Checker(report, workload.world_size, consumer)
    timed_for = workload.metadata.get(SYSTEM_METADATA)
    for index, graph in enumerate(workload.ranks):
        if graph.rank != index:
            checker.add("rank-files", f"workload.ranks[{index}] is rank {graph.rank}", index)
    class_graphs: dict[int, dict[int, list[int]]] = {}
    graphs: dict[int, dict[int, list[int]]] = {}
    comms: dict[int, _RankComm] = {}
    for graph in workload.ranks:
        rank_class = graph.rank_class
        report.nodes += len(rank_class.nodes)
        if rank_class.index not in class_graphs:
            class_graphs[rank_class.index] = checker.structure(
                graph.rank,
                [(t.id, t.data_deps, t.ctrl_deps) for t in rank_class.nodes],
                f" (rank class {rank_class.index})",
            )
            where = f"rank {graph.rank} (rank class {rank_class.index})"
            for t in rank_class.nodes:
                if t.num_ops < 0 or t.tensor_size < 0 or t.comm_size < 0:
                    checker.sizes(where, graph.rank, t)
                if t.type is NodeType.COMP:
                    checker.roofline(where, graph.rank, t.id, t.num_ops, t.tensor_size)
                    if isinstance(timed_for, str) and timed_for:
                        checker.duration(where, graph.rank, t, timed_for)
        graphs[graph.rank] = class_graphs[rank_class.index]
        comm = _RankComm()
        for template in rank_class.nodes:
            if template.type in (NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV):
                checker.comm_node(
                    graph.rank, graph.resolve(template), comm, None, f"rank {graph.rank}"
                )
        comms[graph.rank] = comm
    groups = {int(g): tuple(m) for g, m in workload.comm_groups.items()}
    checker.groups(groups, _used_groups(comms))
    instances = checker.collectives(groups, comms, range(workload.world_size))
    pairs = checker.point_to_point(comms)
    if not report.errors:
        checker.deadlock(graphs, pairs, instances)
    return report
