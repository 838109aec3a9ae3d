"""The periodic replay: a pipeline schedule's steady state replayed once, not once per period.

After its fill, a pipeline schedule repeats a *period* (1F1B and GPipe: one micro-batch;
interleaved: one group of ``stages`` micro-batches) on every stage with the same dependencies,
until its drain. :func:`replay_periodic` compares two reduced problems (:func:`reduced_problem`:
the first ``k`` and ``k + p`` micro-batches of the workload, its end of iteration kept: the
gradient reductions and the optimizer depend on the last micro-batches' nodes) and *checks*
that the second is the first with one period inserted: every node of micro-batch ``x >= c``
(and every node after the micro-batches) starts, issues its transfer and ends exactly ``T``
later than its partner of micro-batch ``x - p`` in the first, every node before ``c`` at the
same instants (within :data:`TOLERANCE` of the iteration time). Then each further period adds
``T`` and the same sums of compute, communication and waits on every unit, and the iteration
time and the per-unit breakdown (:func:`stg.perf.replay.unit_breakdown`) of the full problem
are extrapolated from the two, and the critical path is the longer replay's with the further
periods walked through, those it crosses alike summarised as one (:func:`_extended_path`).
Where the check fails (a state that never repeats, a reduced problem that is not the
schedule's own), or the workload is too short for a saving, it returns None and the caller
replays the whole problem.

One replay, not two: the engine replays only the longer problem, copying its whole state
(:class:`stg.perf.replay.EngineState`) at the start of two micro-batches one period apart on
the first unit, instants ``a`` and ``b = a + T``, and reads the shorter problem's replay off it
(:func:`_short_from_long`) where it proves that this is what the engine would give:

1. Up to ``a``, the shorter problem replays as the longer one: every node in which they
   differ (the longer one's last period, dropped; a node whose dependencies the reduction
   moved to kept ancestors, in either; a gradient reduction that the shorter one takes from
   its stream's queue where its own schedule issues it, :func:`_placed_ends`) has not become
   ready by ``a``, and the communicators' streams are numbered alike. The engine being
   deterministic, both run the same events in the same order until ``a`` and have the same
   state there (but for the pending counts of the nodes whose dependencies differ, counted
   from the shorter problem's own).
2. That state, with every node reference moved one period later (:class:`_Shift`: a one-to-
   one correspondence of the nodes not finished) and every instant ``T`` later, is the
   longer replay's state at ``b``: the nodes not finished, with the same costs, streams,
   matching keys, progress and dependencies not finished (less those another of them
   reaches back to), none other; the events ahead in the same order and ties; the ready
   queues, occupation and last node of every stream; the sends and receives waiting for
   their partner; each communicator's collectives issued per unit and those half issued; the
   transfers in flight with their step, remaining bytes, rate and ports, each port's users
   and each unit's contending transfers, in order. From equal states the engine does the
   same, so from ``a`` the shorter problem runs as the longer one does from ``b``, ``T``
   earlier: each node not finished at ``a`` as its correspondent at ``b`` (:func:`_read_off`).

The shorter replay so read off then goes through the same check against the longer one as a
replayed one would. Instants are compared within :data:`TOLERANCE`: the argument is exact in
real arithmetic, and the rounding of a later start is what the two-replay check accepts too.
Where the states differ (or a workload replays with ``tp_comm_overlap``, which is not
tried: its userbuffers pricing edits durations and transfer steps, not dependencies, but its
steady states drift from period to period in the plans checked: with the check turned on
for it, 15 of 16 small GPT plans, pp 2-4, 1F1B and interleaved, and Llama 3.1 405B's GB300
plan fell back to the whole replay), the shorter problem is replayed.
``overlap_param_gather`` moves only the parameter gathers (outside the micro-batches, issued
at the start): every forward of a part waits for its gather, which the
state compares as a pending dependency while it runs and which has long ended once the steady
state is reached, so its states are compared as any other's.

The fewest micro-batches (:func:`state_keep`: the fill in whole periods, ``c``, and a period,
the longer problem a period more, ``pp + 2`` for 1F1B against :func:`first_keep`'s ``2 pp +
2``): where the longer problem is the workload itself (one lowered for them, whose drain is
its schedule's), the state check alone proves the period, the states compared at the start
of micro-batches ``c`` and ``c + p``. Call ``P_n`` the schedule with ``n`` periods more than
the shorter one, ``P_1`` the longer replay. Up to ``b`` every ``P_n`` (``n >= 1``) replays as
``P_1`` (the nodes in which they differ are those that differ between ``P_0`` and ``P_1``,
one period later, untouched at ``b`` as these are at ``a``), and its state at ``b`` is
``P_{n-1}``'s at ``a`` one period later; so from ``b`` on ``P_n`` runs as ``P_{n-1}`` does from
``a``, ``T`` later. By induction ``P_n`` is ``P_1`` up to ``b``, then ``n - 1`` copies of what
``P_1`` does between ``a`` and ``b``, then the rest of ``P_1``, each a period later: the
iteration time adds ``T`` per period, every per-unit sum (and union of busy intervals) the
same difference between the two replays, and a node not finished at ``a`` in ``P_1`` stands
for itself and its alikes in the further periods (the critical path's walk,
:func:`_extended_path`). No node-by-node match (:func:`_aligned`), which needs the micro-
batches before the cut to run alike in both replays, so the drain at least ``pp``
micro-batches after the cut. A reduced longer problem does not serve: its drain waits for the
kept ancestors of its dropped nodes, which can be more than the schedule of as many
micro-batches waits for (with context parallelism a backward's gather comes to wait for the
compute before the dropped forward's gather), and two such replays can repeat alike where the
workload does not; there, and where the state differs, the longer :func:`first_keep` is
tried.

Nodes are matched by their typed attributes (:data:`stg.core.workload.NODE_SEMANTICS`): the
micro-batch, and within it the type, op, part, phase and role, counted in id order.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stg.core.workload import (
    LAYER_ATTR,
    MICRO_BATCH_ATTR,
    OP_ATTR,
    PART_ATTR,
    PHASE_ATTR,
    ROLE_ATTR,
    NodeType,
    Phase,
    Role,
    node_op,
    node_part,
    node_phase,
    node_role,
)
from stg.errors import TraceError
from stg.perf import replay as _replay_module
from stg.perf.replay import (
    COLL,
    COMPUTE,
    COPY,
    KIND_NAMES,
    SEND,
    Costs,
    EngineState,
    Problem,
    Replay,
    Unit,
    UnitResult,
    alike_units,
    nonnegative_duration,
    replay,
    unit_breakdown,
)

TOLERANCE = 1e-11
"""How far (relative to the iteration time) a node's instants may differ from its partner's
shifted by one period: the rounding of adding the same durations to a later start, and of
the rates of transfers that share links (recomputed as flows start and end), which on a
256-GPU MoE plan of 48 micro-batches reached 7e-12 (1e-12 refused its read-off shorter
replay; the extrapolation to 512 micro-batches is within 7e-11 of the full replay)."""

NameAt = Callable[[Any, int], str]
"""The name of a node's alike in another micro-batch (``name_at(node, micro_batch)``)."""

Key = tuple[Any, ...]
"""A node's identity within its micro-batch: (type, op, part, phase, role, occurrence)."""


@dataclass
class PeriodicReplay:
    """The full problem's iteration time and per-unit breakdowns, extrapolated from two
    reduced problems' replays that differ by one verified period."""

    iteration_time: float
    breakdowns: list[dict[str, float]]
    """per unit of the problem, as :func:`stg.perf.replay.unit_breakdown`"""
    critical_path: list[dict[str, Any]]
    """as :func:`stg.perf.replay.critical_path`, its repeated periods summarised: where the
    path goes through the same nodes in every further period, one period's runs carry
    ``repeats`` (n) and ``period_s`` (T): they stand for n copies of themselves, the k-th (from
    0) k T later with the nodes k periods later; so the path's length does not grow with the
    micro-batches"""
    period: int
    """micro-batches per period"""
    period_time: float
    replayed_micro_batches: int
    micro_batches: int
    flops: list[tuple[int, int]]
    """per unit of the problem: (hardware, model) FLOPs of one of its ranks over the whole
    iteration (model FLOPs leave out recomputation)"""
    replays: int = 2
    """the engine runs it took: 1 where the shorter replay was read off the longer one's
    states (:func:`_short_from_long`), else 2"""


class _Indexed:
    """One unit's nodes with their micro-batch, the positions of each micro-batch's nodes, and
    (worked out per micro-batch where needed) each node's key. A unit alike another
    (:func:`stg.perf.replay.alike_units`) shares all but its nodes with that one's."""

    def __init__(
        self,
        nodes: Sequence[Any],
        micro_batch: list[int | None] | None = None,
        shared: dict[tuple[Any, ...], tuple[Any, ...]] | None = None,
    ) -> None:
        """``micro_batch``: each node's (:func:`_declared_micro_batches`), where known."""
        self.nodes = nodes
        self.position: Mapping[int, int] | range
        """each node's position, by id (a range where every id is its position)"""
        ids = [n.id for n in nodes]
        if ids == list(range(len(nodes))):
            self.position = range(len(nodes))
        else:
            self.position = {n: i for i, n in enumerate(ids)}
        self.members: dict[int, list[int]] = {}
        self.unbatched: list[int] = []
        """positions of the nodes outside the micro-batches"""
        if micro_batch is None:
            micro_batch = _declared_micro_batches(nodes)
        self.micro_batch = micro_batch
        members: dict[int | None, list[int]] = {mb: [] for mb in dict.fromkeys(micro_batch)}
        for i, mb in enumerate(micro_batch):
            members[mb].append(i)
        self.unbatched = members.pop(None, [])
        self.members = members  # type: ignore[assignment]
        self.keys: dict[int, Key] = {}
        self.by_key: dict[tuple[int, Key], int] = {}
        self.indexed: set[int] = set()
        self.bases: dict[int, tuple[Any, ...]] = {}
        """each node's :func:`_base` (by position), worked out once"""
        self.shared = {} if shared is None else shared
        """:func:`_base` by the raw values of the attributes it reads and their types (a pure
        function of them): alike nodes of every micro-batch (and unit) share one entry"""
        engine = _replay_module.compiled_engine
        if engine is not None:  # every node's base at once, in C (what base works out)
            found = engine.bases(nodes, self.shared, _base, _BASE_ATTRS)
            if found is not NotImplemented:
                self.base = found.__getitem__  # type: ignore[method-assign]

    def base(self, i: int) -> tuple[Any, ...]:
        """:func:`_base` of the node at position ``i``."""
        found = self.bases.get(i)
        if found is None:
            node = self.nodes[i]
            attrs = getattr(node, "attrs", None)
            if not attrs:
                found = self.bases[i] = _base(node)
                return found
            # alike nodes of every micro-batch have the same raw values (and their types: a
            # bool equals an int but is no code), each distinct set worked out once
            layer, part = attrs.get(LAYER_ATTR), attrs.get(PART_ATTR)
            phase, role = attrs.get(PHASE_ATTR), attrs.get(ROLE_ATTR)
            raw = (
                node.type, attrs.get(OP_ATTR), layer, part, phase, role,
                type(layer), type(part), type(phase), type(role),
            )  # fmt: skip
            found = self.shared.get(raw)
            if found is None:
                found = self.shared[raw] = _base(node)
            self.bases[i] = found
        return found

    def _index(self, mb: int) -> None:
        if mb in self.indexed:
            return
        self.indexed.add(mb)
        seen: dict[Key, int] = {}
        for i in self.members.get(mb, ()):
            base = self.base(i)
            occurrence = seen.get(base, 0)
            seen[base] = occurrence + 1
            self.keys[i] = (*base, occurrence)
            self.by_key[(mb, self.keys[i])] = i

    def alikes_in(self, mb: int, other: int) -> list[int | None]:
        """:meth:`same_in` ``other`` of each node of micro-batch ``mb``, in order."""
        here, there = self.members.get(mb, []), self.members.get(other)
        if there is None:
            return [None] * len(here)
        if len(here) != len(there):
            return [self.same_in(k, other) for k in here]
        base = self.base  # the same nodes in the same order, as generated (see same_in)
        if list(map(base, here)) == list(map(base, there)):
            return list(there)
        found = list(here)
        for at, (k, c) in enumerate(zip(here, there, strict=True)):
            if base(c) == base(k):
                found[at] = c
            else:  # by key, as same_in
                self._index(mb)
                self._index(other)
                found[at] = self.by_key.get((other, self.keys[k]))
        return found

    def same_in(self, k: int, mb: int) -> int | None:
        """The position of the node of micro-batch ``mb`` that is node ``k``'s alike (same
        key), None where there is none."""
        own = self.micro_batch[k]
        if own is None or mb not in self.members:
            return None
        here, there = self.members[own], self.members[mb]
        if len(here) == len(there):  # the same nodes in the same order, as generated
            candidate = there[bisect_left(here, k)]
            if self.base(candidate) == self.base(k):
                return candidate
        self._index(own)
        self._index(mb)
        return self.by_key.get((mb, self.keys[k]))


def _micro_batches(
    problem: Problem, first: list[int | None] | None = None
) -> tuple[list[list[int | None]], int | None]:
    """Each unit's nodes' micro-batches, and how many micro-batches there are (None unless
    every unit has the same number, from 0); ``first``: the first unit's, where known."""
    per_unit = [
        first if first is not None and u == 0 else _declared_micro_batches(unit.nodes)
        for u, unit in enumerate(problem.units)
    ]
    counts = set()
    for mbs in per_unit:
        declared = {mb for mb in mbs if mb is not None}
        if not declared or len(declared) != max(declared) + 1:
            return per_unit, None
        counts.add(len(declared))
    return per_unit, (counts.pop() if len(counts) == 1 else None)


def _indexed_units(
    problem: Problem, first: list[int | None] | None = None
) -> tuple[list[_Indexed], int | None]:
    """Each unit's nodes indexed (alike nodes of every unit sharing their keys), and how many
    micro-batches there are (as :func:`_micro_batches`); ``first``: the first unit's
    micro-batches, where known."""
    shared: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    indexed: list[_Indexed] = []
    for u, (unit, like) in enumerate(zip(problem.units, alike_units(problem), strict=True)):
        if like is not None:  # the same index on its own nodes
            indexed.append(copy.copy(indexed[like]))
            indexed[u].nodes = unit.nodes
        else:
            indexed.append(_Indexed(unit.nodes, first if u == 0 else None, shared))
    counts = set()
    for index in indexed:
        declared = index.members.keys()
        if not declared or len(declared) != max(declared) + 1:
            return indexed, None
        counts.add(len(declared))
    return indexed, (counts.pop() if len(counts) == 1 else None)


def _declared_micro_batches(nodes: Sequence[Any]) -> list[int | None]:
    """Each node's :func:`stg.core.workload.node_micro_batch`, inline (once per node)."""
    out: list[int | None] = []
    append = out.append
    for node in nodes:
        try:  # an attribute read, cheaper than getattr with a default
            attrs = node.attrs or _NO_ATTRS
        except AttributeError:
            attrs = _NO_ATTRS
        value = attrs.get(MICRO_BATCH_ATTR)
        append(value if type(value) is int else None)
    return out


_NO_ATTRS: Mapping[str, Any] = {}


def reduced_problem(problem: Problem, keep: int) -> Problem:
    """The problem with only its first ``keep`` micro-batches: the schedule of ``keep``
    micro-batches. A kept micro-batch's node that waits for a dropped one (a forward that
    the schedule orders before it) waits for what that one waits for instead; a node outside
    the micro-batches (a gradient reduction, the optimizer) that waits for micro-batch
    ``y`` of the ``M`` waits for the same node of micro-batch ``y - (M - keep)``."""
    indexed, total = _indexed_units(problem)
    if total is None:
        raise ValueError("the problem's units do not declare the same micro-batches")
    return _reduced(problem, keep, total, indexed)


@dataclass
class _Reduction:
    """A reduced problem (:func:`_reduction`) and how it lies in the problem it was reduced
    from, per unit by position there: the nodes it keeps, those it drops, and the kept ones it
    gives other dependencies."""

    problem: Problem
    kept: list[bytearray]
    """per unit and position: whether the reduced problem has the node"""
    gone: list[list[int]]
    """per unit: the positions of the dropped nodes, ascending"""
    replaced: list[list[tuple[int, Any]]]
    """per unit: (position, the reduced problem's node) of each kept node with other
    dependencies, ascending"""
    reordered: list[dict[int, float]]
    """per unit: the nodes outside the micro-batches that the reduced problem takes from their
    streams' queues as if at another position (:func:`_placed_ends`), by position, with that
    position's key"""


def _reduced(
    problem: Problem,
    keep: int,
    total: int,
    indexed: Sequence[_Indexed],
    children: Sequence[Sequence[Sequence[int]]] | None = None,
    tail_from: int | None = None,
) -> Problem:
    """:func:`reduced_problem` with each unit's nodes indexed; ``children``: per unit and
    position in ``problem``, the positions of the nodes that wait for it (the engine's), where
    known: only the dropped nodes' are then looked at for the nodes that wait for one.
    ``tail_from``: the kept micro-batches from it on wait as their alikes toward the end of
    ``problem`` do (:func:`_tail_deps`)."""
    return _reduction(problem, keep, total, indexed, children, tail_from).problem


def _reduction(
    problem: Problem,
    keep: int,
    total: int,
    indexed: Sequence[_Indexed],
    children: Sequence[Sequence[Sequence[int]]] | None = None,
    tail_from: int | None = None,
    place_ends: bool = False,
) -> _Reduction:
    """:func:`_reduced`, with where its nodes lie in ``problem``; ``place_ends``: the nodes
    outside the micro-batches that ``problem`` places among its last micro-batches' are taken
    from their streams' queues where the schedule of ``keep`` micro-batches places them
    (:func:`_placed_ends`)."""
    shift = total - keep
    units: list[Unit] = []
    reduction = _Reduction(
        Problem(units, problem.unit_of_rank, problem.comm_groups, problem.world_size),
        [], [], [], [],
    )  # fmt: skip
    alike = alike_units(problem)
    for u, (unit, index) in enumerate(zip(problem.units, indexed, strict=True)):
        like = alike[u]
        if like is not None:  # the same reduction as that unit's, its own nodes kept
            _reduce_alike(reduction, problem, u, like)
            continue
        mbs = index.micro_batch
        nodes = index.nodes
        position = index.position
        frontier: dict[int, tuple[int, ...]] = {}

        gone = sorted(k for mb, members in index.members.items() if mb >= keep for k in members)
        """the dropped nodes' positions"""
        kept_mask = bytearray(b"\x01") * len(nodes)
        for k in gone:
            kept_mask[k] = 0
        kept_nodes = list(itertools.compress(nodes, kept_mask))
        """as they are, but for those rewritten below (the node at position ``i`` is the
        ``i - bisect_left(gone, i)``-th)"""
        dropped = {nodes[k].id for k in gone}
        ending_deps = _end_deps(index, keep, shift)
        rewrite: Iterable[int]
        """the kept nodes that may wait for a dropped one or have _end_deps, ascending"""
        tail: set[int] = set()
        """the kept nodes of the micro-batches from ``tail_from`` on"""
        if tail_from is not None and shift:
            late = [ks for mb, ks in index.members.items() if tail_from <= mb < keep]
            tail = {k for members in late for k in members}
        if children is not None:
            below = children[u]
            waiting = {c for k in gone for c in below[k] if kept_mask[c]}
            rewrite = sorted(waiting.union(ending_deps, tail))
        else:
            rewrite = itertools.compress(range(len(nodes)), kept_mask)
        replaced: list[tuple[int, Any]] = []
        for i in rewrite:
            node = nodes[i]
            if i in tail:
                found = _tail_deps(index, i, mbs[i], shift)
                if found is None:
                    raise _NotPeriodic
                if set(found) != {*node.data_deps, *node.ctrl_deps}:
                    at = i - bisect_left(gone, i)
                    kept_nodes[at] = dataclasses.replace(node, data_deps=found, ctrl_deps=())
                    replaced.append((i, kept_nodes[at]))
                continue
            ending = ending_deps.get(i, ())
            if not ending and dropped.isdisjoint(node.data_deps):
                if not node.ctrl_deps or dropped.isdisjoint(node.ctrl_deps):
                    continue  # waits for no dropped node: as it is
            at = i - bisect_left(gone, i)
            deps = node.data_deps
            if node.ctrl_deps:
                deps = (*deps, *node.ctrl_deps)
            if ending:
                deps = (*deps, *(d for d in ending if d not in deps))
                if dropped.isdisjoint(deps):
                    kept_nodes[at] = dataclasses.replace(node, data_deps=deps, ctrl_deps=())
                    replaced.append((i, kept_nodes[at]))
                    continue
            mb = mbs[i]
            new_deps: dict[int, None] = {}
            for d in deps:
                k = position[d]
                if mb is None and mbs[k] is not None:
                    # an end-of-iteration node waits for micro-batch y of the whole schedule
                    # where the schedule of ``keep`` waits for y - shift (its last ones, or
                    # all of them: the same set); a kept one's alike too
                    y = mbs[k] - shift
                    if y >= 0:
                        partner = index.same_in(k, y)
                        if partner is None:
                            raise _NotPeriodic
                        new_deps[nodes[partner].id] = None
                elif _kept(mbs[k], keep):
                    new_deps[d] = None
                else:
                    new_deps.update(dict.fromkeys(_kept_ancestors(index, k, keep, frontier)))
            kept_nodes[at] = dataclasses.replace(node, data_deps=tuple(new_deps), ctrl_deps=())
            replaced.append((i, kept_nodes[at]))
        group_keys = _kept_group_keys(unit, kept_mask, gone)
        reordered = _placed_ends(index, keep, shift, gone) if place_ends and shift else {}
        priority = {}
        for i, key in reordered.items():
            whole = int(key)
            priority[i - bisect_left(gone, i)] = key - bisect_left(gone, whole)
        units.append(
            dataclasses.replace(unit, nodes=kept_nodes, group_keys=group_keys, priority=priority)
        )
        reduction.kept.append(kept_mask)
        reduction.gone.append(gone)
        reduction.replaced.append(replaced)
        reduction.reordered.append(reordered)
    return reduction


def _kept_group_keys(unit: Unit, kept_mask: bytearray, gone: Sequence[int]) -> dict[int, Any]:
    """``unit``'s collectives' matching keys (:attr:`Unit.group_keys`) at the reduced
    problem's positions."""
    keys = unit.group_keys
    return {i - bisect_left(gone, i): keys[i] for i in sorted(keys) if kept_mask[i]}


def _reduce_alike(reduction: _Reduction, problem: Problem, u: int, like: int) -> None:
    """:func:`_reduction` of unit ``u``, alike unit ``like`` (:func:`alike_units`: the same
    nodes but for its communication nodes' communicators and peers), whose reduction is
    done: the same nodes kept and dropped, the same dependencies rewritten, on its own nodes
    (the rewritten node objects of the nodes the two share, shared)."""
    unit, nodes, theirs = problem.units[u], problem.units[u].nodes, problem.units[like].nodes
    kept_mask, gone = reduction.kept[like], reduction.gone[like]
    kept_nodes = list(itertools.compress(nodes, kept_mask))
    replaced: list[tuple[int, Any]] = []
    for i, node in reduction.replaced[like]:
        if nodes[i] is not theirs[i]:
            node = dataclasses.replace(nodes[i], data_deps=node.data_deps, ctrl_deps=node.ctrl_deps)
        kept_nodes[i - bisect_left(gone, i)] = node
        replaced.append((i, node))
    group_keys = _kept_group_keys(unit, kept_mask, gone)
    priority = reduction.problem.units[like].priority
    reduction.problem.units.append(
        dataclasses.replace(unit, nodes=kept_nodes, group_keys=group_keys, priority=priority)
    )
    reduction.kept.append(kept_mask)
    reduction.gone.append(gone)
    reduction.replaced.append(replaced)
    reduction.reordered.append(reduction.reordered[like])


def _placed_ends(index: _Indexed, keep: int, shift: int, gone: Sequence[int]) -> dict[int, float]:
    """The nodes outside the micro-batches that follow a node of a dropped micro-batch ``y``
    (those after its last kept one), each with the key of its place in the schedule of
    ``keep`` micro-batches: right after that node's alike in micro-batch ``y - shift``, where
    that schedule issues it (a gradient reduction issued as the last micro-batch's backward
    leaves its chunk, before the backward of the chunks below). Kept, such a node would be
    taken from its stream's queue after the kept nodes between the two places, where the
    schedule takes it before them. Keys between two positions (a run of such nodes after one
    node in order), by position; only where a kept micro-batch node lies between the two
    places (``gone``: the dropped nodes' positions, ascending)."""
    mbs = index.micro_batch
    after: dict[int, int] = {}
    """each node outside the micro-batches: the position of the micro-batch node before it"""
    runs: dict[int, list[int]] = {}
    for e in index.unbatched:  # ascending
        k = e - 1
        x = after.get(k, -1) if k >= 0 and mbs[k] is None else k
        after[e] = x
        y = mbs[x] if x >= 0 else None
        if y is not None and y >= keep:
            runs.setdefault(x, []).append(e)
    placed: dict[int, float] = {}
    unbatched = index.unbatched
    for x, run in runs.items():
        alike = index.same_in(x, mbs[x] - shift)  # type: ignore[operator]
        if alike is None:
            continue
        between = x - alike - 1  # positions strictly between; those of kept micro-batches:
        between -= bisect_left(gone, x) - bisect_left(gone, alike + 1)
        between -= bisect_left(unbatched, x) - bisect_left(unbatched, alike + 1)
        if between <= 0:
            continue
        for t, e in enumerate(run, 1):
            placed[e] = alike + t / (len(run) + 1)
    return placed


def _end_deps(index: _Indexed, keep: int, shift: int) -> dict[int, tuple[int, ...]]:
    """Per kept node of micro-batch ``x`` whose alike in micro-batch ``x + shift`` is dropped,
    the nodes outside the micro-batches that this alike waits for, where there are any: in
    the schedule of ``keep`` micro-batches, micro-batch ``x`` is where ``x + shift`` is in the
    whole one, and waits for the same end-of-iteration nodes (a collective of the last
    micro-batch's backward issued after the head's gradient reduction on the same
    communicator)."""
    found: dict[int, tuple[int, ...]] = {}
    if not shift:
        return found
    nodes, position, mbs = index.nodes, index.position, index.micro_batch
    for mb in range(max(keep - shift, 0), keep):
        members = index.members.get(mb, [])
        for i, partner in zip(members, index.alikes_in(mb, mb + shift), strict=True):
            if partner is None:
                raise _NotPeriodic
            node = nodes[partner]
            deps = (*node.data_deps, *node.ctrl_deps) if node.ctrl_deps else node.data_deps
            ending = [d for d in deps if mbs[position[d]] is None]
            if ending:
                found[i] = tuple(ending)
    return found


def _tail_deps(index: _Indexed, i: int, mb: int, shift: int) -> tuple[int, ...] | None:
    """The dependencies that node ``i`` (of micro-batch ``mb``, waiting for a dropped node)
    has in the schedule of ``shift`` fewer micro-batches: there micro-batch ``mb`` is where
    ``mb + shift`` is in the whole one (toward the drain, as :func:`_end_deps` says of the
    nodes outside the micro-batches), so it waits for what its alike in ``mb + shift`` waits
    for, ``shift`` micro-batches earlier. None where an alike is missing."""
    nodes, position, mbs = index.nodes, index.position, index.micro_batch
    partner = index.same_in(i, mb + shift)
    if partner is None:
        return None
    node = nodes[partner]
    found: dict[int, None] = {}
    for d in (*node.data_deps, *node.ctrl_deps):
        k = position[d]
        y = mbs[k]
        if y is None:
            found[d] = None
            continue
        if y < shift:
            return None
        alike = index.same_in(k, y - shift)
        if alike is None:
            return None
        found[nodes[alike].id] = None
    return tuple(found)


def _kept_ancestors(
    index: _Indexed, i: int, keep: int, frontier: dict[int, tuple[int, ...]]
) -> tuple[int, ...]:
    """The ids of the kept nodes that dropped node ``i`` waits for, through dropped ones
    (``frontier``: those found so far, by dropped node)."""
    nodes, mbs, position = index.nodes, index.micro_batch, index.position
    stack = [i]
    waits: dict[int, list[int]] = {}
    """the positions each node on the stack waits for, worked out on its first visit"""
    while stack:
        j = stack[-1]
        if j in frontier:
            stack.pop()
            continue
        deps = waits.get(j)
        if deps is None:
            deps = waits[j] = [position[d] for d in (*nodes[j].data_deps, *nodes[j].ctrl_deps)]
        missing = [k for k in deps if not _kept(mbs[k], keep) and k not in frontier]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        found: dict[int, None] = {}
        for k in deps:
            mb = mbs[k]
            if mb is None or mb < keep:  # kept
                found[nodes[k].id] = None
            else:
                found.update(dict.fromkeys(frontier[k]))
        frontier[j] = tuple(found)
    return frontier[i]


def _kept(mb: int | None, keep: int) -> bool:
    return mb is None or mb < keep


class _NotPeriodic(Exception):
    """The reduced problems are not one period apart."""


Partner = tuple[int, bool]
"""A node's partner in the shorter replay: its position there, and whether it runs one period
later (True) or at the same instants."""


def _aligned(
    short: Replay, long: Replay, indexed: Sequence[_Indexed], period: int, cut: int
) -> tuple[float, list[list[Partner]]] | None:
    """The period's duration and each node's partner if ``long`` is ``short`` with one period
    inserted at micro-batch ``cut`` (see the module docstring), else None."""
    period_time = long.iteration_time - short.iteration_time
    tolerance = TOLERANCE * max(long.iteration_time, 1e-300)
    partners: list[list[Partner]] = []
    for s_res, l_res, index in zip(short.units, long.units, indexed, strict=True):
        s_pos = {n.id: i for i, n in enumerate(s_res.unit.nodes)}
        full_pos = index.position
        unit_partners: list[Partner] = []
        for j, node in enumerate(l_res.unit.nodes):
            k = full_pos[node.id]
            mb = index.micro_batch[k]
            if mb is None:
                partner = s_pos[node.id]
                shifts: tuple[bool, ...] = (False, True)
            elif mb < cut:
                partner = s_pos[node.id]
                shifts = (False,)
            else:
                full_partner = index.same_in(k, mb - period)
                if full_partner is None:
                    return None
                found = s_pos.get(index.nodes[full_partner].id)
                if found is None:
                    return None
                partner, shifts = found, (True,)
            if s_res.kind[partner] != l_res.kind[j]:
                return None
            # a receive or instant node has no transfer start (-1 in both)
            issued = s_res.transfer_start[partner] >= 0
            if issued != (l_res.transfer_start[j] >= 0):
                return None
            for shifted in shifts:
                off = period_time if shifted else 0.0
                if (
                    abs(l_res.start[j] - s_res.start[partner] - off) <= tolerance
                    and abs(l_res.end[j] - s_res.end[partner] - off) <= tolerance
                    and (
                        not issued
                        or abs(l_res.transfer_start[j] - s_res.transfer_start[partner] - off)
                        <= tolerance
                    )
                ):
                    unit_partners.append((partner, shifted))
                    break
            else:
                return None
        partners.append(unit_partners)
    return period_time, partners


class _Shift:
    """The correspondence the state check verifies: each node of the longer problem to the
    node in the same place one period later (the k-th node of micro-batch ``x`` of a unit to
    the k-th of ``x + period``, where both hold as many; a node outside the micro-batches to
    itself), and the positions of both problems' nodes. Any one-to-one correspondence would
    do: the check compares what the engine sees of the nodes paired (their costs, streams,
    matching keys and dependencies), not their names."""

    def __init__(
        self,
        long: Problem,
        short: Problem,
        indexed: Sequence[_Indexed],
        period: int,
        reduction: _Reduction | None = None,
    ) -> None:
        """``reduction``: ``short`` as :func:`_reduction` made it, where ``long`` is the
        problem it reduced (where the nodes lie is known then)."""
        self.long_nodes = [u.nodes for u in long.units]
        self.long_pos: list[Mapping[int, int]] = []
        """per unit: each node's position in the longer problem, by id"""
        self.kept: list[bytearray] = []
        """per unit and position in the longer problem: whether the shorter one has the node"""
        self.dropped: list[list[int]] = []
        """per unit: the positions in the longer problem of the nodes the shorter one lacks"""
        self.replaced: list[list[tuple[int, Any]]] = []
        """per unit: (position in the longer problem, the shorter one's node) of each node the
        shorter problem has another node object for (other dependencies), ascending"""
        self.reordered: list[Mapping[int, float]] = []
        """per unit: the shorter problem's nodes taken from their queues as if at another
        position (:func:`_placed_ends`), by position in the longer problem, with that key"""
        self.in_order = True
        """the shorter problem's nodes are in the longer one's order (as reduced problems keep
        them): its columns are the longer one's, less the nodes it lacks"""
        known = reduction is not None and reduction.problem is short
        for u, (lunit, sunit, index) in enumerate(
            zip(long.units, short.units, indexed, strict=True)
        ):
            nodes = lunit.nodes
            if known and nodes is index.nodes:
                assert reduction is not None
                self.long_pos.append(index.position)
                self.kept.append(reduction.kept[u])
                self.dropped.append(reduction.gone[u])
                self.replaced.append(reduction.replaced[u])
                self.reordered.append(reduction.reordered[u])
                continue
            ids = [n.id for n in nodes]
            by_id: Mapping[int, int] = range(len(nodes))
            if ids != list(by_id):
                by_id = {i: j for j, i in enumerate(ids)}
            kept = bytearray(len(nodes))
            at = [by_id[n.id] for n in sunit.nodes]
            for j in at:
                kept[j] = 1
            # (queue keys by the shorter problem's positions: not compared, only replayed)
            self.in_order = self.in_order and at == sorted(at) and not sunit.priority
            self.reordered.append({})
            self.long_pos.append(by_id)
            self.kept.append(kept)
            self.dropped.append([j for j, k in enumerate(kept) if not k])
            replaced = [(j, n) for j, n in zip(at, sunit.nodes, strict=True) if n is not nodes[j]]
            self.replaced.append(sorted(replaced, key=operator.itemgetter(0)))
        self.later: list[list[int | None]] = []
        """per unit and position in the longer problem: that of its node one period later"""
        for unit, index in zip(long.units, indexed, strict=True):
            later: list[int | None] = [None] * len(unit.nodes)
            if unit.nodes is index.nodes:  # the longer problem is the whole one
                members = index.members
                for j in index.unbatched:
                    later[j] = j
            else:
                position, micro_batch = index.position, index.micro_batch
                members = {}
                for j, node in enumerate(unit.nodes):
                    mb = micro_batch[position[node.id]]
                    if mb is None:
                        later[j] = j
                    else:
                        members.setdefault(mb, []).append(j)
            for mb, here in members.items():
                there = members.get(mb + period)
                if there is not None and len(there) == len(here):
                    for j, k in zip(here, there, strict=True):
                        later[j] = k
            self.later.append(later)

    def ref(self, ref: tuple[int, int] | None) -> tuple[int, int] | bool | None:
        """A (unit, node) reference one period later; False where it has none."""
        if ref is None:
            return None
        moved = self.later[ref[0]][ref[1]]
        return False if moved is None else (ref[0], moved)


def _topological(long_ordered: bool, rewritten: Mapping[int, set[int]]) -> bool:
    """Whether every node of both problems depends only on nodes at lower positions of the
    longer one: the longer one's nodes (``long_ordered``, as the engine found them) and the
    shorter one's that differ from them (``rewritten``: their dependencies, by position)."""
    return long_ordered and all(not deps or max(deps) < j for j, deps in rewritten.items())


def _short_from_long(
    long: Replay, long_problem: Problem, short_problem: Problem, shift: _Shift, tolerance: float
) -> tuple[Replay, list[list[bool]]] | None:
    """The replay of ``short_problem`` (one period fewer) read off ``long``, with per unit and
    node of ``long`` whether it is not finished at ``a`` (it runs a period later than its
    partner in the shorter replay, its alike a period earlier), or None.

    ``long`` carries the engine's state at two instants (:class:`stg.perf.replay.EngineState`),
    ``a`` and ``b`` (``T`` later). Where, up to ``a``, every node that differs between the two
    problems (the shorter one's last micro-batches dropped, dependencies moved to their kept
    ancestors) is untouched, the shorter problem replays as the longer one until ``a``, and
    has there the same state (its pending counts taken from its own dependencies). Where
    that state is the longer replay's at ``b`` with every node reference moved one period
    later and every instant ``T`` later (the nodes not finished, their pending dependencies,
    costs, streams and matching keys, the events ahead in their order, the ready queues, the
    streams' occupation, the waiting sends and receives, the collectives' issue counts and
    half-issued ones, the transfers in flight with their remaining bytes and rates, the
    ports' users), the engine, deterministic, does from ``a`` on in the shorter problem what
    it does from ``b`` on in the longer one, ``T`` earlier: each node not finished at ``a``
    runs as its alike one period later does, ``T`` earlier."""
    if len(long.states) < 2 or long.prepared is None or not shift.in_order:
        return None
    for a, b in itertools.pairwise(long.states):
        short = _state_matches(long, long_problem, short_problem, shift, a, b, tolerance)
        if short is not None:
            return short, [list(map(operator.lt, ends, itertools.repeat(0.0))) for ends in a.end]
    return None


def _state_matches(
    long: Replay,
    long_problem: Problem,
    short_problem: Problem,
    shift: _Shift,
    a: EngineState,
    b: EngineState,
    tolerance: float,
) -> Replay | None:
    """The shorter problem's replay where its state at ``a`` is the longer one's at ``b`` one
    period earlier (see :func:`_short_from_long`), else None."""
    span = b.time - a.time
    if span <= 0:
        return None
    check = _Check(long, long_problem, short_problem, shift, a, b, span, tolerance)
    if not check.prefix():
        return None
    for u in range(len(long_problem.units)):
        if not check.unit(u):
            return None
    if not (check.events() and check.streams() and check.messages() and check.collectives()):
        return None
    return _read_off(long, short_problem, shift, a, span, check.opened)


class _Check:
    """The comparisons of :func:`_state_matches`, each a part of the state: ``a`` (of the
    shorter problem, read as the longer one's) against ``b`` one period later."""

    def __init__(
        self,
        long: Replay,
        long_problem: Problem,
        short_problem: Problem,
        shift: _Shift,
        a: EngineState,
        b: EngineState,
        span: float,
        tolerance: float,
    ) -> None:
        self.long, self.sim = long, long.prepared
        self.long_problem, self.short_problem = long_problem, short_problem
        self.shift, self.a, self.b = shift, a, b
        self.span, self.tolerance = span, tolerance
        self.keys: dict[Any, Any] = {}
        """each matching key (send and receive) of ``a`` to its one of ``b``"""
        self.back: dict[Any, Any] = {}
        self.rewritten: list[dict[int, set[int]]] = []
        """per unit: the shorter problem's nodes whose dependencies differ (dependencies moved
        to kept ancestors), by position in the longer one: those dependencies"""
        self.opened: list[list[int]] = []
        """per unit: the shorter problem's nodes not finished at ``a``, by position in the
        longer one"""
        self.flows: dict[int, int] = {}
        """each transfer in flight at ``a`` to its one at ``b``"""

    def close(self, x: float, y: float) -> bool:
        """``y`` is the instant ``x``, one period later."""
        return abs(y - x - self.span) <= self.tolerance

    def same_key(self, x: Any, y: Any) -> bool:
        """Matching keys correspond one to one."""
        return self.keys.setdefault(x, y) == y and self.back.setdefault(y, x) == x

    def prefix(self) -> bool:
        """The shorter problem replays as the longer one up to ``a``: every node that differs
        (dropped, or with other dependencies) is untouched there and the communicators'
        streams are numbered alike."""
        a, shift = self.a, self.shift
        for u, lunit in enumerate(self.long_problem.units):
            lnodes, lpos, kept = lunit.nodes, shift.long_pos[u], shift.kept[u]
            a_end, a_pending = a.end[u], a.pending[u]
            if not all([a_pending[k] for k in shift.dropped[u]]):
                return False  # a dropped node became ready
            if not all([a_pending[k] for k in shift.reordered[u]]):
                return False  # a node taken from its queue elsewhere became ready
            rewritten: dict[int, set[int]] = {}
            for j, snode in shift.replaced[u]:
                deps = {lpos[d] for d in (*snode.data_deps, *snode.ctrl_deps)}
                if a_pending[j] == 0 or all(a_end[d] >= 0 for d in deps):
                    return False
                rewritten[j] = deps
            # in the shorter problem's order: the longer one's (in_order)
            opened = [j for j in itertools.compress(range(len(kept)), kept) if a_end[j] < 0]
            seen: set[Any] = set()
            for j in self.sim.coll_key[u]:  # in node order
                group = lnodes[j].comm_group
                if group not in seen:
                    seen.add(group)
                    if not kept[j]:
                        return False
            self.rewritten.append(rewritten)
            self.opened.append(opened)
        return True

    def unit(self, u: int) -> bool:
        """Every node not finished at ``a`` and its node one period later at ``b``: the same
        costs, stream, matching keys, progress (issued, transfer started, ready: when and
        after what) and dependencies not finished; none other at ``b``; in the same order on
        each stream. (Compared a column at a time: the same lists, where most are equal.)"""
        a, b, sim, close, tolerance = self.a, self.b, self.sim, self.close, self.tolerance
        later, moved = self.shift.later[u], self.shift.ref
        lnodes, lpos = self.shift.long_nodes[u], self.shift.long_pos[u]
        opened, rewritten = self.opened[u], self.rewritten[u]
        a_end, b_end = a.end[u], b.end[u]
        a_pending, b_pending = a.pending[u], b.pending[u]
        a_live, b_live = a.live[u], b.live[u]
        none = (-1.0, -1.0, 0.0, None)
        kind, stream = self.long.units[u].kind, sim.stream[u]
        # one to one: ``later`` is, and maps the nodes not finished onto those at ``b``
        theirs = _at(later, opened)
        # an end is -1 until the node ends (instants are never negative)
        if None in theirs or len(opened) != b_end.count(-1.0):
            return False
        ms: list[int] = theirs  # type: ignore[assignment]
        if ms and max([b_end[m] for m in ms]) >= 0:
            return False
        kinds = _at(kind, opened)
        if kinds != _at(kind, ms):
            return False
        for column in (stream, sim.cost_key[u]):
            if _at(column, opened) != _at(column, ms):
                return False
        # the durations: as prepared, or as the engine has them once ready
        a_duration, b_duration = sim.initial_duration[u].copy(), sim.initial_duration[u].copy()
        for j, live in a_live.items():
            a_duration[j] = live[2]
        for m, live in b_live.items():
            b_duration[m] = live[2]
        durations = (_at(a_duration, opened), _at(b_duration, ms))
        if durations[0] != durations[1] and any(
            abs(x - y) > tolerance for x, y in zip(*durations, strict=True)
        ):
            return False
        # in the same order: the ready queue of each stream, and the receives and instant
        # nodes made ready together (pushed as events in order); at once where ``later``
        # keeps the order of all of them (the shorter problem's queue keys, where some are
        # not positions)
        reordered = self.shift.reordered[u]
        if reordered or not all(map(operator.lt, ms, itertools.islice(ms, 1, None))):
            last: dict[int | None, int] = {}
            pairs: Iterable[tuple[int, int]] = zip(opened, ms, strict=True)
            if reordered:
                pairs = sorted(pairs, key=lambda pair: reordered.get(pair[0], pair[0]))
            for j, m in pairs:
                order = stream[j] if kind[j] in STREAMED else None
                if m <= last.get(order, -1):
                    return False
                last[order] = m
        # the communication nodes: the same transfer, contention and matching keys (a column
        # at a time)
        steps, link, p2p = sim.steps[u], sim.comm_link[u], sim.p2p_key[u]
        coll_key, coll_needed = sim.coll_key[u], sim.coll_needed[u]
        communication = [k != COMPUTE for k in kinds]
        cj = list(itertools.compress(opened, communication))
        cm = list(itertools.compress(ms, communication))
        for column in (steps, link):
            if _at(column, cj) != _at(column, cm):
                return False
        for lookup in (coll_key, coll_needed):
            if list(map(lookup.get, cj)) != list(map(lookup.get, cm)):
                return False
        sent_or_received = list(map(p2p.__contains__, cj))
        if sent_or_received != list(map(p2p.__contains__, cm)):
            return False
        for j, m in itertools.compress(zip(cj, cm, strict=True), sent_or_received):
            if not self.same_key(p2p[j], p2p[m]):
                return False
        # the nodes ready at either instant (a few): issued alike
        kept = self.shift.kept[u]
        ready = {j: later[j] for j in a_live if kept[j] and a_end[j] < 0}  # of ``opened``
        for m in b_live:
            k = -1
            for _ in range(ms.count(m)):
                k = ms.index(m, k + 1)
                ready[opened[k]] = m
        for j, m in ready.items():
            at_a, at_b = a_live.get(j), b_live.get(m)
            x, x_issued, _, x_cause = (at_a or none)[:4]
            y, y_issued, _, y_cause = (at_b or none)[:4]
            if x >= 0 or y >= 0:  # issued: when, after what, its transfer since when
                if x < 0 or y < 0 or not close(x, y) or moved(x_cause) != y_cause:
                    return False
                if (x_issued < 0) != (y_issued < 0) or (
                    x_issued >= 0 and not close(x_issued, y_issued)
                ):
                    return False

        def long_deps(j: int) -> set[int]:
            return {lpos[d] for d in (*lnodes[j].data_deps, *lnodes[j].ctrl_deps)}

        def short_deps(j: int) -> set[int]:
            found = rewritten.get(j)
            return long_deps(j) if found is None else found

        topological = _topological(sim.ordered[u], rewritten)
        by_position = isinstance(lpos, range)
        if by_position:
            # the commonest case at once: the same dependencies one period later (then the
            # ones not finished correspond too: the nodes not finished do, one to one)
            js, pms = opened, ms
            if rewritten:
                unchanged = [not r for r in map(rewritten.__contains__, opened)]
                js = list(itertools.compress(opened, unchanged))
                pms = list(itertools.compress(ms, unchanged))
            mine_nodes, their_nodes = _at(lnodes, js), _at(lnodes, pms)
            if (
                _at(a_pending, js) == _at(b_pending, pms)
                and _later_deps(
                    [n.data_deps for n in mine_nodes], [n.data_deps for n in their_nodes], later
                )
                and _later_deps(
                    [n.ctrl_deps for n in mine_nodes], [n.ctrl_deps for n in their_nodes], later
                )
            ):
                # those ready (none pending, not finished; a few): ready alike
                for j in a_live:
                    if kept[j] and a_end[j] < 0 and j not in rewritten:  # of ``js``
                        if not self.ready_alike(u, j, later[j]):  # type: ignore[arg-type]
                            return False
                opened, ms = list(rewritten), [later[j] for j in rewritten]  # type: ignore[misc]
        for j, m in zip(opened, ms, strict=True):
            if j not in rewritten:
                pending = a_pending[j]
                if by_position and pending == b_pending[m]:
                    # the same dependencies one period later: the ones not finished
                    # correspond too (the nodes not finished do, one to one)
                    node, other = lnodes[j], lnodes[m]
                    if [later[d] for d in node.data_deps] == list(other.data_deps) and [
                        later[d] for d in node.ctrl_deps
                    ] == list(other.ctrl_deps):
                        if not pending and not self.ready_alike(u, j, m):
                            return False
                        continue
            mine = {d for d in short_deps(j) if a_end[d] < 0}
            theirs_deps = {d for d in long_deps(m) if b_end[d] < 0}
            if (j not in rewritten and a_pending[j] != len(mine)) or b_pending[m] != len(
                theirs_deps
            ):
                return False
            if not mine or not theirs_deps:
                if mine or theirs_deps or not self.ready_alike(u, j, m):
                    return False
                continue
            # the dependencies not finished, one period later: the same, but for those that
            # another reaches back to (a node waiting for a dropped one waits for its kept
            # ancestors, some of them before others)
            shifted = {later[d] for d in mine}
            if shifted != theirs_deps:
                extra_mine = {d for d in mine if later[d] not in theirs_deps}
                extra_theirs = theirs_deps - shifted
                mine -= _implied(extra_mine, mine, short_deps, lambda d: a_end[d] < 0, topological)
                theirs_deps -= _implied(
                    extra_theirs, theirs_deps, long_deps, lambda d: b_end[d] < 0, topological
                )
                if {later[d] for d in mine} != theirs_deps:
                    return False
        return True

    def ready_alike(self, u: int, j: int, m: int) -> bool:
        """Node ``j``, ready at ``a``, became so as node ``m`` at ``b``: one period earlier,
        after the node one period earlier."""
        x, y = self.a.live[u].get(j), self.b.live[u].get(m)
        return (
            x is not None
            and y is not None
            and self.close(x[4], y[4])
            and self.shift.ref(x[5]) == y[5]
        )

    def events(self) -> bool:
        """The events ahead in the same order (ties alike), and the transfers in flight: the
        same members and steps, at the same step, ending as far ahead, with as much left at
        the same rate; the ports' users and each unit's contending transfers in order."""
        a, b, close, tolerance, moved = self.a, self.b, self.close, self.tolerance, self.shift.ref
        if len(a.heap) != len(b.heap) or len(a.flows) != len(b.flows):
            return False
        flows = self.flows
        previous: tuple[float, float] | None = None
        for (ta, ua, ia), (tb, ub, ib) in zip(a.heap, b.heap, strict=True):
            if not close(ta, tb) or (ua < 0) != (ub < 0):
                return False
            if previous is not None and (previous[0] == ta) != (previous[1] == tb):
                return False
            previous = (ta, tb)
            if ua >= 0:
                if moved((ua, ia)) != (ub, ib):
                    return False
            elif flows.setdefault(-1 - ua, -1 - ub) != -1 - ub:
                return False
        by_members = {f[0]: index for index, f in b.flows.items()}
        for index, fa in a.flows.items():
            other = by_members.get(tuple(moved(r) for r in fa[0]))
            if other is None or flows.setdefault(index, other) != other:
                return False
            fb = b.flows[other]
            _, ends, steps, step, finish, tail, left, since, rate, ports, link, slows = fa
            if (
                ends != fb[1]
                or steps != fb[2]
                or step != fb[3]
                or not close(finish, fb[4])
                or abs(tail - fb[5]) > tolerance
                or ports != fb[9]
                or link != fb[10]
                or slows != fb[11]
            ):
                return False
            # the bytes moving now: what is left, since when, at what share (a latency step
            # moves none)
            if ports and (
                abs(left - fb[6]) > tolerance or not close(since, fb[7]) or rate != fb[8]
            ):
                return False
        if len(set(flows.values())) != len(flows):
            return False
        if a.users.keys() != b.users.keys():
            return False
        for key, users in a.users.items():
            if [flows.get(f) for f in users] != b.users[key]:
                return False
        for ca, cb in zip(a.contending, b.contending, strict=True):
            # a flow by its number; a collective replayed as one event by its (unit, node)
            if [flows.get(f) if type(f) is int else moved(f) for f in ca] != cb:
                return False
        return True

    def streams(self) -> bool:
        """Each stream's ready nodes, occupation and last node (a cause)."""
        a, b, moved = self.a, self.b, self.shift.ref
        for u, later in enumerate(self.shift.later):
            if a.busy[u] != b.busy[u]:
                return False
            for qa, qb in zip(a.ready[u], b.ready[u], strict=True):
                if [later[j] for j in qa] != qb:
                    return False
            for ra, rb in zip(a.last_on_stream[u], b.last_on_stream[u], strict=True):
                if moved(ra) != rb:
                    return False
        return True

    def messages(self) -> bool:
        """The sends completed before their receive, and the receives waiting for their
        send, under the matching keys that correspond."""
        a, b, moved, keys = self.a, self.b, self.shift.ref, self.keys
        if len(a.mailbox) != len(b.mailbox) or len(a.waiting) != len(b.waiting):
            return False
        for key, entries in a.mailbox.items():
            # its receive is not finished: its key corresponds to one (see ``unit``)
            other = b.mailbox.get(keys[key]) if key in keys else None
            if other is None or len(other) != len(entries):
                return False
            for (t, su, si), (tb, sb, ib) in zip(entries, other, strict=True):
                if moved((su, si)) != (sb, ib) or not self.close(t, tb):
                    return False
        for key, waiting in a.waiting.items():
            if key not in keys or b.waiting.get(keys[key]) != [moved(r) for r in waiting]:
                return False
        return True

    def collectives(self) -> bool:
        """Per communicator, the collectives each unit issued (as many more for each by
        ``b``: the same pairing ahead), and those half issued: the same members, issued
        last at the same instant, after the same node."""
        a, b, moved = self.a, self.b, self.shift.ref
        offset: dict[Any, int] = {}
        for unit_group in a.coll_seq.keys() | b.coll_seq.keys():
            issued = b.coll_seq.get(unit_group, 0) - a.coll_seq.get(unit_group, 0)
            if offset.setdefault(unit_group[1], issued) != issued:
                return False
        if len(a.instances) != len(b.instances):
            return False
        for (group, seq), (members, at, cause) in a.instances.items():
            other = b.instances.get((group, seq + offset.get(group, 0)))
            if (
                other is None
                or tuple(moved(r) for r in members) != other[0]
                or not self.close(at, other[1])
                or moved(cause) != other[2]
            ):
                return False
        return True


def _at(column: Sequence[Any], positions: Iterable[int]) -> list[Any]:
    """``column``'s values at ``positions``, in their order."""
    # a comprehension: its subscripts are specialised bytecode, cheaper than a call each
    return [column[j] for j in positions]


def _later_deps(
    mine: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]], later: Sequence[int | None]
) -> bool:
    """Whether each of ``theirs`` (dependencies, by position) is its entry of ``mine``, each
    dependency one period later, in the same order."""
    return list(map(len, mine)) == list(map(len, theirs)) and [
        later[d] for d in itertools.chain.from_iterable(mine)
    ] == list(itertools.chain.from_iterable(theirs))


STREAMED = frozenset({COMPUTE, COLL, SEND, COPY})
"""The kinds of node that run on a stream (the others are made ready as events)."""


def _implied(
    candidates: set[int],
    deps: set[int],
    parents: Callable[[int], set[int]],
    running: Callable[[int], bool],
    topological: bool = False,
) -> set[int]:
    """Those of ``candidates`` (among ``deps``) that another of ``deps`` reaches back to
    through nodes not finished: a node waits for such a dependency anyway (it ends before
    the other starts). ``topological``: every node's dependencies lie at lower positions, so
    no node below the lowest candidate leads back to one and the walk stops there."""
    if not candidates:
        return set()
    floor = min(candidates) if topological else -1
    found: set[int] = set()
    seen: set[int] = set()
    stack = [p for d in deps for p in parents(d) if p >= floor and running(p)]
    while stack and len(found) < len(candidates):
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in candidates:
            found.add(x)
        stack.extend(p for p in parents(x) if p >= floor and running(p))
    return found


def _read_off(
    long: Replay,
    short_problem: Problem,
    shift: _Shift,
    a: EngineState,
    span: float,
    opened: Sequence[Sequence[int]],
) -> Replay:
    """The shorter problem's replay: its nodes finished at ``a`` as in ``long``, the others
    (``opened``: per unit, their positions in the longer problem) as their alikes one period
    later, ``span`` earlier (causes left out: the path is walked in the longer replay)."""
    units = []
    for u, sunit in enumerate(short_problem.units):
        res = long.units[u]
        # by position in the longer problem: the nodes finished at ``a`` as in ``long`` (most
        # of them), the others read off; then the shorter problem's (in the same order)
        long_duration, long_start = res.duration, res.start
        long_end, long_transfer = res.end, res.transfer_start
        duration, start = long_duration.copy(), long_start.copy()
        end, transfer = long_end.copy(), long_transfer.copy()
        later, kept = shift.later[u], shift.kept[u]
        for j in opened[u]:
            m: int = later[j]  # type: ignore[assignment]  # not None: checked by _state_matches
            duration[j] = long_duration[m]
            end[j] = long_end[m] - span
            start[j] = long_start[m] - span
            issued = long_transfer[m]
            transfer[j] = issued - span if issued >= 0 else -1.0
        # the nodes started, or whose transfer started, at ``a`` (a few): as they did
        a_end = a.end[u]
        for j, (began, issued, *_) in a.live[u].items():
            if kept[j] and a_end[j] < 0:  # of ``opened``
                if began >= 0:
                    start[j] = began
                if issued >= 0:
                    transfer[j] = issued
        units.append(
            UnitResult(
                sunit,
                list(itertools.compress(res.kind, kept)),
                list(itertools.compress(duration, kept)),
                list(itertools.compress(start, kept)),
                list(itertools.compress(end, kept)),
                list(itertools.compress(transfer, kept)),
                [],
            )
        )
    iteration = max((max(r.end, default=0.0) for r in units), default=0.0)
    return Replay(units, iteration)


def _anchors(
    problem: Problem, indexed: Sequence[_Indexed], micro_batches: Sequence[int]
) -> list[tuple[int, int]]:
    """(0, position in ``problem``) of the first node of each of ``micro_batches`` on the first
    unit (the instants whose states are compared), none where one is missing."""
    index = indexed[0]
    position = {n.id: j for j, n in enumerate(problem.units[0].nodes)}
    found = []
    for mb in micro_batches:
        members = index.members.get(mb)
        if mb < 0 or not members or index.nodes[members[0]].id not in position:
            return []
        found.append((0, position[index.nodes[members[0]].id]))
    return found


def drain_micro_batches(stages: int, chunks: int = 1, extra_warmup: int = 0) -> int:
    """The micro-batches the fill (and, alike, the drain) of a pipeline schedule spans on its
    first stage: one per stage for 1F1B and GPipe; for an interleaved schedule of ``chunks``
    model chunks per stage, its first stage's warm-up of ``2 * (stages - 1) + (chunks - 1) *
    stages`` forward chunks (Megatron-LM's forward_backward_pipelining_with_interleaving,
    megatron/core/pipeline_parallel/schedules.py, ``num_warmup_microbatches``), ``chunks`` of
    them per micro-batch. ``extra_warmup``: forward chunks the warm-up runs beyond the
    schedule's (one under ``overlap_moe_ep_comm``: :func:`stg.core.schedules.ep_overlap_groups`)."""
    if chunks <= 1:
        return stages + extra_warmup
    warmup = 2 * (stages - 1) + (chunks - 1) * stages + extra_warmup
    return max(stages, -(-warmup // chunks))


def _fill(stages: int, period: int, chunks: int = 1, extra_warmup: int = 0) -> int:
    """The fill (:func:`drain_micro_batches`) in whole periods."""
    return _whole_periods(drain_micro_batches(stages, chunks, extra_warmup), period)


def first_keep(stages: int, period: int, chunks: int = 1, extra_warmup: int = 0) -> int:
    """The micro-batches of the shorter reduced replay first tried with ``period``: the fill
    and the drain take up to :func:`drain_micro_batches` each, and the cut lies between them
    (:func:`cut_at`), a period after the fill."""
    return 2 * _fill(stages, period, chunks, extra_warmup) + period


def cut_at(keep: int, stages: int, period: int, chunks: int = 1, extra_warmup: int = 0) -> int:
    """The first micro-batch of the shorter replay of ``keep`` micro-batches whose nodes run one
    period later in the longer one: the drain's micro-batches before the end stay after it."""
    fill = _fill(stages, period, chunks, extra_warmup)
    return period * ((keep - fill) // period)


def state_keep(stages: int, period: int, chunks: int = 1, extra_warmup: int = 0) -> int:
    """The micro-batches of the shortest reduced replay whose period the state check can
    prove (:func:`_short_from_long`): the fill (:func:`drain_micro_batches`, in whole periods)
    and one period, so that the first unit starts micro-batch ``c`` (its first after the
    fill) in the steady state. The longer replay adds one period: ``c + 2 period`` in all,
    against :func:`first_keep`'s ``2 c + 2 period`` where the two replays are matched
    micro-batch by micro-batch (:func:`_aligned`), whose drain must leave the cut alone."""
    return _fill(stages, period, chunks, extra_warmup) + period


def state_anchor(
    keep: int, stages: int, period: int, chunks: int = 1, extra_warmup: int = 0
) -> int:
    """The micro-batch ``c`` at whose start on the first unit the state check compares the
    shorter replay of ``keep`` micro-batches with the longer one a period later: the first
    after the fill, or the cut's period (:func:`cut_at`) where that is later."""
    fill = _fill(stages, period, chunks, extra_warmup)
    return max(fill, cut_at(keep, stages, period, chunks, extra_warmup) - period)


def _keeps(
    stages: int, period: int, chunks: int, settled: int | None, extra_warmup: int = 0
) -> Iterator[tuple[int, bool]]:
    """The shorter replays' micro-batches tried in turn, each with whether the state check
    alone proves it: ``settled`` where that check applies to it (:func:`state_keep` or more,
    the longer replay the problem itself), then :func:`first_keep`, doubled on each
    failure."""
    if settled is not None:
        yield settled, True
    keep = first_keep(stages, period, chunks, extra_warmup)
    while True:
        yield keep, False
        keep *= 2


def _whole_periods(micro_batches: int, period: int) -> int:
    """``micro_batches`` rounded up to whole periods (an interleaved period is a group of
    micro-batches that goes through every chunk together)."""
    return period * -(-micro_batches // period)


def replay_periodic(
    problem: Problem,
    *args: Any,
    only_if_cheaper: bool = True,
    micro_batches: int | None = None,
    name_at: NameAt | None = None,
    only_period: int | None = None,
    checked: Mapping[int, int] | None = None,
    chunks: int = 1,
    extra_warmup: int = 0,
    **options: Any,
) -> PeriodicReplay | None:
    """The iteration time, per-unit breakdowns and critical path of ``problem`` from two
    reduced problems one verified period apart (see the module docstring: the longer one
    replayed, the shorter one read off its states where they repeat, else replayed too);
    ``args`` and ``options`` go to :func:`stg.perf.replay.replay`. None where the check
    fails, or (``only_if_cheaper``) the two reduced replays would take more than half the
    whole one: replay it whole.

    ``micro_batches``: the iteration has that many micro-batches, of which ``problem`` holds
    the schedule of only its first ones (a workload lowered for fewer micro-batches:
    :func:`stg.core.pipeline.build_workload`'s ``lowered_micro_batches``); its replays are
    extrapolated to the whole iteration, and ``name_at(node, micro_batch)`` names a node's
    alike of a micro-batch that ``problem`` lacks (for the critical path). ``only_period``: try
    only that period (else one micro-batch, then one per stage). ``checked``: per period, the
    shorter replays' micro-batches that failed the check already (the same replays of a
    workload lowered for fewer micro-batches): only longer ones are tried. ``chunks``: model
    chunks per stage (an interleaved schedule's virtual stages), whose fill and drain span
    more micro-batches (:func:`drain_micro_batches`), as do ``extra_warmup`` forward chunks
    beyond the schedule's warm-up.

    Where ``problem`` holds :func:`state_keep` micro-batches and a period (a workload lowered
    for them), that shorter replay is tried first, proved by the state check alone; then
    :func:`first_keep`'s, doubled while the check fails."""
    if not problem.units:
        return None
    stages = len({u.stage for u in problem.units})
    read_off = not options.get("tp_comm_overlap")
    periods = [only_period] if only_period else sorted({1, max(1, stages)})
    # the first unit's micro-batches (every unit's must be the same): where they leave no
    # replay worth trying, the others are not looked at
    first = _declared_micro_batches(problem.units[0].nodes)
    declared = {mb for mb in first if mb is not None}
    built = len(declared)
    if not declared or max(declared) + 1 != built:
        return None
    total = built if micro_batches is None else micro_batches
    if total < built or (total > built and name_at is None):
        return None
    tries = []
    for period in periods:
        if total % period or (built - total) % period:
            continue
        keeps = _keeps_worth_trying(
            stages, period, chunks, read_off, built, total, checked, only_if_cheaper, extra_warmup
        )
        if keeps:
            tries.append((period, keeps))
    if not tries:
        return None
    indexed, counted = _indexed_units(problem, first)
    if counted != built:
        return None
    per_unit = [index.micro_batch for index in indexed]
    for period, keeps in tries:
        for keep, state_only in keeps:
            # first with the drain's waits of the schedule of as many micro-batches (what a
            # lowered workload's shorter problem is), then as the reduction gives the drain;
            # a keep whose check cannot be made ends the period's tries
            tails = (True, False)
            # one longer replay for both where it is the problem itself, else one each
            groups = [tails] if keep + period == built else [(tail,) for tail in tails]
            raised = 0
            for group in groups:
                try:
                    result = _try_keep(
                        problem, args, options, indexed, per_unit, built, total, keep, period,
                        stages, chunks, read_off, name_at, group, extra_warmup=extra_warmup,
                        state_only=state_only,
                    )  # fmt: skip
                except (_NotPeriodic, TraceError):
                    raised += 1
                    continue
                if result is not None:
                    return result
            if raised == len(groups):
                break
    return None


def _keeps_worth_trying(
    stages: int,
    period: int,
    chunks: int,
    read_off: bool,
    built: int,
    total: int,
    checked: Mapping[int, int] | None,
    only_if_cheaper: bool,
    extra_warmup: int = 0,
) -> list[int]:
    """The shorter replays' micro-batches to try with ``period`` (:func:`_keeps`), in order,
    on a problem of ``built`` micro-batches standing for ``total``: those not ``checked``
    already, whose longer replay fits in the problem and (``only_if_cheaper``) whose two
    reduced replays, about ``2 keep + period`` micro-batches, cost at most half the full
    replay (should the check fail, as where a transient decays without ever repeating
    exactly, the full replay follows them).

    The state check's keep only where its longer replay is the problem itself (a workload
    lowered for it): :func:`state_keep` micro-batches, or whole periods more where a
    transient outlasts the fill (the anchor then that many periods after the fill; as where
    a stage of a lighter last chunk runs ahead of the others for a while); a reduced
    problem's drain waits for the kept ancestors of its dropped nodes, more
    than the schedule of as many micro-batches may (as where a backward's gather follows the
    dropped forward's on the communicator's stream and comes to wait for the compute before
    it too), and the check would compare two drains alike in that, not the problem's."""
    fewest = state_keep(stages, period, chunks, extra_warmup)
    settled: int | None = built - period
    # the problem itself as the longer replay: at the fewest, or whole periods later on a
    # workload lowered for it (the whole one would replay once for nothing)
    if (
        not read_off
        or settled < fewest
        or (settled - fewest) % period
        or (settled > fewest and total == built)
    ):
        settled = None
    found: list[tuple[int, bool]] = []
    for keep, state_only in _keeps(stages, period, chunks, settled, extra_warmup):
        if checked and keep <= checked.get(period, 0):
            continue
        if keep + period > built or (2 * (2 * keep + period) > total and only_if_cheaper):
            if state_only and total > built:
                continue  # one replay, of the lowered problem itself: the shorter read off
            return found
        found.append((keep, state_only))


def _try_keep(
    problem: Problem,
    args: tuple[Any, ...],
    options: Mapping[str, Any],
    indexed: list[_Indexed],
    per_unit: list[list[int | None]],
    built: int,
    total: int,
    keep: int,
    period: int,
    stages: int,
    chunks: int,
    read_off: bool,
    name_at: NameAt | None,
    tails: tuple[bool, ...] = (False,),
    extra_warmup: int = 0,
    state_only: bool = False,
) -> PeriodicReplay | None:
    """:func:`replay_periodic` with the shorter reduced replay of ``keep`` micro-batches, None
    where the check fails (:class:`_NotPeriodic` or a :class:`TraceError` where the reduced
    problems are no schedule of theirs, for every one of ``tails``). With ``state_only`` (the
    longer problem then ``problem`` itself, ``keep`` its micro-batches less a period), only the
    state check proves the period, at the start of the shorter problem's last period: the
    shorter replay is read off the longer one's states and the nodes that run a period later
    in the longer one are those not finished at the first instant compared. Else the two
    replays (the shorter one read off where the states repeat) are matched micro-batch by
    micro-batch (:func:`_aligned`). ``tails``: tried in
    turn on the one longer replay, whether the reduced problems' last micro-batches wait as
    the schedule of as many micro-batches has them wait (:func:`_tail_deps`: with the
    smallest keep, its last period, which the state check requires untouched at the first
    instant) or as the reduction gives them (as a longer problem reduced from ``problem``
    has them wait)."""
    cut = cut_at(keep, stages, period, chunks, extra_warmup)
    smallest = state_only  # the state check alone, the longer replay the problem itself
    # the two problems share most node objects; the smallest keep replays only the longer one
    costs = Costs(nodes_again=not smallest)
    # a tail: the reduced problems' micro-batches toward the drain wait as in the schedule of
    # as many (_tail_deps), where the drain's waits differ from a steady micro-batch's
    drain = _fill(stages, period, chunks, extra_warmup) + period
    longer = problem
    if keep + period < built:
        tail_from = keep + period - drain if tails[0] else None
        longer = _reduced(problem, keep + period, built, indexed, tail_from=tail_from)
    anchors: list[tuple[int, int]] = []
    if read_off:
        # the state check alone compares the start of the shorter problem's last period
        first = (
            keep - period if smallest else state_anchor(keep, stages, period, chunks, extra_warmup)
        )
        anchors = _anchors(longer, indexed, [first, first + period])
    long = replay(longer, *args, costs=costs, states_at=anchors, **options)
    # where the longer problem is the whole one, the engine's dependency lists are by its
    # positions: the shorter problem looks only at the nodes that wait for a dropped one
    children = long.prepared.children if long.prepared and longer is problem else None

    def with_shorter(reduction: _Reduction) -> PeriodicReplay | None:
        """The check and extrapolation with the shorter problem of ``reduction``."""
        shorter = reduction.problem
        found = None
        if len(long.states) == len(anchors) > 1:
            shift = _Shift(longer, shorter, indexed, period, reduction)
            tolerance = TOLERANCE * max(long.iteration_time, 1e-300)
            found = _short_from_long(long, longer, shorter, shift, tolerance)
        shifted: Sequence[Sequence[bool]]
        if found is not None and smallest:
            # the full problem is the longer one up to the second instant, the span between
            # the two repeated, and the rest of the longer one: a node not finished at the
            # first instant runs as its alike a period later does, a period later (see
            # _extended_path)
            short, shifted = found
            period_time = long.iteration_time - short.iteration_time
        elif smallest:
            return None  # the micro-batches before the cut would not run as in the longer one
        else:
            short = (
                found[0] if found is not None else replay(shorter, *args, costs=costs, **options)
            )
            for res in short.units:  # the path is walked in the longer replay alone
                res.cause = []
            aligned = _aligned(short, long, indexed, period, cut)
            if aligned is None:
                return None
            period_time = aligned[0]
            shifted = [[partner[1] for partner in unit] for unit in aligned[1]]
        periods = (total - keep) // period
        path = _extended_path(
            long, shifted, indexed, per_unit, period, periods, period_time, name_at
        )
        if path is None:
            return None
        result = _extrapolate(short, long, total, keep, period, period_time, path, indexed)
        result.replays = 1 if found is not None else 2
        return result

    raised = 0
    try:
        for tail in tails:
            try:
                # the smallest keep's shorter problem is only read off: its last period alone
                # (untouched at the first instant) can wait as the drain's micro-batches do
                tail_from = (keep - period if smallest else keep - drain) if tail else None
                # the shorter problem takes the ends from its queues as its schedule would,
                # where its positions are known (reduced from the longer problem itself)
                result = with_shorter(
                    _reduction(
                        problem, keep, built, indexed, children, tail_from, longer is problem
                    )
                )
            except (_NotPeriodic, TraceError):
                raised += 1
                continue
            if result is not None:
                return result
    finally:
        long.states, long.prepared = [], None
    if raised == len(tails):
        raise _NotPeriodic
    return None


def _extended_path(
    long: Replay,
    shifted: Sequence[Sequence[bool]],
    indexed: Sequence[_Indexed],
    per_unit: list[list[int | None]],
    period: int,
    periods: int,
    period_time: float,
    name_at: NameAt | None = None,
) -> list[dict[str, Any]] | None:
    """The full problem's critical path (:func:`stg.perf.replay.critical_path`), walked back
    from its last node along what gated each node: the longer replay's, with the periods the
    full problem has beyond it in between. ``shifted``: per unit and node of the longer replay,
    whether it runs a period later there than its partner in the shorter one (after the cut,
    or not finished at the first instant the state check compared). A shifted node in copy
    ``c`` (``c`` periods later than in the longer replay) was gated by the copy ``c`` of what
    gated it there; where that is not shifted, by copy ``c - 1`` of its alike one period later.
    Where the walk enters a copy at the node where it entered the one after, it crosses every
    copy down to 1 the same way: that copy's runs are given once, with ``repeats`` and
    ``period_s`` (see :attr:`PeriodicReplay.critical_path`). None where a node has no shifted
    alike a period later."""
    positions: dict[int, Mapping[int, int]] = {}
    """per unit, where the walk needs it: each node's position in the longer replay, by id"""

    def later(u: int, j: int) -> int:
        """The longer replay's node one period after node ``j`` of unit ``u``."""
        index = indexed[u]
        nodes = long.units[u].unit.nodes
        k = index.position[nodes[j].id]
        mb = index.micro_batch[k]
        if mb is None:
            raise _NotPeriodic
        full = index.same_in(k, mb + period)
        if u not in positions:
            positions[u] = (
                index.position if nodes is index.nodes else {n.id: i for i, n in enumerate(nodes)}
            )
        if full is None or index.nodes[full].id not in positions[u]:
            raise _NotPeriodic
        return positions[u][index.nodes[full].id]

    def full_name(u: int, j: int, copies: int) -> str:
        """The name of node ``j`` of the longer replay's unit ``u``, ``copies`` periods
        later."""
        node = long.units[u].unit.nodes[j]
        if not copies:
            return node.name
        index = indexed[u]
        k = index.position[node.id]
        mb = index.micro_batch[k]
        if mb is None:
            return node.name
        if mb + copies * period not in index.members and name_at is not None:
            return name_at(node, mb + copies * period)
        target = index.same_in(k, mb + copies * period)
        if target is None:
            raise _NotPeriodic
        return index.nodes[target].name

    best: tuple[float, int, int] | None = None  # as critical_chain: the first that ends last
    for unit, res in enumerate(long.units):
        if res.end:
            last = max(res.end)
            if best is None or last > best[0]:
                best = (last, unit, res.end.index(last))
    if best is None:
        return []
    _, u, j = best
    copies = periods - 1 if shifted[u][j] else 0
    # walked back from the last node: (unit, node, copies), latest first
    walked: list[tuple[int, int, int]] = []
    segment: list[tuple[int, int, int]] = []
    """the nodes walked since the path last entered an earlier copy"""
    repeated: list[tuple[int, int, int]] = []
    repeats = 0
    entry: tuple[int, int] | None = None
    limit = sum(len(mbs) for mbs in per_unit) * (periods + 1)  # nodes of the full problem
    causes = [res.cause for res in long.units]
    try:
        while True:
            segment.append((u, j, copies))
            cause = causes[u][j]
            if cause is None:
                break
            cu, cj = cause
            if copies and not shifted[cu][cj]:
                cj = later(cu, cj)
                if not shifted[cu][cj]:
                    raise _NotPeriodic
                copies -= 1
                if copies and not repeats and entry == (cu, cj):
                    # entered this copy where it entered the last one: the walk (which does
                    # not depend on the copy, but for copy 0) repeats that copy's nodes in
                    # every copy down to 1
                    repeats = copies + 1
                    repeated = [(su, sj, 1) for su, sj, _ in segment]
                    copies = 0
                else:
                    walked.extend(segment)
                segment = []
                entry = (cu, cj)
            u, j = cu, cj
            if len(walked) + len(segment) > limit:
                raise _NotPeriodic  # a cycle of causes
        walked.extend(segment)
        if not repeats:
            return _runs(walked[::-1], long, full_name, period_time)
        after = len(walked) - len(segment)
        return [
            *_runs(segment[::-1], long, full_name, period_time),
            *(
                dict(run, repeats=repeats, period_s=period_time)
                for run in _runs(repeated[::-1], long, full_name, period_time)
            ),
            *_runs(walked[:after][::-1], long, full_name, period_time),
        ]
    except _NotPeriodic:
        return None


def _runs(
    chain: Sequence[tuple[int, int, int]],
    long: Replay,
    full_name: Callable[[int, int, int], str],
    period_time: float,
) -> list[dict[str, Any]]:
    """:func:`stg.perf.replay.path_runs` of a chain of (unit, node, copies) of the longer
    replay, each node ``copies`` periods later; only the runs' first and last nodes named."""
    runs: list[dict[str, Any]] = []
    ranks = [res.unit.rank for res in long.units]
    kinds = [res.kind for res in long.units]
    run: dict[str, Any] = {}
    rank = kind = None
    count = 0
    last = (0, 0, 0)
    for u, j, copies in chain:
        if ranks[u] == rank and KIND_NAMES[kinds[u][j]] == kind:
            count += 1  # the run's end and last node are set once it is over
        else:
            if runs:
                _close_run(run, count, last, long, full_name, period_time)
            rank, kind = ranks[u], KIND_NAMES[kinds[u][j]]
            res = long.units[u]
            name = full_name(u, j, copies)
            delay = copies * period_time
            run = {
                "rank": rank,
                "kind": kind,
                "start_s": res.start[j] + delay,
                "end_s": res.end[j] + delay,
                "nodes": 1,
                "first": name,
                "last": name,
            }
            runs.append(run)
            count = 1
        last = (u, j, copies)
    if runs:
        _close_run(run, count, last, long, full_name, period_time)
    return runs


def _close_run(
    run: dict[str, Any],
    count: int,
    last: tuple[int, int, int],
    long: Replay,
    full_name: Callable[[int, int, int], str],
    period_time: float,
) -> None:
    """Give a run of :func:`_runs` its ``count`` nodes and its ``last`` node's end and name."""
    u, j, copies = last
    run["end_s"] = long.units[u].end[j] + copies * period_time
    run["nodes"] = count
    run["last"] = full_name(u, j, copies)


def _base(node: Any) -> tuple[Any, ...]:
    return (node.type, node_op(node), node_part(node), node_phase(node), node_role(node))


def _extrapolate(
    short: Replay,
    long: Replay,
    total: int,
    keep: int,
    period: int,
    period_time: float,
    path: list[dict[str, Any]],
    indexed: Sequence[_Indexed],
) -> PeriodicReplay:
    periods = (total - keep) // period
    iteration = short.iteration_time + periods * period_time
    breakdowns = []
    for s_res, l_res in zip(short.units, long.units, strict=True):
        first = unit_breakdown(s_res, short.iteration_time)
        second = unit_breakdown(l_res, long.iteration_time)
        # each figure is a duration (>= 0); one that does not grow with the periods (an
        # exposed communication of 0) differs between the two replays by rounding, which the
        # periods multiply: below 0 is that rounding (stg.perf.replay.nonnegative_duration)
        breakdowns.append(
            {k: nonnegative_duration(first[k] + periods * (second[k] - first[k])) for k in first}
        )
    flops = []
    for l_res, index in zip(long.units, indexed, strict=True):
        # the longer problem is the shorter one and micro-batches keep to keep + period (alike
        # nodes: the reduction keeps their FLOPs and phase); integer sums, in any order
        l_hw, l_model = unit_flops(l_res.unit)
        members = index.members
        added = [index.nodes[k] for mb in range(keep, keep + period) for k in members.get(mb, ())]
        d_hw, d_model = _flops(added)
        flops.append((l_hw - d_hw + periods * d_hw, l_model - d_model + periods * d_model))
    return PeriodicReplay(iteration, breakdowns, path, period, period_time, keep, total, flops)


def unit_flops(unit: Unit) -> tuple[int, int]:
    """The (hardware, model) FLOPs of one rank of ``unit``: every compute node's, and those of
    the nodes that are not recomputation."""
    return _flops(unit.nodes)


def _is_recompute(node: Any) -> bool:
    return node_phase(node) is Phase.RECOMPUTE


_BASE_ATTRS = (OP_ATTR, LAYER_ATTR, PART_ATTR, PHASE_ATTR, ROLE_ATTR)
"""the attributes :meth:`_Indexed.base` reads, in the compiled pass's order"""


def _flops(nodes: Iterable[Any]) -> tuple[int, int]:
    """:func:`unit_flops` of ``nodes``."""
    engine = _replay_module.compiled_engine
    if engine is not None and isinstance(nodes, (list, tuple)):
        found = engine.flops(
            nodes, NodeType.COMP, Role.ORTHOGONALIZE, ROLE_ATTR, PHASE_ATTR, _is_recompute
        )
        if found is not NotImplemented:
            return found
    return _python_flops(nodes)


def _python_flops(nodes: Iterable[Any]) -> tuple[int, int]:
    """:func:`_flops` in Python (what the compiled pass does)."""
    hardware = model = 0
    comp = NodeType.COMP
    recomputed: dict[int | str, bool] = {}
    """per phase code: whether it is the recomputation's (a code's meaning looked up once)"""
    for node in nodes:
        if node.type is comp:
            ops = node.num_ops
            if ops > 0:
                hardware += ops
                try:
                    attrs = node.attrs
                except AttributeError:
                    attrs = None
                if attrs and attrs.get(ROLE_ATTR) == Role.ORTHOGONALIZE:
                    continue  # Muon's optimizer work: hardware FLOPs, not the model's
                code = attrs.get(PHASE_ATTR) if attrs else None
                if type(code) is int or type(code) is str:
                    again = recomputed.get(code)
                    if again is None:
                        again = recomputed[code] = node_phase(node) is Phase.RECOMPUTE
                    if not again:
                        model += ops
                else:
                    model += ops
    return hardware, model
