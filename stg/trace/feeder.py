"""A strict Python counterpart of Chakra's C++ ``ETFeeder``: nodes in dependency order.

The protocol is the one ASTRA-sim drives::

    feeder = ETFeeder("workload.0.et")
    while feeder.has_nodes_to_issue():
        node = feeder.get_next_issuable_node()   # smallest ready id first, None if none ready
        ...                                      # simulate it (or push_back_issuable_node(id))
        feeder.free_children_nodes(node.id)      # on completion: children may become ready
        feeder.remove_node(node.id)

Semantics follow Chakra's feeder (ready nodes come out smallest id first; completing a node
frees its children; a node may depend on a parent that appears later in the file), with
these differences, all of which turn a hang or a crash of the C++ feeder into an error:

* Malformed traces raise :class:`FeederError` (a :class:`~stg.errors.TraceError`) naming the
  node: duplicate ids, a node depending on itself, a parent listed twice in one dependency
  list, a parent that never appears (dangling), and cycles (nodes remain but none can ever
  become ready). Truncated or undecodable files raise the reader's ``TraceError``.
* Misuse of the protocol (freeing a node that was not issued, removing a node before freeing
  its children, looking up an unknown id) raises :class:`FeederUsageError`.
* ``deps`` chooses which dependencies order the nodes. The default, ``"data+ctrl"``, is what
  ASTRA-sim honours and what stg's own traces need (pipeline schedules are ctrl deps).
  ``"data"`` reproduces Chakra's C++ feeder, which reads data deps only; use it for traces
  whose ctrl deps are unusable (e.g. converted PyTorch traces).
* Reading is windowed: the feeder keeps at most ``window`` nodes in memory and reads more as
  nodes are removed, except that it reads on while some loaded node waits for a parent not
  read yet (a forward reference). Unlike the C++ feeder it remembers which ids it has seen
  (compactly, as id ranges), so a dependency on an already removed node counts as satisfied
  and a duplicate id is caught even after the first copy was removed.
* ``data_deps`` and ``ctrl_deps`` of an :class:`ETFeederNode` are the node's lists as read;
  they are not consumed as parents complete (the C++ feeder erases freed data deps).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import os
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from stg.core.workload import CollectiveType, Node, NodeType
from stg.errors import TraceError, UserError

DepsMode = Literal["data", "data+ctrl"]
DEPS_MODES: tuple[str, ...] = ("data", "data+ctrl")
DEFAULT_WINDOW = 65536
"""Default bound on the number of nodes held in memory (Chakra's C++ feeder holds 1,048,576)."""

_BLOCKED, _READY, _ISSUED, _FREED = 0, 1, 2, 3
_CTRL_HINT = " (to ignore ctrl deps, feed with deps 'data', --deps data on the command line)"


class FeederError(TraceError):
    """A trace that cannot be fed: duplicate ids, dangling or repeated deps, a cycle."""

    def __init__(self, message: str, node_id: int | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id


class DuplicateNodeError(FeederError):
    """Two nodes of one trace share an id."""


class DependencyError(FeederError):
    """A node depends on itself, lists a parent twice, or names a parent that never appears."""


class CycleError(FeederError):
    """The remaining nodes wait on each other: none of them can ever become ready."""


class FeederUsageError(RuntimeError):
    """The feeder was driven against its protocol (e.g. removing a node before freeing it)."""


class ETFeederNode:
    """One node as the feeder hands it out: the trace's :class:`~stg.core.workload.Node` plus links.

    Accessors mirror Chakra's C++ ``ETFeederNode``. ``children`` are the loaded nodes that
    depend on this one (under the feeder's ``deps`` mode), in file order.
    """

    __slots__ = ("_pending", "_state", "children", "id", "node")

    def __init__(self, node: Node) -> None:
        self.id: int = node.id
        self.node: Node = node
        self.children: list[ETFeederNode] = []
        self._pending = 0
        self._state = _BLOCKED

    def __repr__(self) -> str:
        return f"ETFeederNode(id={self.id}, name={self.node.name!r}, type={self.node.type.name})"

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def type(self) -> NodeType:
        return self.node.type

    @property
    def runtime(self) -> int:
        """Duration in microseconds."""
        return self.node.runtime

    @property
    def is_cpu_op(self) -> bool:
        return self.node.is_cpu_op

    @property
    def num_ops(self) -> int:
        """Floating-point operations."""
        return self.node.num_ops

    @property
    def tensor_size(self) -> int:
        """Bytes moved by a compute or memory node."""
        return self.node.tensor_size

    @property
    def comm_type(self) -> CollectiveType | None:
        return self.node.comm_type

    @property
    def comm_size(self) -> int:
        """Bytes of a communication node."""
        return self.node.comm_size

    @property
    def comm_src(self) -> int | None:
        return self.node.comm_src

    @property
    def comm_dst(self) -> int | None:
        return self.node.comm_dst

    @property
    def comm_tag(self) -> int | None:
        return self.node.comm_tag

    @property
    def pg_name(self) -> str:
        """The process-group name of a collective ("" when it has none)."""
        value = self.node.attrs.get("pg_name")
        if isinstance(value, str):
            return value
        group = self.node.comm_group
        return "" if group is None else str(group)

    @property
    def data_deps(self) -> tuple[int, ...]:
        return self.node.data_deps

    @property
    def ctrl_deps(self) -> tuple[int, ...]:
        return self.node.ctrl_deps

    @property
    def attrs(self) -> Mapping[str, Any]:
        """Further attributes by name (those without a typed accessor)."""
        return self.node.attrs

    def has_other_attr(self, name: str) -> bool:
        return name in self.node.attrs

    def get_other_attr(self, name: str) -> Any:
        """The value of attribute ``name``; raises :class:`KeyError` when the node has none."""
        try:
            return self.node.attrs[name]
        except KeyError:
            raise KeyError(f"node {self.id} has no attribute {name!r}") from None


class _IdRanges:
    """The set of ids seen so far, compact for ids that arrive in increasing order.

    Increasing ids extend or append sorted half-open ranges (one range per gap); an id
    smaller than the largest seen goes into a plain set.
    """

    __slots__ = ("_ends", "_others", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._others: set[int] = set()

    def __contains__(self, value: int) -> bool:
        ends = self._ends
        if not ends or ends[-1] <= value:
            return False
        if value in self._others:
            return True
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and value < ends[i]

    def add(self, value: int) -> None:
        """Add ``value`` (which must not be present yet)."""
        ends = self._ends
        if ends and ends[-1] == value:
            ends[-1] = value + 1
        elif not ends or value > ends[-1]:
            self._starts.append(value)
            ends.append(value + 1)
        else:
            self._others.add(value)


class ETFeeder:
    """Feed the nodes of one rank's trace in dependency order (see the module docstring).

    ``source`` is a trace file (any format :func:`stg.trace.reader.iter_nodes` reads; ``format``
    forces one) or an iterable of :class:`~stg.core.workload.Node` in file order.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Iterable[Node],
        *,
        deps: DepsMode = "data+ctrl",
        window: int = DEFAULT_WINDOW,
        format: str | None = None,
    ) -> None:
        if deps not in DEPS_MODES:
            raise UserError(f"deps={deps!r} is not known; allowed: {', '.join(DEPS_MODES)}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UserError(f"window={window!r} must be a positive integer")
        self.deps: DepsMode = deps
        self.window = window
        # remove_node reads ahead in batches of about window/8 nodes, not node by node
        self._refill_below = window - window // 8
        if isinstance(source, (str, os.PathLike)):
            from stg.trace.reader import iter_nodes

            self.source_name = os.fspath(source)
            try:
                nodes: Iterable[Node] = iter_nodes(source, format=format)
            except (OSError, EOFError, zlib.error) as exc:  # a corrupt gzip, seen while sniffing
                raise TraceError(f"{self.source_name}: cannot read: {exc}") from exc
        else:
            self.source_name = "<nodes>"
            nodes = source
        self._nodes: Iterator[Node] = iter(nodes)
        self._use_ctrl = deps == "data+ctrl"
        self._live: dict[int, ETFeederNode] = {}
        self._ready: list[int] = []
        self._waiting: dict[int, list[ETFeederNode]] = {}
        self._seen = _IdRanges()
        self._eof = False
        self._last_id: int | None = None
        self._blocked = 0
        self._in_flight = 0
        self.nodes_read = 0
        self._fill()

    # -- the C++ feeder's interface --------------------------------------------------------

    def has_nodes_to_issue(self) -> bool:
        """Whether nodes remain (loaded or still in the file). Raises :class:`CycleError`
        when nodes remain but none can ever be issued."""
        if not self._live:
            if self._eof:
                return False
            self._fill()
            if not self._live:
                return False
        if not self._ready:
            self._check_stuck()
        return True

    def get_next_issuable_node(self) -> ETFeederNode | None:
        """The ready node with the smallest id, or None while no node is ready."""
        if not self._ready:
            if not self._eof and len(self._live) < self.window:
                self._fill()
            if not self._ready:
                self._check_stuck()
                return None
        node = self._live[heapq.heappop(self._ready)]
        node._state = _ISSUED
        self._in_flight += 1
        return node

    def push_back_issuable_node(self, node_id: int) -> None:
        """Return an issued node to the ready set (it was not executed after all)."""
        node = self._get(node_id, "push_back_issuable_node")
        if node._state != _ISSUED:
            raise FeederUsageError(
                f"push_back_issuable_node({node_id}): node was not issued or was already freed"
            )
        node._state = _READY
        self._in_flight -= 1
        heapq.heappush(self._ready, node_id)

    def free_children_nodes(self, node_id: int) -> None:
        """Mark an issued node complete: its children that wait for nothing else become ready."""
        try:
            node = self._live[node_id]
        except (KeyError, TypeError):
            node = self._get(node_id, "free_children_nodes")
        if node._state != _ISSUED:
            state = "already freed" if node._state == _FREED else "not issued"
            raise FeederUsageError(f"free_children_nodes({node_id}): node was {state}")
        node._state = _FREED
        self._in_flight -= 1
        ready = self._ready
        for child in node.children:
            child._pending -= 1
            if child._pending == 0:
                child._state = _READY
                self._blocked -= 1
                heapq.heappush(ready, child.id)

    def remove_node(self, node_id: int) -> None:
        """Forget a completed node (after :meth:`free_children_nodes`) and read ahead."""
        live = self._live
        try:
            node = live[node_id]
        except (KeyError, TypeError):
            node = self._get(node_id, "remove_node")
        if node._state != _FREED:
            raise FeederUsageError(
                f"remove_node({node_id}): call free_children_nodes({node_id}) first"
            )
        del live[node_id]
        if len(live) < self._refill_below and not self._eof:
            self._fill()

    def lookup_node(self, node_id: int) -> ETFeederNode:
        """The loaded node with this id; raises :class:`FeederUsageError` if none is loaded."""
        return self._get(node_id, "lookup_node")

    # -- extras ----------------------------------------------------------------------------

    @property
    def loaded(self) -> int:
        """Number of nodes held in memory now."""
        return len(self._live)

    def close(self) -> None:
        """Close the underlying file (when the source was a path)."""
        close = getattr(self._nodes, "close", None)
        if close is not None:
            close()
        self._eof = True

    def __enter__(self) -> ETFeeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _get(self, node_id: int, what: str) -> ETFeederNode:
        try:
            return self._live[node_id]
        except KeyError:
            raise FeederUsageError(f"{what}({node_id}): no such node is loaded") from None
        except TypeError:
            raise FeederUsageError(f"{what}({node_id!r}): node ids are integers") from None

    def _fill(self) -> None:
        """Read nodes until ``window`` are loaded and none waits for an unread parent.

        The cyclic garbage collector is paused while nodes are read: reading creates many
        objects (none in a cycle) next to a window of live ones, and a collection in the middle
        would walk the whole window again and again (half the drain time for a 65,536-node
        window)."""
        enabled = gc.isenabled()
        if enabled:
            gc.disable()
        try:
            self._read_nodes()
        finally:
            if enabled:
                gc.enable()

    def _read_nodes(self) -> None:
        live = self._live
        waiting = self._waiting
        seen = self._seen
        ready = self._ready
        use_ctrl = self._use_ctrl
        window = self.window
        nodes = self._nodes
        read = 0
        try:
            while len(live) < window or waiting:
                try:
                    node = next(nodes)
                except StopIteration:
                    self._eof = True
                    break
                read += 1
                nid = node.id
                if nid in seen:
                    raise DuplicateNodeError(
                        f"{self.source_name}: node id {nid} appears twice", nid
                    )
                seen.add(nid)
                self._last_id = nid
                fnode = ETFeederNode(node)
                deps = node.data_deps
                if len(deps) > 1 and len(set(deps)) != len(deps):
                    self._repeated(nid, deps, "data")
                if use_ctrl and node.ctrl_deps:
                    ctrl = node.ctrl_deps
                    if len(ctrl) > 1 and len(set(ctrl)) != len(ctrl):
                        self._repeated(nid, ctrl, "ctrl")
                    deps = deps + tuple(p for p in ctrl if p not in deps) if deps else ctrl
                pending = 0
                for parent_id in deps:
                    parent = live.get(parent_id)
                    if parent is not None:
                        if parent._state != _FREED:
                            parent.children.append(fnode)
                            pending += 1
                    elif parent_id == nid:
                        kind = "data" if nid in node.data_deps else "ctrl"
                        raise DependencyError(
                            f"{self.source_name}: node {nid} lists itself as a {kind} dep"
                            f"{_CTRL_HINT if kind == 'ctrl' else ''}",
                            nid,
                        )
                    elif parent_id not in seen:
                        pending += 1
                        queue = waiting.get(parent_id)
                        if queue is None:
                            waiting[parent_id] = [fnode]
                        else:
                            queue.append(fnode)
                    # else: the parent was completed and removed already
                live[nid] = fnode
                early = waiting.pop(nid, None)
                if early is not None:
                    fnode.children = early
                if pending:
                    fnode._pending = pending
                    self._blocked += 1
                else:
                    fnode._state = _READY
                    heapq.heappush(ready, nid)
        except TraceError as exc:
            if isinstance(exc, FeederError):
                raise
            raise TraceError(f"{exc}{self._after()}") from exc
        except (OSError, EOFError, zlib.error) as exc:  # e.g. a truncated or corrupt gzip
            raise TraceError(f"{self.source_name}: cannot read: {exc}{self._after()}") from exc
        finally:
            self.nodes_read += read
        if self._eof and waiting:
            parent_id = min(waiting)
            child = waiting[parent_id][0]
            kind = "data" if parent_id in child.node.data_deps else "ctrl"
            hint = _CTRL_HINT if kind == "ctrl" else ""
            raise DependencyError(
                f"{self.source_name}: node {child.id} has {kind} dep {parent_id}, "
                f"which never appears{hint}",
                child.id,
            )

    def _after(self) -> str:
        return "" if self._last_id is None else f" (after node {self._last_id})"

    def _repeated(self, nid: int, deps: tuple[int, ...], kind: str) -> None:
        seen: set[int] = set()
        for parent_id in deps:
            if parent_id in seen:
                raise DependencyError(
                    f"{self.source_name}: node {nid} lists {kind} dep {parent_id} twice", nid
                )
            seen.add(parent_id)

    def _check_stuck(self) -> None:
        """Raise :class:`CycleError` if blocked nodes remain and nothing can unblock them.

        Every parent of a loaded node is loaded (the feeder reads on until it is), so when
        nothing is ready or in flight, the blocked nodes can only be waiting on each other.
        """
        if self._ready or self._in_flight or not self._blocked or self._waiting:
            return
        start = min(n.id for n in self._live.values() if n._state == _BLOCKED)
        path: list[int] = []
        index: dict[int, int] = {}
        current = self._live[start]
        while current.id not in index:
            index[current.id] = len(path)
            path.append(current.id)
            current = self._blocking_parent(current)
        cycle = [*path[index[current.id] :], current.id]
        cycle.reverse()  # print parent -> child
        raise CycleError(
            f"{self.source_name}: dependency cycle {' -> '.join(map(str, cycle))}", cycle[0]
        )

    def _blocking_parent(self, node: ETFeederNode) -> ETFeederNode:
        deps = node.node.data_deps + (node.node.ctrl_deps if self._use_ctrl else ())
        for parent_id in sorted(set(deps)):
            parent = self._live.get(parent_id)
            if parent is not None and parent._state == _BLOCKED:
                return parent
        raise AssertionError(f"node {node.id} is blocked without a blocked parent")


def replay(feeder: ETFeeder) -> Iterator[tuple[str, int]]:
    """Drive ``feeder`` with the FIFO protocol of Chakra's conformance log.

    Yields ``("issue", id)`` for each node taken from the feeder (smallest ready id first)
    and ``("done", id)`` when the head of the FIFO completes (its children are freed, the
    newly ready nodes are issued, then it is removed).
    """
    fifo: deque[ETFeederNode] = deque()
    while feeder.has_nodes_to_issue():
        node = feeder.get_next_issuable_node()
        while node is not None:
            fifo.append(node)
            yield ("issue", node.id)
            node = feeder.get_next_issuable_node()
        if not fifo:
            raise FeederUsageError("replay: nodes remain but none is ready or in flight")
        done = fifo.popleft()
        yield ("done", done.id)
        feeder.free_children_nodes(done.id)
        node = feeder.get_next_issuable_node()
        while node is not None:
            fifo.append(node)
            yield ("issue", node.id)
            node = feeder.get_next_issuable_node()
        feeder.remove_node(done.id)
