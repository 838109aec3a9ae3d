"""The periodic replay: a pipeline schedule's steady state replayed once, not once per period.

After its fill, a pipeline schedule repeats a *period* (1F1B and GPipe: one micro-batch;
interleaved: one group of ``stages`` micro-batches) on every stage with the same dependencies,
until its drain. :func:`replay_periodic` replays two reduced problems (:func:`reduced_problem`:
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

Nodes are matched by their typed attributes (:data:`stg.core.workload.NODE_SEMANTICS`): the
micro-batch, and within it the type, op, part, phase and role, counted in id order.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stg.core.workload import (
    LAYER_ATTR,
    OP_ATTR,
    PART_ATTR,
    PHASE_ATTR,
    ROLE_ATTR,
    NodeType,
    Phase,
    node_micro_batch,
    node_op,
    node_part,
    node_phase,
    node_role,
)
from stg.errors import TraceError
from stg.perf.replay import (
    KIND_NAMES,
    Costs,
    Problem,
    Replay,
    Unit,
    replay,
    unit_breakdown,
)

TOLERANCE = 1e-12
"""How far (relative to the iteration time) a node's instants may differ from its partner's
shifted by one period: the rounding of adding the same durations to a later start."""

NameAt = Callable[[Any, int], str]
"""The name of a node's alike in another micro-batch (``name_at(node, micro_batch)``)."""

Key = tuple[Any, ...]
"""A node's identity within its micro-batch: (type, op, part, phase, role, occurrence)."""


@dataclass
class PeriodicReplay:
    """The full problem's iteration time and per-unit breakdowns, extrapolated from two
    reduced replays that differ by one verified period."""

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


class _Indexed:
    """One unit's nodes with their micro-batch, the positions of each micro-batch's nodes, and
    (worked out per micro-batch where needed) each node's key."""

    def __init__(
        self,
        nodes: Sequence[Any],
        micro_batch: list[int | None],
        shared: dict[tuple[Any, ...], tuple[Any, ...]] | None = None,
    ) -> None:
        self.nodes = nodes
        self.micro_batch = micro_batch
        self.position: Mapping[int, int] | range
        """each node's position, by id (a range where every id is its position)"""
        if all(n.id == i for i, n in enumerate(nodes)):
            self.position = range(len(nodes))
        else:
            self.position = {n.id: i for i, n in enumerate(nodes)}
        self.members: dict[int, list[int]] = {}
        self.unbatched: list[int] = []
        """positions of the nodes outside the micro-batches"""
        for i, mb in enumerate(micro_batch):
            if mb is None:
                self.unbatched.append(i)
            else:
                self.members.setdefault(mb, []).append(i)
        self.keys: dict[int, Key] = {}
        self.by_key: dict[tuple[int, Key], int] = {}
        self.indexed: set[int] = set()
        self.bases: dict[int, tuple[Any, ...]] = {}
        """each node's :func:`_base` (by position), worked out once"""
        self.shared = {} if shared is None else shared
        """:func:`_base` by the raw values of the attributes it reads and their types (a pure
        function of them): alike nodes of every micro-batch (and unit) share one entry"""

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


def _micro_batches(problem: Problem) -> tuple[list[list[int | None]], int | None]:
    """Each unit's nodes' micro-batches, and how many micro-batches there are (None unless
    every unit has the same number, from 0)."""
    per_unit = [[node_micro_batch(n) for n in unit.nodes] for unit in problem.units]
    counts = set()
    for mbs in per_unit:
        declared = {mb for mb in mbs if mb is not None}
        if not declared or len(declared) != max(declared) + 1:
            return per_unit, None
        counts.add(len(declared))
    return per_unit, (counts.pop() if len(counts) == 1 else None)


def reduced_problem(problem: Problem, keep: int) -> Problem:
    """The problem with only its first ``keep`` micro-batches: the schedule of ``keep``
    micro-batches. A kept micro-batch's node that waits for a dropped one (a forward that
    the schedule orders before it) waits for what that one waits for instead; a node outside
    the micro-batches (a gradient reduction, the optimizer) that waits for micro-batch
    ``y`` of the ``M`` waits for the same node of micro-batch ``y - (M - keep)``."""
    per_unit, total = _micro_batches(problem)
    if total is None:
        raise ValueError("the problem's units do not declare the same micro-batches")
    shared: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    indexed = [
        _Indexed(u.nodes, mbs, shared) for u, mbs in zip(problem.units, per_unit, strict=True)
    ]
    return _reduced(problem, keep, total, indexed)


def _reduced(problem: Problem, keep: int, total: int, indexed: Sequence[_Indexed]) -> Problem:
    shift = total - keep
    units: list[Unit] = []
    for unit, index in zip(problem.units, indexed, strict=True):
        mbs = index.micro_batch
        nodes = index.nodes
        position = index.position
        frontier: dict[int, tuple[int, ...]] = {}

        kept_nodes = []
        group_keys: dict[int, Any] = {}
        kept = list(index.unbatched)
        for mb in range(keep):
            kept.extend(index.members.get(mb, ()))
        kept.sort()
        for i in kept:
            mb = mbs[i]
            node = nodes[i]
            deps = (*node.data_deps, *node.ctrl_deps)
            ending = _end_deps(index, i, keep, shift, total)
            if ending:
                deps = (*deps, *(d for d in ending if d not in deps))
            for d in deps:
                m = mbs[position[d]]
                if m is not None and m >= keep:
                    break
            else:
                if ending:
                    node = dataclasses.replace(node, data_deps=deps, ctrl_deps=())
                if i in unit.group_keys:
                    group_keys[len(kept_nodes)] = unit.group_keys[i]
                kept_nodes.append(node)
                continue
            new_deps: dict[int, None] = {}
            for d in deps:
                k = position[d]
                if _kept(mbs[k], keep):
                    new_deps[d] = None
                elif mb is not None:
                    new_deps.update(dict.fromkeys(_kept_ancestors(index, k, keep, frontier)))
                else:
                    y = mbs[k] - shift
                    if y >= 0:
                        partner = index.same_in(k, y)
                        if partner is None:
                            raise _NotPeriodic
                        new_deps[nodes[partner].id] = None
            if i in unit.group_keys:
                group_keys[len(kept_nodes)] = unit.group_keys[i]
            kept_nodes.append(dataclasses.replace(node, data_deps=tuple(new_deps), ctrl_deps=()))
        units.append(dataclasses.replace(unit, nodes=kept_nodes, group_keys=group_keys))
    return Problem(units, problem.unit_of_rank, problem.comm_groups, problem.world_size)


def _end_deps(index: _Indexed, i: int, keep: int, shift: int, total: int) -> tuple[int, ...]:
    """The nodes outside the micro-batches that the alike of node ``i`` (micro-batch ``x``)
    in micro-batch ``x + shift`` waits for, where that one is dropped: in the schedule of
    ``keep`` micro-batches, micro-batch ``x`` is where ``x + shift`` is in the whole one, and
    waits for the same end-of-iteration nodes (a collective of the last micro-batch's backward
    issued after the head's gradient reduction on the same communicator)."""
    mb = index.micro_batch[i]
    if mb is None or shift == 0:
        return ()
    y = mb + shift
    if y < keep or y >= total:
        return ()
    partner = index.same_in(i, y)
    if partner is None:
        raise _NotPeriodic
    node = index.nodes[partner]
    position, mbs = index.position, index.micro_batch
    return tuple(d for d in (*node.data_deps, *node.ctrl_deps) if mbs[position[d]] is None)


def _kept_ancestors(
    index: _Indexed, i: int, keep: int, frontier: dict[int, tuple[int, ...]]
) -> tuple[int, ...]:
    """The ids of the kept nodes that dropped node ``i`` waits for, through dropped ones
    (``frontier``: those found so far, by dropped node)."""
    nodes, mbs, position = index.nodes, index.micro_batch, index.position
    stack = [i]
    while stack:
        j = stack[-1]
        if j in frontier:
            stack.pop()
            continue
        deps = [position[d] for d in (*nodes[j].data_deps, *nodes[j].ctrl_deps)]
        missing = [k for k in deps if not _kept(mbs[k], keep) and k not in frontier]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        found: dict[int, None] = {}
        for k in deps:
            if _kept(mbs[k], keep):
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


def drain_micro_batches(stages: int, chunks: int = 1) -> int:
    """The micro-batches the fill (and, alike, the drain) of a pipeline schedule spans on its
    first stage: one per stage for 1F1B and GPipe; for an interleaved schedule of ``chunks``
    model chunks per stage, its first stage's warm-up of ``2 * (stages - 1) + (chunks - 1) *
    stages`` forward chunks (Megatron-LM's forward_backward_pipelining_with_interleaving,
    megatron/core/pipeline_parallel/schedules.py, ``num_warmup_microbatches``), ``chunks`` of
    them per micro-batch."""
    if chunks <= 1:
        return stages
    warmup = 2 * (stages - 1) + (chunks - 1) * stages
    return max(stages, -(-warmup // chunks))


def first_keep(stages: int, period: int, chunks: int = 1) -> int:
    """The micro-batches of the shorter reduced replay first tried with ``period``: the fill
    and the drain take up to :func:`drain_micro_batches` each, and the cut lies between them
    (:func:`cut_at`), a period after the fill."""
    return 2 * _whole_periods(drain_micro_batches(stages, chunks), period) + period


def cut_at(keep: int, stages: int, period: int, chunks: int = 1) -> int:
    """The first micro-batch of the shorter replay of ``keep`` micro-batches whose nodes run one
    period later in the longer one: the drain's micro-batches before the end stay after it."""
    return period * ((keep - _whole_periods(drain_micro_batches(stages, chunks), period)) // period)


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
    **options: Any,
) -> PeriodicReplay | None:
    """The iteration time, per-unit breakdowns and critical path of ``problem`` from two
    reduced replays one verified period apart (see the module docstring); ``args`` and
    ``options`` go to :func:`stg.perf.replay.replay`. None where the check fails, or
    (``only_if_cheaper``) the two reduced replays would take more than half the whole one:
    replay it whole.

    ``micro_batches``: the iteration has that many micro-batches, of which ``problem`` holds
    the schedule of only its first ones (a workload lowered for fewer micro-batches:
    :func:`stg.core.pipeline.build_workload`'s ``lowered_micro_batches``); its replays are
    extrapolated to the whole iteration, and ``name_at(node, micro_batch)`` names a node's
    alike of a micro-batch that ``problem`` lacks (for the critical path). ``only_period``: try
    only that period (else one micro-batch, then one per stage). ``checked``: per period, the
    shorter replays' micro-batches that failed the check already (the same replays of a
    workload lowered for fewer micro-batches): only longer ones are tried. ``chunks``: model
    chunks per stage (an interleaved schedule's virtual stages), whose fill and drain span
    more micro-batches (:func:`drain_micro_batches`)."""
    per_unit, built = _micro_batches(problem)
    if built is None:
        return None
    total = built if micro_batches is None else micro_batches
    if total < built or (total > built and name_at is None):
        return None
    stages = len({u.stage for u in problem.units})
    indexed: list[_Indexed] = []  # once a replay is worth trying
    for period in [only_period] if only_period else sorted({1, max(1, stages)}):
        if total % period or (built - total) % period:
            continue
        keep = first_keep(stages, period, chunks)
        while checked and keep <= checked.get(period, 0):
            keep *= 2
        # the two reduced replays cost about 2 * keep + period micro-batches: worth it where
        # that is at most half the full replay (should the check fail, as where a transient
        # decays without ever repeating exactly, the full replay follows them)
        while keep + period <= built and (2 * (2 * keep + period) <= total or not only_if_cheaper):
            cut = cut_at(keep, stages, period, chunks)
            if not indexed:
                shared: dict[tuple[Any, ...], tuple[Any, ...]] = {}
                indexed = [
                    _Indexed(u.nodes, mbs, shared)
                    for u, mbs in zip(problem.units, per_unit, strict=True)
                ]
            costs = Costs()  # the two problems share most node objects
            try:
                short = replay(
                    _reduced(problem, keep, built, indexed), *args, costs=costs, **options
                )
                for res in short.units:  # the path is walked in the longer replay alone
                    res.cause = []
                longer = problem
                if keep + period < built:
                    longer = _reduced(problem, keep + period, built, indexed)
                long = replay(longer, *args, costs=costs, **options)
            except (_NotPeriodic, TraceError):
                break
            found = _aligned(short, long, indexed, period, cut)
            if found is not None:
                periods = (total - keep) // period
                path = _extended_path(
                    long, found[1], indexed, per_unit, period, periods, found[0], name_at
                )
                if path is not None:
                    return _extrapolate(short, long, total, keep, period, found[0], path)
            keep *= 2
    return None


def _extended_path(
    long: Replay,
    partners: list[list[Partner]],
    indexed: Sequence[_Indexed],
    per_unit: list[list[int | None]],
    period: int,
    periods: int,
    period_time: float,
    name_at: NameAt | None = None,
) -> list[dict[str, Any]] | None:
    """The full problem's critical path (:func:`stg.perf.replay.critical_path`), walked back
    from its last node along what gated each node: the longer replay's, with the periods the
    full problem has beyond it in between. A node after the cut in copy ``c`` (``c`` periods
    later than in the longer replay) was gated by the copy ``c`` of what gated it there; where
    that lies before the cut, by copy ``c - 1`` of its partner one period later. Where the walk
    enters a copy at the node where it entered the one after, it crosses every copy down to 1
    the same way: that copy's runs are given once, with ``repeats`` and ``period_s`` (see
    :attr:`PeriodicReplay.critical_path`). None where a node has no such partner."""
    positions = [{n.id: i for i, n in enumerate(res.unit.nodes)} for res in long.units]

    def later(u: int, j: int) -> int:
        """The longer replay's node one period after node ``j`` of unit ``u``."""
        index = indexed[u]
        k = index.position[long.units[u].unit.nodes[j].id]
        mb = index.micro_batch[k]
        if mb is None:
            raise _NotPeriodic
        full = index.same_in(k, mb + period)
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
        for i, end in enumerate(res.end):
            if best is None or end > best[0]:
                best = (end, unit, i)
    if best is None:
        return []
    _, u, j = best
    copies = periods - 1 if partners[u][j][1] else 0
    # walked back from the last node: (unit, node, copies), latest first
    walked: list[tuple[int, int, int]] = []
    segment: list[tuple[int, int, int]] = []
    """the nodes walked since the path last entered an earlier copy"""
    repeated: list[tuple[int, int, int]] = []
    repeats = 0
    entry: tuple[int, int] | None = None
    limit = sum(len(mbs) for mbs in per_unit) * (periods + 1)  # nodes of the full problem
    try:
        while True:
            segment.append((u, j, copies))
            cause = long.units[u].cause[j]
            if cause is None:
                break
            cu, cj = cause
            if copies and not partners[cu][cj][1]:
                cj = later(cu, cj)
                if not partners[cu][cj][1]:
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
    last: tuple[int, int, int] | None = None
    for u, j, copies in chain:
        res = long.units[u]
        rank, kind = res.unit.rank, KIND_NAMES[res.kind[j]]
        delay = copies * period_time
        if runs and runs[-1]["rank"] == rank and runs[-1]["kind"] == kind:
            run = runs[-1]
            run["end_s"] = res.end[j] + delay
            run["nodes"] += 1
        else:
            if runs and last is not None:
                runs[-1]["last"] = full_name(*last)
            name = full_name(u, j, copies)
            runs.append(
                {
                    "rank": rank,
                    "kind": kind,
                    "start_s": res.start[j] + delay,
                    "end_s": res.end[j] + delay,
                    "nodes": 1,
                    "first": name,
                    "last": name,
                }
            )
        last = (u, j, copies)
    if runs and last is not None:
        runs[-1]["last"] = full_name(*last)
    return runs


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
) -> PeriodicReplay:
    periods = (total - keep) // period
    iteration = short.iteration_time + periods * period_time
    breakdowns = []
    for s_res, l_res in zip(short.units, long.units, strict=True):
        first = unit_breakdown(s_res, short.iteration_time)
        second = unit_breakdown(l_res, long.iteration_time)
        breakdowns.append({k: first[k] + periods * (second[k] - first[k]) for k in first})
    flops = []
    for s_res, l_res in zip(short.units, long.units, strict=True):
        (s_hw, s_model), (l_hw, l_model) = unit_flops(s_res.unit), unit_flops(l_res.unit)
        flops.append((s_hw + periods * (l_hw - s_hw), s_model + periods * (l_model - s_model)))
    return PeriodicReplay(iteration, breakdowns, path, period, period_time, keep, total, flops)


def unit_flops(unit: Unit) -> tuple[int, int]:
    """The (hardware, model) FLOPs of one rank of ``unit``: every compute node's, and those of
    the nodes that are not recomputation."""
    hardware = model = 0
    comp = NodeType.COMP
    recomputed: dict[int | str, bool] = {}
    """per phase code: whether it is the recomputation's (a code's meaning looked up once)"""
    for node in unit.nodes:
        if node.type is comp:
            ops = node.num_ops
            if ops > 0:
                hardware += ops
                code = node.attrs.get(PHASE_ATTR) if getattr(node, "attrs", None) else None
                if type(code) is int or type(code) is str:
                    again = recomputed.get(code)
                    if again is None:
                        again = recomputed[code] = node_phase(node) is Phase.RECOMPUTE
                    if not again:
                        model += ops
                else:
                    model += ops
    return hardware, model
